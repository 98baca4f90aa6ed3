"""Registers and spills of our main Triton kernels compiled for the H100 (sm_90a), on a machine without a GPU.

Each kernel is compiled at the launch config its op uses on the GPU (`triton.compile` with an explicit
target), and the PTX goes through `ptxas -v` (the one in Triton's wheel that reads the PTX version it
emits). Spill stores/loads are local-memory traffic, usually inside the hot loop: at 255 registers a kernel
that spills runs far below its tile's speed (the XAttention sparse kernel ran at ~60% of its later speed
until a query tile held in ~50 registers moved to shared memory; benchmarks/results/README.md). The
register allocation is this machine's Triton's; the GPU machine's Triton may differ, so a clean report here
is a hint to check on the device, not a guarantee. --chain reports instead, from the SASS (cuobjdump), the loads
each kernel issues after its griddepcontrol.wait and how many of them come only after a CTA barrier (chain()).

    python benchmarks/triton_spills.py [--only NAME ...] [--chain]
"""
import argparse
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedllm.ops.triton import decode, decode_layer, fused, greedy_head, linear, prefill
from pagedllm.ops.xattention import estimate, sparse_attention

TARGET = GPUTarget("cuda", 90, 32)
HEAD = 128  # the Qwen3 / Llama head every config below was tuned for


def _desc(*block, elem="bf16"):
    return f"tensordesc<{elem}[{', '.join(map(str, block))}]>"


def _sparse():
    cfg = sparse_attention.GPU_CONFIG
    kv = _desc(1, 1, cfg["block_n"], HEAD)
    types = dict(Q=_desc(1, 1, cfg["block_m"], HEAD), O="*bf16", K=kv, V=kv, KV_IDX="*i32", KV_CNT="*i32",
                 qk_scale="fp32")
    consts = dict(BLOCK_SIZE=128, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HEAD=HEAD, HEAD_PAD=HEAD,
                  CAUSAL=True, DOT_PREC="tf32")
    return sparse_attention._sparse_attn_kernel, types, consts, dict(num_warps=cfg["num_warps"],
                                                                      num_stages=cfg["num_stages"])


