"""Host (Python) time per decode step, split by component, on a model too small for its forward to matter.

Runs LLMEngine on the CPU with random weights of a tiny shape, so what remains of a step is mostly the
engine's own bookkeeping: the part a GPU cannot hide. Reports ms per decode-only step for
scheduler.schedule, runner.prepare (the step's input arrays and their device tensors), the model forward,
logits, the sampler, the rest of runner.execute and the engine's post-processing (appending tokens, stop
checks, detokenizing, building outputs).

With --device cuda (and e.g. --model qwen3-0.6b) the same columns are host times of an asynchronous GPU
step: forward, logits and sampler are launch costs (a CUDA graph replay for decode steps), and
postprocess, which reads back the previous step's sampled ids, also waits there for the GPU.

On the CPU, decode steps run eagerly unless --cpu-decode-graphs installs stand-ins for the decode CUDA graphs
that skip the forward pass: decode steps then take the graph path's host code (inputs sent into the graphs'
buffers) and sample from zero hidden states.

    python benchmarks/host_overhead.py [--num-requests 256] [--sampling greedy|mixed] [--profile 30]
                                       [--model tiny|qwen3-0.6b|...] [--device cpu|cuda] [--cpu-decode-graphs]
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import pstats
import random
import time
import types

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.shapes import model_dir_for
from pagedllm.worker.cuda_graph import HEAD_MAX_BATCH, DecodeGraphs

COMPONENTS = ("schedule", "prepare", "forward", "logits", "sampler", "execute_other", "postprocess")


def sampling_params(kind: str, output_len: int, index: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Every sampler feature at once; half the requests seeded, so both noise paths run.
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.1,
                          frequency_penalty=0.1, presence_penalty=0.1, seed=index if index % 2 else None,
                          max_tokens=output_len, ignore_eos=True)


def install_cpu_decode_graphs(runner) -> None:
    """Stand-ins for the decode CUDA graphs on the CPU whose replays do nothing and leave zero hidden states (and,
    for the sizes whose graphs hold the LM head, zero logits and greedy ids), so a decode step times the graph
    path's host code alone: a GPU's replay costs the host little, while a CPU forward pass would also evict the
    host code's data from the caches."""
    cfg = runner.config
    graphs = DecodeGraphs(runner.model, runner.device, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size)
    for bs in graphs.sizes:
        for bound in graphs.bounds_of(bs):
            graphs.graphs[bs, bound, False] = types.SimpleNamespace(replay=lambda: None)
            graphs.outputs[bs, bound, False] = torch.zeros(bs, runner.hf_config.hidden_size, dtype=runner.dtype)
    head_rows = max((bs for bs in graphs.sizes if bs <= HEAD_MAX_BATCH), default=0)
    if head_rows:
        graphs.logits = torch.zeros(head_rows, runner.hf_config.vocab_size, dtype=runner.dtype)
        graphs.greedy = torch.zeros(head_rows, dtype=torch.int64)
    runner.decode_graphs = graphs


