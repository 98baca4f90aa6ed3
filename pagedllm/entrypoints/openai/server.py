"""The OpenAI-compatible HTTP server: FastAPI routes, errors in OpenAI's shape, API keys, uvicorn.

`pagedllm serve MODEL [--host 0.0.0.0] [--port 8000] [--api-key KEY] [--chat-template T] [engine options]`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
    TokenizeRequest, TokenizeResponse)
from pagedllm.entrypoints.openai.serving import REQUEST_LOGGER, APIError, OpenAIServing

logger = logging.getLogger("pagedllm.server")

def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None, chat_template: str | None = None,
              cors: dict | None = None) -> FastAPI:
    """The app for an engine that is not started yet; its lifespan starts and stops the engine loop. cors:
    CORSMiddleware's options (default: any origin, method and header, as vLLM allows)."""
    metrics = ServerMetrics(model_name, engine.config.max_model_len)
    serving = OpenAIServing(engine, model_name, metrics, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan)

    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    # Added last, so outermost: preflight requests carry no key, and browsers read errors (401s too) only with it.
    app.add_middleware(CORSMiddleware, **(cors or dict(allow_origins=["*"], allow_methods=["*"],
                                                        allow_headers=["*"])))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "The request body is not valid JSON.", None
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return _error(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(APIError(e.status_code, str(e.detail), type=kind))

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return _error(APIError(500, f"the engine stopped after an error: {engine.dead!r}", type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(engine.stats()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, root=engine.config.model, max_model_len=engine.config.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _respond(request, serving.chat(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        serving.need_tokenizer("tokenize")
        if body.messages is not None:
            _, ids = await serving.chat_prompt(body.messages, body)
        else:
            ids = await engine.call(
                lambda: serving.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        return TokenizeResponse(count=len(ids), max_model_len=engine.config.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        serving.need_tokenizer("detokenize")
        vocab = len(serving.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await engine.call(serving.tokenizer.decode, body.tokens))

    return app


class _APIKeyMiddleware:
    """The key guards the API (/v1 routes), not probes, scrapers or the tokenizer routes, as in vLLM. Plain ASGI
    middleware (not BaseHTTPMiddleware, which would sit between streams and disconnects)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(APIError(401, "Incorrect or missing API key.", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(e: APIError) -> JSONResponse:
    if e.status >= 500:
        logger.warning("%d %s", e.status, e.message)
    else:
        logger.info("%d %s", e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status)


async def _respond(request: Request, work):
    """Awaits a generation handler; a stream comes back as SSE. A client that disconnects before a
    non-streaming answer is ready cancels the handler, whose cleanup aborts its engine requests (for streams,
    StreamingResponse's own disconnect watch cancels the generator the same way)."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    result = task.result()
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return result


async def _wait_for_disconnect(request: Request) -> None:
    # The body was already read, so the only message left to receive is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- command line ---------------------------------------------------------------------------------------
def run_server(args: argparse.Namespace, engine_kwargs: dict) -> None:
    import uvicorn

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.disable_log_requests:
        logging.getLogger(REQUEST_LOGGER).setLevel(logging.WARNING)
    chat_template = load_chat_template(args.chat_template)
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(args.model, **engine_kwargs), args.max_waiting_requests)
    cors = dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app = build_app(engine, args.served_model_name or args.model, args.api_key, chat_template, cors)
    scheme = "https" if args.ssl_certfile else "http"
    logger.info("serving %s on %s://%s:%d (max_model_len=%d)", args.served_model_name or args.model, scheme,
                args.host, args.port, engine.config.max_model_len)
    # Our own log line per request replaces uvicorn's access log.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                root_path=args.root_path or "", ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
