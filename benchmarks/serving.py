"""Serving benchmark: a request-rate sweep against a running OpenAI-compatible server.

For each rate, --num-prompts streaming /v1/completions requests arrive as a Poisson process ("inf" sends them
all at once) with random token-id prompts, so any model works, random weights (--load-format dummy) included.
ignore_eos makes every request produce exactly --output-len tokens. Reports time to first token and
inter-token latency (p50/p99) and throughput; prints a table and writes JSON.

    pagedllm serve MODEL --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --request-rates 1,4,16,inf
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from openai import AsyncOpenAI


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(client: AsyncOpenAI, model: str, prompt: list[int], output_len: int) -> RequestResult:
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            # The server sends one chunk per step that produced a token.
            if last is None:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
        result.latency = time.perf_counter() - start
        result.ok = last is not None
    except Exception as e:  # a failed request is counted, not fatal to the sweep
        result.error = f"{type(e).__name__}: {e}"
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


async def run_rate(client: AsyncOpenAI, model: str, prompts: list[list[int]], rate: float, output_len: int,
                   max_concurrency: int | None, seed: int) -> dict:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(prompt: list[int]) -> RequestResult:
        if limit is None:
            return await one_request(client, model, prompt, output_len)
        async with limit:
            return await one_request(client, model, prompt, output_len)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start

    done = [r for r in results if r.ok]
    ttfts = [r.ttft for r in done]
    itls = [x for r in done for x in r.itls]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(len(p) for p, r in zip(prompts, results) if r.ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "request_rate": str(rate), "completed": len(done), "failed": len(results) - len(done),
        "errors": errors[:5], "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_mean_ms": ms(statistics.fmean(ttfts) if ttfts else None),
        "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "itl_mean_ms": ms(statistics.fmean(itls) if itls else None),
        "itl_p50_ms": ms(percentile(itls, 50)), "itl_p99_ms": ms(percentile(itls, 99)),
        "e2e_p50_ms": ms(percentile([r.latency for r in done], 50)),
    }


# (result key, column title, width, number format)
COLUMNS = [("request_rate", "rate/s", 7, ""), ("completed", "done", 5, "d"), ("failed", "fail", 5, "d"),
           ("request_throughput", "req/s", 7, ".2f"), ("output_throughput", "out tok/s", 10, ".1f"),
           ("ttft_p50_ms", "TTFT p50", 9, ".1f"), ("ttft_p99_ms", "TTFT p99", 9, ".1f"),
           ("itl_p50_ms", "ITL p50", 8, ".1f"), ("itl_p99_ms", "ITL p99", 8, ".1f")]


def format_table(rows: list[dict]) -> str:
    header = " ".join(f"{title:>{width}}" for _, title, width, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(" ".join(f"{'-' if row[key] is None else format(row[key], spec):>{width}}"
                              for key, _, width, spec in COLUMNS))
    return "\n".join(lines) + "\n(latencies in ms)"


async def main_async(args: argparse.Namespace) -> dict:
    client = AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                         max_retries=0, timeout=args.timeout)
    model = args.model or (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    rows = []
    for i, rate in enumerate(args.request_rates):
        prompts = [[rng.randrange(*args.token_id_range) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]
        rows.append(await run_rate(client, model, prompts, rate, args.output_len, args.max_concurrency,
                                   args.seed + i))
    await client.close()
    return {"model": model, "base_url": args.base_url, "config": {k: v for k, v in vars(args).items()
                                                                   if k != "api_key"}, "results": rows}


def parse_rates(text: str) -> list[float]:
    return [float(r) for r in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rates", type=parse_rates, default=parse_rates("1,4,16,inf"),
                   help="comma-separated requests per second; inf sends all at once")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--token-id-range", type=int, nargs=2, default=[1000, 30000],
                   help="prompt token ids are drawn from [LOW, HIGH) (must lie within the vocabulary)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="serving_results.json", help="where to write the JSON results")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    report = asyncio.run(main_async(args))
    print(f"model {report['model']} at {args.base_url}: {args.num_prompts} requests per rate, "
          f"{args.input_len} tokens in, {args.output_len} out")
    print(format_table(report["results"]))
    for row in report["results"]:
        for error in row["errors"]:
            print(f"rate {row['request_rate']}: {error}")
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
