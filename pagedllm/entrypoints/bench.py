"""`pagedllm bench throughput|latency`: end-to-end benchmarks on random-weight models of real shapes.

    pagedllm bench throughput [--model qwen3-0.6b] [--hf-baseline] [--output tp.json]
    pagedllm bench latency [--model qwen3-0.6b] [--context 1024] [--batch-sizes 1,2,...,256] [--output lat.json]

--model is a shape name (qwen3-0.6b, llama3-8b, tiny), a config.json, or a model directory; weights are random
(--load-format dummy) unless another load format is given. Engine options are the usual flags."""
from __future__ import annotations

import argparse
import json
import os

from pagedllm.bench.shapes import SHAPES
from pagedllm.entrypoints.cli import add_engine_args, engine_kwargs


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-0.6b",
                        help=f"a shape ({', '.join(SHAPES)}), a config.json, or a model directory")
    parser.add_argument("--output", help="write the results as JSON to this path")
    add_engine_args(parser)
    # A shape name has no weights: random ones, unless the user points at a checkpoint and says so.
    parser.set_defaults(load_format="dummy")


def _write_json(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")


def _throughput(args: argparse.Namespace) -> None:
    from pagedllm.bench.throughput import format_report, run_throughput

    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if not 1 <= getattr(args, lo) <= getattr(args, hi):
            raise ValueError(f"need 1 <= --{lo.replace('_', '-')} <= --{hi.replace('_', '-')}")
    if args.max_model_len is not None and args.max_input_len + args.max_output_len > args.max_model_len:
        raise ValueError(f"--max-input-len + --max-output-len ({args.max_input_len + args.max_output_len}) exceeds "
                         f"--max-model-len {args.max_model_len}: requests would be cut short")
    if args.num_requests < 1 or not 1 <= args.hf_num_requests <= args.num_requests:
        raise ValueError("need --num-requests >= 1 and 1 <= --hf-num-requests <= --num-requests")
    hf_subset = (args.hf_num_requests, args.hf_output_len, args.hf_batch_size) if args.hf_baseline else None
    result = run_throughput(args.model, engine_kwargs(args), args.num_requests,
                            (args.min_input_len, args.max_input_len), (args.min_output_len, args.max_output_len),
                            use_tqdm=not args.disable_tqdm, hf_subset=hf_subset)
    print(format_report(result))
    _write_json(result, args.output)


def _latency(args: argparse.Namespace) -> None:
    from pagedllm.bench.latency import format_report, plot, run_latency

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if min(batch_sizes) < 1 or args.context < 1 or args.num_steps < 1 or args.warmup_steps < 0:
        raise ValueError("need batch sizes >= 1, --context >= 1, --num-steps >= 1 and --warmup-steps >= 0")
    options = engine_kwargs(args)
    options["max_num_seqs"] = max(options["max_num_seqs"], max(batch_sizes))
    if options["max_model_len"] is None:
        # Room for the decode steps: the first sequences of a large batch decode while the last ones prefill.
        options["max_model_len"] = args.context + 2048
    result = run_latency(args.model, options, batch_sizes, args.context, args.num_steps,
                         args.warmup_steps)
    result["plot"] = None
    if args.output:
        png = os.path.splitext(args.output)[0] + ".png"
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        if plot(result, png):
            result["plot"] = png
            print(f"wrote {png}")
        else:
            print("matplotlib is not installed: no plot")
    print(format_report(result))
    _write_json(result, args.output)


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="end-to-end throughput and latency benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on random requests, with a roofline estimate")
    tp.add_argument("--num-requests", type=int, default=256)
    tp.add_argument("--min-input-len", type=int, default=100)
    tp.add_argument("--max-input-len", type=int, default=1024)
    tp.add_argument("--min-output-len", type=int, default=100)
    tp.add_argument("--max-output-len", type=int, default=1024)
    tp.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    tp.add_argument("--hf-baseline", action="store_true",
                    help="also run Hugging Face transformers (generate and continuous batching) on a subset")
    tp.add_argument("--hf-num-requests", type=int, default=64, help="baseline subset: the first N prompts")
    tp.add_argument("--hf-output-len", type=int, default=256, help="baseline subset: output tokens per request")
    tp.add_argument("--hf-batch-size", type=int, default=64, help="batch size of HF generate")
    _common_args(tp)
    tp.set_defaults(func=_throughput, max_model_len=4096)

    lat = kinds.add_parser("latency", help="decode step time per batch size at a fixed context length")
    lat.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    lat.add_argument("--context", type=int, default=1024, help="prompt tokens of every sequence")
    lat.add_argument("--num-steps", type=int, default=20, help="timed decode steps per batch size")
    lat.add_argument("--warmup-steps", type=int, default=3)
    _common_args(lat)
    lat.set_defaults(func=_latency)
