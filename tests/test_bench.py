"""`pagedllm bench`: the roofline arithmetic on hand-computed cases, and both benchmarks end to end through the
CLI on the tiny random-weight shape (CPU), HF baseline included."""
import importlib.util
import json
from datetime import datetime

import pytest
import torch
from transformers import AutoConfig

from pagedllm.bench.roofline import DeviceRates, ModelCost, estimate_throughput, simulate_decode
from pagedllm.bench.shapes import QWEN3_0_6B, model_dir_for
from pagedllm.bench.throughput import make_workload
from pagedllm.entrypoints.cli import main


def hf_config_of(shape: dict):
    cfg = {k: v for k, v in shape.items() if k not in ("architectures", "dtype")}
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def test_simulated_schedule_by_hand():
    # One slot: request 0 decodes twice (K/V of 3, then 4 tokens); request 1 gets its only token from prefill.
    assert simulate_decode([2, 3], [3, 1], max_num_seqs=1) == ([1, 1], [3, 4])
    # Two slots: step 1 reads 3 + 4 tokens, then request 1 is done; step 2 reads 4.
    assert simulate_decode([2, 3], [3, 2], max_num_seqs=2) == ([2, 1], [7, 4])
    # Three requests, two slots: request 2 joins when request 1 leaves.
    assert simulate_decode([2, 3, 5], [3, 2, 2], max_num_seqs=2) == ([2, 2], [7, 10])


def test_throughput_estimate_by_hand():
    cost = ModelCost(linear_params=10, lm_head_params=5, attn_width=2, weight_bytes=100, kv_bytes_per_token=10)
    # Steps (batch, K/V tokens) = (2, 7), (1, 4). Bytes: 100 + 70, 100 + 40. FLOPs: 2*15*batch + 4*2*kv = 116, 62.
    # Prefill of L tokens: 2*10*L + 2*2*L*(L+1) + 2*5 -> 74 + 118 FLOP.
    fast_matmul = estimate_throughput(cost, DeviceRates(1000.0, 2000.0, "x"), [2, 3], [3, 2], max_num_seqs=2)
    assert fast_matmul["decode_s"] == pytest.approx(0.17 + 0.14) and fast_matmul["compute_bound_steps"] == 0
    assert fast_matmul["prefill_flops"] == 192
    assert fast_matmul["time_s"] == pytest.approx(0.31 + 192 / 2000)
    assert fast_matmul["output_tok_s"] == pytest.approx(5 / fast_matmul["time_s"])
    slow_matmul = estimate_throughput(cost, DeviceRates(1000.0, 200.0, "x"), [2, 3], [3, 2], max_num_seqs=2)
    assert slow_matmul["decode_s"] == pytest.approx((116 + 62) / 200) and slow_matmul["compute_bound_steps"] == 2
    assert slow_matmul["time_s"] == pytest.approx((116 + 62 + 192) / 200)


def test_qwen3_cost_and_the_issues_h100_estimate():
    cost = ModelCost.from_hf_config(hf_config_of(QWEN3_0_6B), weight_elem_bytes=2, kv_elem_bytes=2)
    # 28 layers x (q,o 2*1024*2048 + k,v 2*1024*1024 + mlp 3*1024*3072) + lm_head 151936*1024, in bf16.
    assert cost.weight_bytes == 2 * (28 * (4194304 + 2097152 + 9437184) + 155582464)
    assert cost.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    prompts, outputs = make_workload(256, (100, 1024), (100, 1024), 151936, seed=0)
    h100 = DeviceRates(bandwidth=2.94e12, matmul_flops=755e12, matmul_dtype="bfloat16")
    est = estimate_throughput(cost, h100, [len(p) for p in prompts], outputs, max_num_seqs=256)
    assert 23000 < est["output_tok_s"] < 27000  # the issue's own estimate: ~25K, nearly all of it K/V reads
    assert est["decode_kv_bytes"] > 10 * est["decode_weight_bytes"] and est["compute_bound_steps"] == 0


