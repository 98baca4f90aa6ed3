"""The screened greedy LM head (pagedllm.ops.triton.greedy_head) against head_linear + argmax on the GPU: the
time of each in a CUDA graph (triton.testing.do_bench_cudagraph), the screen kernel alone and its read rate, the
head tiles the pick kernel recomputed, and whether the tokens agree, for Qwen3-0.6B's and Llama 3 8B's heads
(random weights as load_format="dummy" draws them, N(0, 0.02), bf16) for one row: random inputs, and the final
hidden states of a random-weight Qwen3-0.6B decoding greedily.
--configs sweeps the screen's rows and warps a program and the pick's tiles a program and weight tiles in flight
(ROWSxWARPSxTILESxSTAGES for both heads, as greedy_head.HEAD_CONFIGS holds them; the default is each head's own).

    python benchmarks/greedy_head.py [--heads qwen3-0.6b llama3-8b llama3.2-1b llama3.2-3b]
        [--configs 8x2x4x4 16x4x1x8 ...] [--trials 20] [--engine-steps 50]
"""
import argparse

import torch
from triton.testing import do_bench_cudagraph

from pagedllm.ops.triton import fused, greedy_head

# (vocab, K); the Llama 3.2 heads (K = 2048, 3072) are swept with --heads
HEADS = {"qwen3-0.6b": (151936, 1024), "llama3-8b": (128256, 4096), "llama3.2-1b": (128256, 2048),
         "llama3.2-3b": (128256, 3072)}
DEFAULT = greedy_head.HEAD_CONFIGS


def _config(config=None):
    """Sets the kernels' launch config: greedy_head's own (None), or ROWSxWARPSxTILESxSTAGES for every K."""
    greedy_head.HEAD_CONFIGS = DEFAULT if config is None else ((0, *map(int, config.split("x"))),)


def _passed_tiles(screen, x):
    """Head tiles (64 rows) holding a row that passes the screen."""
    hi, t = screen.bounds(x)
    return int((hi >= greedy_head.threshold(t, x.dtype)).view(-1, greedy_head.HEAD_TILE).any(dim=1).sum())


def _engine_hidden_states(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head weight and the final hidden states [steps, hidden] a random-weight Qwen3-0.6B (load_format="dummy")
    feeds its LM head while decoding greedily after a 1024-token prompt, as engine_probe.py batch1 runs."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.shapes import model_dir_for
    llm = LLM(model_dir_for("qwen3-0.6b"), load_format="dummy", dtype="bfloat16", max_model_len=2048,
              enforce_eager=True)
    model, captured = llm.engine.runner.model, []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden, out=None: captured.append(hidden.clone()) or compute_logits(hidden, out)
    prompt = torch.randint(0, 151936, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    return model.head_weight(), torch.cat(captured)


def _tokens(weight: torch.Tensor, screen, xs: torch.Tensor) -> str:
    """Whether the screened tokens of rows xs equal head_linear + argmax's, and the head tiles recomputed."""
    agree, tiles = 0, []
    for x in xs.split(1):
        agree += torch.equal(screen.greedy(x), fused.argmax(fused.head_linear(x, weight)))
        tiles.append(_passed_tiles(screen, x))
    return (f"tokens agree {agree}/{len(tiles)}; head tiles recomputed: mean {sum(tiles) / len(tiles):.1f}, max "
            f"{max(tiles)} of {weight.shape[0] // 64}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", nargs="+", choices=sorted(HEADS), default=["qwen3-0.6b", "llama3-8b"])
    ap.add_argument("--configs", nargs="*", default=[None])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--engine-steps", type=int, default=50, help="also the hidden states of this many decode steps")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    for name in args.heads:
        vocab, hidden = HEADS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        weight = (0.02 * torch.randn(vocab, hidden, generator=gen, device="cuda")).to(torch.bfloat16)
        screen = greedy_head.ScreenedHead(weight)
        screen_bytes = vocab * hidden + 12 * vocab  # codes, scale, bounds
        xs = torch.randn(args.trials, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        x = xs[-1:]
        full = do_bench_cudagraph(lambda: fused.argmax(fused.head_linear(x, weight))) * 1e3
        print(f"{name}: head_linear + argmax {full:.1f} us ({vocab * hidden * 2 / full / 1e6:.2f} TB/s); random "
              f"inputs: {_tokens(weight, screen, xs)}", flush=True)
        for config in args.configs:
            _config(config)
            both = do_bench_cudagraph(lambda: screen.greedy(x)) * 1e3
            alone = do_bench_cudagraph(lambda: screen._screen(x)) * 1e3
            screen.top.fill_(float("-inf"))  # which the screen alone leaves raised
            print(f"  {config or 'default'}: greedy {both:.1f} us ({full / both:.2f}x), screen alone {alone:.1f} us "
                  f"({screen_bytes / alone / 1e6:.2f} TB/s)", flush=True)
        _config()
    if args.engine_steps:
        weight, xs = _engine_hidden_states(args.engine_steps)
        screen = greedy_head.ScreenedHead(weight)
        x = xs[-1:]
        full = do_bench_cudagraph(lambda: fused.argmax(fused.head_linear(x, weight))) * 1e3
        both = do_bench_cudagraph(lambda: screen.greedy(x)) * 1e3
        print(f"qwen3-0.6b, the engine's hidden states: {_tokens(weight, screen, xs)}; the last one: head_linear + "
              f"argmax {full:.1f} us, greedy {both:.1f} us", flush=True)

if __name__ == "__main__":
    main()
