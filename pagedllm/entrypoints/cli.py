"""Command line: `pagedllm generate|serve|bench ...` (also `python -m pagedllm`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from pagedllm.config import EngineConfig

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An integer flag as vLLM's launch lines write them: 4096, 25.6k (decimal suffixes k m g t), 4K (binary
    suffixes K M G T, whole numbers only)."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (examples: 4096, 32k, 25.6k, 4K)")
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (a fraction takes a decimal suffix k m g t)")
    return int(number) * _BINARY.get(suffix, 1)


_FLAG_TYPES = {"int": human_readable_int, "float": float, "str": str}


def _flag_type(field: dataclasses.Field) -> type:
    """The flag's type: the first of int, float and str in the field's annotation (a string: the module postpones
    them), so that fields whose default is None ("int | None") parse too."""
    names = [name.strip() for name in str(field.type).split("|")]
    return next(_FLAG_TYPES[name] for name in names if name in _FLAG_TYPES)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named like vLLM's (--max-model-len, --no-enable-prefix-caching, ...)."""
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            group.add_argument(flag, type=_flag_type(f), default=f.default)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def _generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop or None)
    prompts = args.prompt or ["Hello!"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}")
        for c in out.outputs:
            print(c.text.strip() if args.chat else c.text)
        print()


def _serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.openai.server import run_server

    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model} and --model {args.model_option}")
    args.model = args.model or args.model_option or "smollm2-135m-instruct"
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: pagedllm runs a model on one GPU")
    run_server(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="HF directory, .gguf file, or the alias smollm2-135m-instruct")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF directory, .gguf file, or the alias smollm2-135m-instruct (the default)")
    serve.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                       help="the same as MODEL, as vLLM takes it")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default: every interface, as vLLM)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PAGEDLLM_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="model name in the API (default: MODEL)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="answer 503 while this many requests wait to be scheduled")
    serve.add_argument("--log-level", "--uvicorn-log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    serve.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS: a JSON list")
    serve.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: a JSON list")
    serve.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: a JSON list")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--root-path", default=None, help="the path prefix of a proxy in front of the server")
    serve.add_argument("--ssl-keyfile", default=None)
    serve.add_argument("--ssl-certfile", default=None)
    compat = serve.add_argument_group("accepted as vLLM takes them")
    compat.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="1 only: one GPU a server")
    compat.add_argument("--trust-remote-code", action="store_true",
                        help="nothing to trust: pagedllm runs no code from model repositories")
    compat.add_argument("--disable-log-stats", action="store_true",
                        help="nothing to disable: pagedllm logs no periodic stats")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    from pagedllm.entrypoints.bench import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