def test_cost_counts_every_matrix_of_the_model():
    from pagedllm.models.loader import load_model
    model, hf_config, _ = load_model(model_dir_for("tiny"), torch.float32, "cpu", "dummy", 0)
    cost = ModelCost.from_hf_config(hf_config, 4, 4)
    # The tiny shape ties embeddings, so the one vocab matrix is the LM head; 1-D weights are norms.
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert cost.linear_params + cost.lm_head_params == matrices


TINY_RUN = ["--model", "tiny", "--num-kv-blocks", "256", "--seed", "3"]


def test_throughput_cli_end_to_end_with_hf_baseline(tmp_path, capsys):
    out = tmp_path / "tp.json"
    main(["bench", "throughput", *TINY_RUN, "--num-requests", "6", "--min-input-len", "5", "--max-input-len",
          "40", "--min-output-len", "2", "--max-output-len", "12", "--max-num-seqs", "4", "--hf-baseline",
          "--hf-num-requests", "3", "--hf-output-len", "5", "--hf-batch-size", "2", "--disable-tqdm",
          "--output", str(out)])
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and datetime.fromisoformat(r["date"]).tzinfo is not None
    prompts, outputs = make_workload(6, (5, 40), (2, 12), 512, seed=3)
    ours = r["ours"]
    assert ours["output_tokens"] == sum(outputs) and ours["input_tokens"] == sum(map(len, prompts))
    assert ours["output_tok_s"] > 0 and ours["total_tok_s"] > ours["output_tok_s"] and ours["requests_per_s"] > 0
    est = r["roofline"]
    assert est["max_num_seqs"] == 4 and est["bandwidth"] > 0 and est["matmul_flops"] > 0
    sched = simulate_decode(list(map(len, prompts)), outputs, 4)
    assert est["num_steps"] == len(sched.batch_sizes) and est["kv_token_reads"] == sum(sched.kv_tokens)
    assert 0 < r["fraction_of_roofline"] <= 1.5
    # The breakdown accounts for the whole run: every step, prefill first, then decode-only by batch size.
    steps = ours["steps"]
    assert steps[0]["kind"] == "with prefill" and all(row["kind"].startswith("decode <=") for row in steps[1:])
    assert sum(row["wall_s"] for row in steps) == pytest.approx(ours["elapsed_s"], rel=0.05)
    assert sum(row["steps"] for row in steps) >= max(outputs)
    assert sum(row["roofline_s"] for row in steps) == pytest.approx(est["time_s"], rel=0.5)
    b = r["baseline"]
    assert b["subset"] == {"num_requests": 3, "input_tokens": sum(map(len, prompts[:3])), "output_len": 5}
    assert max(map(len, prompts[:3])) > 16  # a full block: the subset would hit the prefix cache unless reset
    assert ours["cached_prompt_tokens"] == 0 and b["ours"]["cached_prompt_tokens"] == 0
    for run in ("ours", "hf_generate", "hf_continuous_batching"):
        assert b[run]["output_tokens"] == 15 and b[run]["output_tok_s"] > 0
    assert b["speedup_vs_hf_generate"] > 0 and b["speedup_vs_hf_continuous_batching"] > 0
    printed = capsys.readouterr().out
    assert "of the roofline" in printed and "HF continuous batching" in printed and "where the time went" in printed