def _estimate(stride, fp8=False):
    cfg = estimate.GPU_CONFIG
    block_k, elem = (2 * cfg["block_k"], "fp8e4nv") if fp8 else (cfg["block_k"], "bf16")
    types = dict(q_desc=_desc(1, 1, cfg["block_m"], block_k, elem=elem),
                 k_desc=_desc(1, 1, cfg["block_n"], block_k, elem=elem), Q_SCALE="*fp32", K_SCALE="*fp32",
                 PART="*fp32", TMAX="*fp32", OUT="*fp32", scale="fp32")
    consts = dict(STRIDE=stride, RBS=128 // stride, HEAD=HEAD, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                  BLOCK_K=block_k, CAUSAL=True, DOT_PREC="tf32", FP8=fp8)
    return estimate._estimate_kernel, types, consts, dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


class _CudaQuery:  # what the ops' config functions read of the query
    is_cuda = True

    @staticmethod
    def element_size():
        return 2


def _prefill(max_seq_len):
    block_m, block_n, warps, stages = prefill._config(_CudaQuery, HEAD, 2, 16, max_seq_len)
    types = dict(out="*bf16", query="*bf16", k_cache="*bf16", v_cache="*bf16", block_tables="*i32",
                 seq_lens="*i32", query_start_loc="*i32", alibi_slopes="*fp32", k_scale="fp32", v_scale="fp32",
                 scale="fp32")
    consts = dict(GROUP=2, TOKENS=block_m // 2, BLOCK_M=block_m, HEAD_SIZE=HEAD, HEAD_PAD=HEAD, BLOCK_SIZE=16,
                  BLOCK_N=block_n, X=8, LAYOUT=1, FP8=0, SCALE_PTR=False, ALIBI=False, DOT_PREC="tf32")
    return prefill._prefill_kernel, types, consts, dict(num_warps=warps, num_stages=stages)


def _decode(split):
    block_n, warps, stages = decode._config(_CudaQuery, HEAD, 16)
    types = dict(out="*bf16", part_max="*fp32", part_sum="*fp32", part_out="*bf16", query="*bf16",
                 k_cache="*bf16", v_cache="*bf16", block_tables="*i32", seq_lens="*i32",
                 alibi_slopes="*fp32", k_scale="fp32", v_scale="fp32", scale="fp32")
    consts = dict(GROUP=2, GROUP_PAD=16, HEAD_SIZE=HEAD, HEAD_PAD=HEAD, BLOCK_SIZE=16, BLOCK_N=block_n, X=8,
                  LAYOUT=1, FP8=0, SCALE_PTR=False, ALIBI=False, SPARSE=False, SPLIT=split, DOT_PREC="tf32", PDL=True)
    return decode._decode_kernel, types, consts, dict(num_warps=warps, num_stages=stages)


def _split_k(rows, gated):
    """The residual projections' GEMM at Qwen3-0.6B's down_proj (1024 x 3072), its config for `rows` rows."""
    bm, bn, bk, _, stages, warps = linear._config(rows, 1024, 3072)
    types = dict(x="*bf16", w_desc=_desc(bn, bk), partials="*fp32")
    consts = dict(BM=bm, BN=bn, BK=bk, STAGES=stages, GATED=gated, PDL=True)
    return linear._split_k_kernel, types, consts, dict(num_warps=warps, num_stages=3)  # 3: the launch default


def _decoder_layer(phase=-1, long=True, many_keys=False, rows=1):
    """The batch-1 decoder-layer kernel at Qwen3-0.6B's shape on 128 programs: with its barriers (phase -1), or one
    phase's launch with the warps and register cap the engine gives it in launches of that kind."""
    types = {p: "*bf16" for p in ("x_in", "residual", "res_mid", "qkv", "act", "w_ln", "w_qkv",
                                  "b_qkv", "q_norm_w", "k_norm_w", "w_o", "w_post", "w_gate_up", "w_down",
                                  "k_cache", "v_cache")}
    types.update({p: "*fp32" for p in ("x_out", "attn_max", "attn_sum", "attn_acc", "attn_new",
                                       "cos_sin_cache")})
    types.update(o_sum="*i64", x_ids="*i64", barrier="*i32", trace="*i64", positions="*i64", slot_mapping="*i64",
                 seq_lens="*i32", block_table="*i32", eps="fp32", qk_eps="fp32", scale="fp32")
    kernel = decode_layer.DecoderLayerKernel(1024, 3072, 16, 8, HEAD, torch.bfloat16, torch.device("cpu"),
                                             num_programs=128)
    names = [f"{p}_{c}" for p in "AOUE" for c in ("RPP", "STEPS", "RPP2")]
    consts = dict(ROWS=rows, D=1024, D_PAD=1024, INTER=3072, INTER_PAD=4096, HEADS=16, KV_HEADS=8,
                  HEAD_SIZE=HEAD, GROUP_PAD=16, GROUP_P2=2, NP=16, NP_PAD=16, OPP=16, O_GROUPS=kernel.o_groups,
                  **dict(zip(names, kernel.plans)),
                  BLOCK_SIZE=16, BLOCK_N=decode_layer.BLOCK_N, X=1, LAYOUT=1, QK_NORM=True, QKV_BIAS=False,
                  NPROG=128, PHASE=phase, DOT_PREC="tf32", PDL=phase >= 0, TRACE=False,
                  **dict(zip(("U_OUTER", "U_PACKED"), decode_layer.gate_up_tile(long, many_keys, torch.bfloat16))),
                  FIRST=False, EMBED=False,
                  NEWEST_APART=phase == 1 and not many_keys, LONG=long and phase in (-1, 1))
    # FMA contraction as DecoderLayerKernel launches each phase: off where attention runs
    options = dict(num_stages=1, enable_fp_fusion=phase not in (-1, 1))
    if phase < 0:  # persistent: every phase at NUM_WARPS, both attention tile sizes (the most registers)
        return decode_layer._decoder_layer_kernel, types, consts, dict(options, num_warps=decode_layer.NUM_WARPS)
    warps, limits = kernel._launch_configs(long, many_keys, True, rows)[phase]
    return decode_layer._decoder_layer_kernel, types, consts, dict(options, num_warps=warps, **limits)


def _rms_norm():
    """The residual RMSNorm of Qwen3-0.6B's hidden row after a split-K projection (and before the LM head)."""
    types = dict(x="*fp32", residual="*bf16", weight="*bf16", out="*bf16", residual_out="*bf16", eps="fp32",
                 stride_x="i32", stride_r="i32", stride_part="i32")
    consts = dict(N=1024, BLOCK=1024, HAS_RESIDUAL=True, PARTS=1, PDL=True)
    return fused._rms_norm_kernel, types, consts, dict(num_warps=4, num_stages=1, enable_fp_fusion=False)


def _greedy_screen():
    """The screened greedy head's screen (greedy_head) on Qwen3-0.6B's 151936 x 1024 head."""
    types = dict(x="*bf16", codes="*i64", scale="*fp32", bound="*fp32", hi="*fp32", top="*fp32", gamma="fp32")
    rows, warps, _, _ = greedy_head.head_config(1024)
    consts = dict(K=1024, COLS_PAD=128, BN=rows, SLOTS=greedy_head.TOP_SLOTS, INTERPRET=False, PDL=True,
                  **greedy_head.fixed_point(1024))
    return greedy_head._screen_kernel, types, consts, dict(num_warps=warps, num_stages=3)


def _greedy_pick():
    types = dict(x="*bf16", w_desc=_desc(greedy_head.HEAD_TILE, 128), hi="*fp32", top="*fp32", keys="*i64",
                 margin="fp32", tiny="fp32", cap="fp32")
    _, _, tiles, stages = greedy_head.head_config(1024)
    consts = dict(K=1024, BM=16, BN=greedy_head.HEAD_TILE, BK=128, STAGES=stages, TILES=tiles,
                  SLOTS=greedy_head.TOP_SLOTS, PDL=True)
    return greedy_head._pick_kernel, types, consts, dict(num_warps=4, num_stages=3, enable_fp_fusion=False)


# name -> kernel spec at its GPU launch config (bf16, head 128, Qwen3-0.6B's 2 query heads per kv head)
KERNELS = {
    "xattention_sparse": _sparse,
    "xattention_estimate_s8": lambda: _estimate(8),
    "xattention_estimate_s16": lambda: _estimate(16),
    "xattention_estimate_fp8_s8": lambda: _estimate(8, fp8=True),
    "xattention_estimate_fp8_s16": lambda: _estimate(16, fp8=True),
    "prefill_short": lambda: _prefill(1024),
    "prefill_long": lambda: _prefill(16384),
    "decode_single_pass": lambda: _decode(False),
    "decode_split": lambda: _decode(True),
    "split_k_linear_16_rows_gated": lambda: _split_k(16, True),
    "split_k_linear_64_rows": lambda: _split_k(64, False),
    "rms_norm_residual": _rms_norm,
    "greedy_screen": _greedy_screen,
    "greedy_pick": _greedy_pick,
    "decoder_layer": _decoder_layer,
    # the five launches of a step whose graph is bounded at 2048 tokens (both tile sizes), as the engine runs them
    **{f"decoder_layer_{name}": (lambda p=p: _decoder_layer(p)) for p, name in
       enumerate(("norm_qkv", "attention", "o_proj", "norm_gate_up", "down"))},
}


def _ptxas():
    nvidia = triton.knobs.nvidia
    for tool in (getattr(nvidia, "ptxas_blackwell", None), nvidia.ptxas):  # the newest reads the newest PTX
        if tool is not None and tool.path and os.path.exists(tool.path):
            return tool.path
    raise RuntimeError("no ptxas found in this Triton installation")


def _compile(name):
    fn, types, consts, options = KERNELS[name]()
    params = inspect.signature(fn.fn).parameters
    signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    # The launcher specialises 16-byte aligned pointers and strides that are multiples of 16 (all of ours on the GPU):
    # without that, every load compiles to 2-byte accesses and the register counts mean nothing.
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if signature[p].startswith("*") or p.startswith("stride")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned), target=TARGET,
                          options=options)


