"""Variants of the code timed against each other on one machine: each variant is a tree (a checkout, or an archive
of one) and one command, a benchmark that prints a number, runs in each, a process each, the trees taking turns.

Separate processes of one benchmark on one H100 varied by up to 25% at batch 1 (results/README.md, fourteenth
session), more than most changes gain, so a change is measured only against its base, alternating, on one warm
machine. First every tree runs the command at once, beside --warmup-with (the GPU tests, say): that fills the
compile caches, and its times are not kept. Then --rounds rounds run each tree in turn, the order reversed every
other round, each run under --timeout. A run's value is the first group of --pattern in the last line of its output
that matches. A round that would end after --deadline seconds is not started, so that the table, each tree's values
with their median against the first tree's, is printed inside a device call's limit. Every run's output goes to
--log. The command runs in each tree with that tree on PYTHONPATH, so its relative paths are the tree's (name the
program on PATH, or by an absolute path).

    python benchmarks/alternate.py --trees adhoc/base adhoc/new --pattern 'GPU period ([0-9.]+) ms' \\
        --warmup-with 'cd adhoc/new && PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_greedy_head_gpu.py' \\
        -- python benchmarks/engine_probe.py batch1 --max-num-seqs 2
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time


def _start(cmd, cwd: str, log) -> subprocess.Popen:
    """cmd in cwd, its package the tree's own (PYTHONPATH), in a session of its own so that a timeout kills its
    children too."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(cwd), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, shell=isinstance(cmd, str))


def _finish(proc: subprocess.Popen, deadline: float) -> int | None:
    """proc's exit status, or None once it is killed at the monotonic deadline."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
        proc.wait()
        return None


def value_of(output: str, pattern: str) -> float | None:
    """The first group of pattern in the last line of output it matches, as a number."""
    for line in reversed(output.splitlines()):
        if m := re.search(pattern, line):
            return float(m.group(1))
    return None


def run_once(cmd: list[str], tree: str, timeout: float, log_path: str) -> tuple[str, int | None]:
    """cmd's output in tree and its exit status (None: killed after timeout seconds)."""
    with open(log_path, "w+") as log:
        status = _finish(_start(cmd, tree, log), time.monotonic() + timeout)
        log.seek(0)
        return log.read(), status


def alternate(trees: list[str], cmd: list[str], pattern: str, rounds: int, timeout: float, warmup_timeout: float,
              deadline: float, log_dir: str, warmup_with: str | None = None, say=print) -> dict[str, list[float]]:
    """Each tree's values, in the order they ran; say() gets a line a run as it ends."""
    start = time.monotonic()
    os.makedirs(log_dir, exist_ok=True)
    runs = [(tree, cmd, tree, os.path.join(log_dir, f"warmup_{i}_{os.path.basename(tree)}.log"))
            for i, tree in enumerate(trees)]
    if warmup_with:
        runs.append(("beside", warmup_with, ".", os.path.join(log_dir, "warmup_beside.log")))
    logs = [open(path, "w") for *_, path in runs]
    procs = [_start(what, cwd, log) for (_, what, cwd, _), log in zip(runs, logs)]
    for (name, *_, path), proc, log in zip(runs, procs, logs):
        status = _finish(proc, start + warmup_timeout)
        log.close()
        say(f"warm-up {name}: {'killed at the warm-up limit' if status is None else f'exit {status}'}")
    if warmup_with:
        with open(runs[-1][-1]) as f:
            say("warm-up beside, its last lines:\n  " + "\n  ".join(f.read().splitlines()[-5:]))
    values = {tree: [] for tree in trees}
    slowest = 0.0
    for r in range(rounds):
        if time.monotonic() - start + slowest * len(trees) > deadline:
            say(f"round {r + 1} not started: it could end after the {deadline:.0f} s deadline")
            break
        for tree in trees if r % 2 == 0 else trees[::-1]:
            t0 = time.monotonic()
            output, status = run_once(cmd, tree, timeout, os.path.join(log_dir, f"round{r + 1}_{len(values[tree])}_"
                                                                                 f"{os.path.basename(tree)}.log"))
            slowest = max(slowest, time.monotonic() - t0)
            v = value_of(output, pattern)
            if v is not None:
                values[tree].append(v)
            say(f"round {r + 1} {tree}: {v if v is not None else 'no value'}"
                f"{'' if status == 0 else ' (killed)' if status is None else f' (exit {status})'}")
    return values


def table(values: dict[str, list[float]]) -> str:
    """Each tree's values, median and median against the first tree's."""
    base = statistics.median(next(iter(values.values())) or [float("nan")])
    lines = [f"{'tree':30s} {'median':>9s} {'vs first':>9s}  values"]
    for tree, vs in values.items():
        med = statistics.median(vs) if vs else float("nan")
        lines.append(f"{tree:30s} {med:9.4f} {med / base - 1:+9.2%}  {' '.join(f'{v:g}' for v in vs)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", required=True, help="the variants' trees; the first is the base")
    parser.add_argument("--pattern", required=True, help="a regular expression whose first group is the value")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60, help="seconds a timed run")
    parser.add_argument("--warmup-timeout", type=float, default=300, help="seconds for the warm-up")
    parser.add_argument("--deadline", type=float, default=540, help="seconds from the start that no round may pass")
    parser.add_argument("--warmup-with", help="a shell command run beside the warm-up, from here")
    parser.add_argument("--log", default=os.path.join(os.environ.get("OUT", "."), "alternate"),
                        help="the folder for every run's output (default $OUT/alternate)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, run in each tree")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command to time: give it after --")
    missing = [t for t in args.trees if not os.path.isdir(t)]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    values = alternate(args.trees, cmd, args.pattern, args.rounds, args.timeout, args.warmup_timeout, args.deadline,
                       args.log, args.warmup_with, say=lambda line: print(line, flush=True))
    print(table(values), flush=True)
    sys.exit(0 if all(values.values()) else 1)


if __name__ == "__main__":
    main()
