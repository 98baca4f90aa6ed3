"""AsyncLLMEngine: drives an LLMEngine from asyncio for the server.

The engine is not thread-safe, so everything that touches it (adding, aborting, stepping, and the tokenizer)
runs on one dedicated worker thread, one call at a time. The event loop stays free to accept connections and
stream tokens while a step runs. A background task keeps stepping while any request is unfinished and sleeps
when there is none.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is at its limit; the client should retry later."""


class EngineDead(RuntimeError):
    """A step raised: the engine's state can no longer be trusted."""


class OutputStream:
    """Outputs of the engine requests behind one API call (one per prompt), in the order they were produced.

    Each item is one of the request's RequestOutputs (of its SamplingParams.output_kind); iteration ends once all
    its requests finished.
    """

    def __init__(self, engine: "AsyncLLMEngine") -> None:
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished: set[str] = set()

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Aborts whatever is still running (a no-op once all finished). Never awaits, so it is safe to call
        from a `finally` in a task that is being cancelled because its client went away."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None) -> None:
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = self.engine.hf_config.vocab_size
        self.max_waiting_requests = max_waiting_requests
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-engine")
        self._streams: dict[str, OutputStream] = {}
        self._pending_aborts: list[str] = []
        self._num_adding = 0
        self._stats = self.engine.stats()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.dead: BaseException | None = None

    # ---- lifecycle (call from the event loop that serves requests) ------------------------------------
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run_loop(), name="pagedllm-engine-loop")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._thread.shutdown(wait=True)

    # ---- requests -------------------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) on the engine thread, between steps: for anything that uses the engine or tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def open_stream(self) -> OutputStream:
        return OutputStream(self)

    async def add_request(self, stream: OutputStream, request_id: str, prompt: str | list[int],
                          params: SamplingParams, prompt_text: str | None = None) -> None:
        """Adds a request whose outputs go to stream. Raises ValueError for a bad prompt, EngineOverloaded when
        the waiting queue is full and EngineDead after a failed step."""
        if self.dead is not None:
            raise EngineDead(f"the engine stopped after an error: {self.dead!r}")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineOverloaded(f"{self.num_waiting} requests are waiting (limit {self.max_waiting_requests})")
        if request_id in self._streams:  # before the engine says so: the stream there is another request's
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        stream._unfinished.add(request_id)
        self._num_adding += 1
        try:
            await self.call(self.engine.add_request, request_id, prompt, params, prompt_text)
        except asyncio.CancelledError:
            # The add still runs on the engine thread; the abort queued now is applied right after it.
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)  # gone already if a step failed while the add was queued
            stream._unfinished.discard(request_id)
            raise
        finally:
            self._num_adding -= 1
        self._wake.set()

    def abort(self, request_ids: str | list[str]) -> None:
        """Queues aborts; the loop applies them before its next step, which frees their blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._streams.pop(rid, None)
        self._pending_aborts.extend(ids)
        self._wake.set()

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._stats["num_requests_waiting"] + self._num_adding

    def stats(self) -> dict[str, float]:
        """engine.stats() as of the end of the last step (reading it live would race the engine thread)."""
        return dict(self._stats)

    # ---- the loop -------------------------------------------------------------------------------------
    def _step(self, aborts: list[str]) -> tuple[list[RequestOutput], bool]:
        """On the engine thread: apply aborts, run one step if there is work, snapshot the stats."""
        if aborts:
            self.engine.abort_request(aborts)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        self._stats = self.engine.stats()
        return outputs, self.engine.has_unfinished_requests()

    async def _run_loop(self) -> None:
        busy = False
        while True:
            if not busy:
                await self._wake.wait()
            self._wake.clear()
            aborts, self._pending_aborts = self._pending_aborts, []
            try:
                outputs, busy = await self.call(self._step, aborts)
            except Exception as e:
                logger.exception("engine step failed; failing all requests")
                self._fail_all(e)
                return
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream._queue.put_nowait(out)
                    if out.finished:
                        del self._streams[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        self.dead = error
        for stream in self._streams.values():
            stream._queue.put_nowait(EngineDead(f"the engine stopped after an error: {error!r}"))
        self._streams.clear()