class StepTimer:
    """Wraps the engine's stages with timers; the stages run synchronously on the CPU."""

    def __init__(self, engine, profiler: cProfile.Profile | None) -> None:
        self.engine = engine
        self.profiler = profiler
        self.current: dict[str, float] = collections.defaultdict(float)
        self.steps: list[tuple[int, dict[str, float]]] = []
        runner, model = engine.runner, engine.runner.model
        self._last_batch = 0
        engine.scheduler.schedule = self._timed("schedule", self._watch_batch(engine.scheduler.schedule))
        # prepare: the step's host arrays; _metadata: their device tensors for an eager step.
        runner.prepare = self._timed("prepare", runner.prepare)
        runner._metadata = self._timed("prepare", runner._metadata)
        runner.execute = self._timed("execute", runner.execute)
        runner.sampler = self._timed("sampler", runner.sampler)
        # nn.Module.__call__ looks forward up on the instance, so this times the forward pass itself.
        model.forward = self._timed("forward", self._unprofiled(model.forward))
        for graphs in (runner.decode_graphs, runner.piecewise_graphs):
            if graphs is not None:
                graphs.run = self._timed("forward", self._unprofiled(graphs.run))
        model.compute_logits = self._timed("logits", model.compute_logits)
        engine.step = self._timed_step(engine.step)

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
        return wrapper

    def _unprofiled(self, fn):
        """The CPU forward pass (reference attention) would swamp the profile of the host code around it."""
        if self.profiler is None:
            return fn

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.profiler.disable()
            try:
                return fn(*args, **kwargs)
            finally:
                self.profiler.enable()
        return wrapper

    def _timed_step(self, step):
        @functools.wraps(step)
        def wrapper(*args, **kwargs):
            self.current.clear()
            t0 = time.perf_counter()
            outputs = step(*args, **kwargs)
            total = time.perf_counter() - t0
            c = self.current
            times = {
                "schedule": c["schedule"], "prepare": c["prepare"], "forward": c["forward"],
                "logits": c["logits"], "sampler": c["sampler"],
                "execute_other": c["execute"] - c["prepare"] - c["forward"] - c["logits"] - c["sampler"],
                "postprocess": total - c["schedule"] - c["execute"], "total": total,
            }
            self.steps.append((self._last_batch, times))
            return outputs
        return wrapper

    def _watch_batch(self, schedule):
        """Records each step's batch: a decode-only step is one where every scheduled request has 1 token."""
        @functools.wraps(schedule)
        def wrapper():
            sched = schedule()
            decode_only = all(it.num_new_tokens == 1 for it in sched.scheduled)
            self._last_batch = len(sched.scheduled) if decode_only else 0
            return sched
        return wrapper


def run(args) -> None:
    # The host path is single-threaded; on a shared machine, spinning OpenMP threads make timings erratic.
    torch.set_num_threads(args.threads)
    llm = LLM(model_dir_for(args.model), load_format="dummy", device=args.device,
              dtype="float32" if args.device == "cpu" else "auto", max_num_seqs=args.num_requests,
              max_model_len=4096)
    rng = random.Random(0)
    vocab = llm.engine.hf_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.input_len))]
               for _ in range(args.num_requests)]
    params = [sampling_params(args.sampling, rng.randint(*args.output_len), i) for i in range(len(prompts))]
    if args.cpu_decode_graphs:
        install_cpu_decode_graphs(llm.engine.runner)
    llm.generate([[1] * 8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up

    profiler = cProfile.Profile() if args.profile else None
    timer = StepTimer(llm.engine, profiler)
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - t0

    full = [t for batch, t in timer.steps if batch >= args.min_batch]
    print(f"{args.num_requests} requests, prompt {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, {args.sampling} sampling: {elapsed:.2f} s, "
          f"{len(timer.steps)} steps")
    if not full:
        print(f"no decode-only step had >= {args.min_batch} sequences")
    else:
        batches = [b for b, _ in timer.steps if b >= args.min_batch]
        print(f"mean over {len(full)} decode-only steps of >= {args.min_batch} sequences "
              f"(mean {sum(batches) / len(batches):.0f}), ms per step:")
        for name in (*COMPONENTS, "total"):
            print(f"  {name:14s} {1e3 * sum(t[name] for t in full) / len(full):8.3f}")
    if profiler:
        stats = pstats.Stats(profiler).strip_dirs()
        for key in ("tottime", "cumulative"):
            print(f"\ncProfile of the whole run, top {args.profile} by {key}:")
            stats.sort_stats(key).print_stats(args.profile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="a shape from pagedllm.bench.shapes, or a model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 160), metavar=("MIN", "MAX"))
    parser.add_argument("--min-batch", type=int, default=192,
                        help="only decode-only steps with at least this many sequences are averaged")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--sampling", choices=("greedy", "mixed"), default="greedy")
    parser.add_argument("--cpu-decode-graphs", action="store_true",
                        help="on the CPU, decode steps through stand-ins for the decode CUDA graphs")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also cProfile the run (all but the model forward) and print the top N functions")
    args = parser.parse_args()
    if args.cpu_decode_graphs and args.device != "cpu":
        parser.error("--cpu-decode-graphs is for --device cpu")
    run(args)


if __name__ == "__main__":
    main()