def test_latency_cli_end_to_end(tmp_path):
    out = tmp_path / "lat.json"
    # A budget of 32 tokens a step chunks the batch of 3's prefill, so its first sequences decode meanwhile.
    main(["bench", "latency", *TINY_RUN, "--batch-sizes", "1,3", "--context", "20", "--num-steps", "3",
          "--warmup-steps", "1", "--max-num-batched-tokens", "32", "--output", str(out)])
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and datetime.fromisoformat(r["date"]).tzinfo is not None
    assert [row["batch_size"] for row in r["results"]] == [1, 3]
    # One sequence prefills in one step; after 1 warm-up step the timed steps read 22, 23, 24 tokens.
    assert r["results"][0]["mean_kv_len"] == 23
    assert r["results"][1]["mean_kv_len"] > 23
    for row in r["results"]:

        assert row["min_ms"] <= row["median_ms"] <= row["max_ms"] and row["output_tok_s"] > 0
        assert row["min_ms"] <= row["mean_ms"] <= row["max_ms"]
        kv_ms = 1e3 * row["batch_size"] * row["mean_kv_len"] * r["kv_bytes_per_token"] / r["bandwidth"]
        assert row["roofline_ms"] >= (r["weight_read_ms"] + kv_ms) * (1 - 1e-9)  # or the FLOPs', if longer
        assert r["weight_read_ms"] == pytest.approx(1e3 * r["weight_bytes"] / r["bandwidth"])
        assert 0 < row["fraction_of_roofline"] <= 1.5
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (r["plot"] is not None) == has_matplotlib
    assert (tmp_path / "lat.png").exists() == has_matplotlib


def test_throughput_rejects_a_workload_longer_than_max_model_len(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", *TINY_RUN, "--max-model-len", "64", "--min-input-len", "10",
              "--max-input-len", "40", "--min-output-len", "10", "--max-output-len", "30"])
    assert e.value.code == 2 and "exceeds --max-model-len 64" in capsys.readouterr().err


def _benchmark(name: str):
    """A script of benchmarks/ as a module (they import each other by plain name)."""
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_triton_spills_specs_match_the_kernels():
    """benchmarks/triton_spills.py compiles each kernel from a hand-written signature: every typed or constant
    argument it names must be a parameter, and every constexpr parameter must get a value, or the report would
    fail (or silently type a renamed pointer as an int)."""
    import inspect
    triton_spills = _benchmark("triton_spills")
    for name, spec in triton_spills.KERNELS.items():
        fn, types, consts, options = spec()
        params = inspect.signature(fn.fn).parameters
        assert set(types) <= set(params) and set(consts) <= set(params), name
        constexprs = {p for p, v in params.items() if "constexpr" in str(v.annotation)}
        assert constexprs == set(consts), name
        assert options["num_warps"] in (1, 2, 4, 8, 16) and options["num_stages"] >= 1


def test_decoder_layer_phases_load_nothing_behind_a_barrier():
    """The decoder-layer kernel's projection phases request everything their chain reads before its first CTA
    barrier (benchmarks/triton_spills.py --chain: this machine's Triton, sm_90a SASS). A load behind a reduction's
    barrier is one more memory round trip a layer: the norms' weights were, until the thirty-second session."""
    import os
    import subprocess
    import sys
    phases = [f"decoder_layer_{p}" for p in ("norm_qkv", "o_proj", "norm_gate_up", "down")]
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "triton_spills.py")
    # compiled, not interpreted: the test session's Triton runs kernels under the interpreter
    out = subprocess.run([sys.executable, script, "--chain", "--only", *phases], capture_output=True, text=True,
                         check=True, env={**os.environ, "TRITON_INTERPRET": "0"}).stdout
    rows = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.splitlines()[2:]}
    assert list(rows) == phases
    for phase, (_, _, loads, behind) in rows.items():
        assert loads >= 1 and behind == 0, phase


def test_decode_layer_sweep_variants():
    """benchmarks/decode_layer.py --sweep: a variant changes only the phases and launch kinds it names, over the
    kernel's own choice, and a malformed one is refused."""
    from pagedllm.ops.triton.decode_layer import DecoderLayerKernel
    bench = _benchmark("decode_layer")
    assert bench.parse_variant("base=") == ("base", [])
    name, changes = bench.parse_variant("x=D@many:16,C:8:56")
    assert name == "x" and changes == [(3, "many", 16, None), (2, None, 8, 56)]
    for bad in ("x=F:16", "x=D@most:16", "x=D", "x=D:16:64:1"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)
    kernel = DecoderLayerKernel(1024, 3072, 16, 8, 128, torch.bfloat16, torch.device("cpu"), num_programs=128)
    own = DecoderLayerKernel._launch_configs
    configs = bench.variant_configs(own, changes)
    for long, many in ((False, False), (True, False), (True, True)):
        expected = own(kernel, long, many, True)
        expected[2] = (8, dict(maxnreg=56))
        if many:
            expected[3] = (16, {})
        assert configs(kernel, long, many, True) == expected
    assert configs(kernel, True, True, False)[2] == (8, {})  # no register caps where the backend takes none