def chain(name):
    """(instructions, CTA barriers, global loads after the kernel's first griddepcontrol.wait, those of them issued
    after the first CTA barrier that follows it) of one kernel's SASS, in program order. ptxas does not move a load
    across a CTA barrier, so a load behind one (say a norm's weight after the row's sum of squares) is a memory round
    trip that starts only once the reduction has ended: in a phase that runs no loop after its wait, each is one
    more link of the step's chain (benchmarks/results/README.md, thirty-second session)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(_compile(name).asm["cubin"])
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    wait = ops.index("ACQBULK") if "ACQBULK" in ops else 0
    after = ops[wait:]
    barrier = next((i for i, op in enumerate(after) if op.startswith("BAR.SYNC")), len(after))
    loads = [i for i, op in enumerate(after) if op.startswith("LDG")]
    return len(ops), sum(op.startswith("BAR.SYNC") for op in ops), len(loads), sum(i > barrier for i in loads)


def report(name):
    """(registers, spill store bytes, spill load bytes) of one kernel of KERNELS."""
    kernel = _compile(name)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True, check=True)
    text = log.stdout + log.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    stores, loads = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text).groups())
    return regs, stores, loads


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(KERNELS), default=list(KERNELS))
    parser.add_argument("--chain", action="store_true", help="report chain() instead: loads behind CTA barriers")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90a, bf16, head {HEAD}")
    if args.chain:
        print(f"{'kernel':26} {'instructions':>12} {'barriers':>8} {'loads after wait':>16} {'behind a barrier':>16}")
        for name in args.only:
            print(f"{name:26} " + " ".join(f"{v:{w}d}" for v, w in zip(chain(name), (12, 8, 16, 16))), flush=True)
        return
    print(f"{'kernel':26} {'registers':>9} {'spill stores':>13} {'spill loads':>12}")
    for name in args.only:
        regs, stores, loads = report(name)
        print(f"{name:26} {regs:9d} {stores:12d}B {loads:11d}B", flush=True)


if __name__ == "__main__":
    main()