def _trees(tmp_path, values: dict[str, str]):
    """A tree a variant, each with its own marker module: what the timed command reports is the tree's value."""
    trees = []
    for name, value in values.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "marker.py").write_text(f"VALUE = {value!r}\n")
        trees.append(str(tmp_path / name))
    return trees


def test_alternate_takes_turns_and_tables_each_trees_values(tmp_path):
    """Every tree's command runs in that tree, with its own code; the rounds alternate the order, each run's value
    is the last matching line's, and the table sets each median against the first tree's."""
    import sys
    alternate = _benchmark("alternate")
    trees = _trees(tmp_path, {"base": "2.0", "new": "1.5"})
    beside = tmp_path / "beside.txt"
    cmd = [sys.executable, "-c", "import marker, os; print('period 9 ms'); print(f'period {marker.VALUE} ms'); "
           "open(os.path.join(os.environ['PYTHONPATH'], 'runs'), 'a').write('x')"]
    lines = []
    values = alternate.alternate(trees, cmd, r"period ([0-9.]+) ms", rounds=3, timeout=30, warmup_timeout=30,
                                 deadline=300, log_dir=str(tmp_path / "logs"), warmup_with=f"echo ready > {beside}",
                                 say=lines.append)
    assert values == {trees[0]: [2.0] * 3, trees[1]: [1.5] * 3}
    assert beside.read_text() == "ready\n"
    assert [line.split(":")[0] for line in lines if line.startswith("round")] == [
        f"round 1 {trees[0]}", f"round 1 {trees[1]}", f"round 2 {trees[1]}", f"round 2 {trees[0]}",
        f"round 3 {trees[0]}", f"round 3 {trees[1]}"]
    for tree in trees:  # the warm-up and three rounds, in each tree's own folder
        assert (tmp_path / tree / "runs").read_text() == "x" * 4
    rows = alternate.table(values).splitlines()[1:]
    assert rows[0].split()[1:3] == ["2.0000", "+0.00%"] and rows[1].split()[1:3] == ["1.5000", "-25.00%"]


def test_alternate_kills_a_run_at_its_timeout_and_keeps_to_the_deadline(tmp_path, capsys):
    """A run past --timeout is killed and gives no value (the command exits 1: a tree without values); no round
    starts that could end after --deadline."""
    import sys
    import time
    alternate = _benchmark("alternate")
    trees = _trees(tmp_path, {"base": "1.0", "hang": "0"})
    cmd = [sys.executable, "-c", "import marker, time; time.sleep(60) if marker.VALUE == '0' else None; "
           "print(f'period {marker.VALUE} ms')"]
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        alternate.main(["--trees", *trees, "--pattern", r"period ([0-9.]+) ms", "--rounds", "5", "--timeout", "4",
                        "--warmup-timeout", "4", "--deadline", "10", "--log", str(tmp_path / "logs"), "--", *cmd])
    out = capsys.readouterr().out
    assert e.value.code == 1 and time.monotonic() - t0 < 30
    assert f"warm-up {trees[1]}: killed at the warm-up limit" in out
    assert f"round 1 {trees[1]}: no value (killed)" in out and "round 2 not started" in out
    assert out.count(f"round 1 {trees[0]}: 1.0") == 1 and "round 2 " + trees[0] not in out


def test_alternate_names_what_is_missing(tmp_path, capsys):
    alternate = _benchmark("alternate")
    with pytest.raises(SystemExit) as e:
        alternate.main(["--trees", str(tmp_path / "nowhere"), "--pattern", "(1)", "--", "true"])
    assert e.value.code == 2 and "not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        alternate.main(["--trees", str(tmp_path), "--pattern", "(1)"])
    assert e.value.code == 2 and "no command to time" in capsys.readouterr().err
