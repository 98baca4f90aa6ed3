"""XAttention on real text with SmolLM2-135M-Instruct (float32, CPU, PyTorch reference ops): density and fidelity.

Text: the Python language reference topics shipped with the standard library (``pydoc_data.topics``, the
``topics`` dict's values joined by blank lines in dict order), the first ``--length`` tokens.

1. Density: Q/K/V of every layer (after RoPE: the inputs of each ``Attention`` module, taken by a forward
   pre-hook) during one dense prefill; XAttention's block selection (block 128, each stride and threshold)
   per layer. This is the density the GPU speed-vs-density curve (benchmarks/xattention.py) is read at.
2. Fidelity: (a) relative error (Frobenius, all heads and positions) of the block-sparse attention output
   against dense causal attention on those captured Q/K/V (for ``--error-strides``: the reference sparse
   attention is the slow part); (b) perplexity of the text with the model's
   dense prefill vs its XAttention prefill (threshold 0.9, stride 8, block 128 in every layer), plus top-1
   agreement and KL(dense || sparse) of the next-token distributions; (c) needle in a haystack: a passphrase
   sentence at several depths of a ``--haystack`` token prefix of the text, asked for through the chat
   template and generated greedily by the dense engine and by the engine with ``sparse_prefill="xattention"``.
``--share-kv-heads``: every selection shared by a kv head's query heads (``xattn_share_kv_heads``).
``--fp8-estimate``: every estimate scores fp8 Q and K (``xattn_fp8_estimate``).
Writes JSON and a markdown table (printed too).

    PYTHONPATH=. .venv/bin/python benchmarks/xattention_fidelity.py [--length 8192] [--haystack 7500]
"""
import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from pydoc_data.topics import topics

from pagedllm import LLM, SamplingParams, ops
from pagedllm.layers.attention import Attention, AttentionMetadata, SparsePrefill, set_forward_context
from pagedllm.models import load_model
from pagedllm.ops.xattention import reference as ref

MODEL = "smollm2-135m-instruct"
BLOCK = 128
ENGINE_SPARSE = SparsePrefill(threshold=0.9, stride=8, block_size=BLOCK)  # the engine's defaults (not shared)
TEXT_SOURCE = (f"pydoc_data.topics of Python {sys.version.split()[0]}: the language reference topics, "
               "values joined by blank lines in dict order")
WORDS = ["amber", "falcon", "copper", "meadow", "violet", "harbor", "glacier", "lantern", "orchid", "tundra",
         "saffron", "pebble", "quartz", "willow", "ember", "canyon"]


def reference_text() -> str:
    return "\n\n".join(topics.values())


def load_text_model(dtype: torch.dtype, device: str):
    """``(model, tokenizer, token ids of the whole reference text)`` for MODEL in dtype on device."""
    from transformers import AutoTokenizer
    model, _, model_dir = load_model(MODEL, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer(reference_text(), add_special_tokens=False).input_ids, device=device)
    return model, tokenizer, ids


def prefill_hidden(model, input_ids: torch.Tensor, sparse: SparsePrefill | None) -> torch.Tensor:
    """Final hidden states of every position of one sequence prefilled from an empty paged cache in one
    step (the layout tests/test_models.py uses), dense or with XAttention in every layer; on input_ids'
    device."""
    n, page, device = input_ids.shape[0], 16, input_ids.device
    num_blocks = -(-n // page)
    dtype = next(model.parameters()).dtype
    for m in model.modules():
        if isinstance(m, Attention):
            k_shape, v_shape, cache_dtype = ops.kv_cache_shapes(num_blocks, page, m.num_kv_heads, m.head_size,
                                                                dtype, "auto", device)
            m.bind_cache(torch.zeros(k_shape, dtype=cache_dtype, device=device),
                         torch.zeros(v_shape, dtype=cache_dtype, device=device), "auto", 1.0, 1.0)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), num_decode_tokens=0,
        decode_block_tables=None, decode_seq_lens=None, decode_max_seq_len=0,
        prefill_block_tables=torch.arange(num_blocks, **i32)[None],
        prefill_seq_lens=torch.tensor([n], **i32), prefill_query_start_loc=torch.tensor([0, n], **i32),
        prefill_max_query_len=n, prefill_max_seq_len=n, sparse_prefill=sparse)
    with set_forward_context(meta), torch.no_grad():
        return model(input_ids, torch.arange(n, device=device))


@contextlib.contextmanager
def captured_qkv(model):
    """Yields a list that receives, per layer in order, (q [1, H, T, D], k, v [1, H_kv, T, D]) as each
    Attention module sees them (after RoPE)."""
    store, handles = [], []

    def hook(module, args):
        q, k, v, rope = args
        # Attention rotates q and k itself (in place on the GPU): rotate copies the same way.
        q, k = rope.rotary(rope.positions, q.clone(), k.clone(), rope.qk_norm)
        store.append(tuple(x.detach().view(x.shape[0], -1, module.head_size).transpose(0, 1)[None].clone()
                           for x in (q, k, v)))

    for m in model.modules():
        if isinstance(m, Attention):
            handles.append(m.register_forward_pre_hook(hook))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def layer_stats(qkv, strides, thresholds, error_strides, share_kv_heads, fp8_estimate):
    """Per layer: XAttention density for each (stride, threshold) and, for the error_strides, the
    block-sparse output's error (the reference sparse attention is ~10 s per call at 8K on 2 cores)."""
    rows = []
    for layer, (q, k, v) in enumerate(qkv):
        dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        row = dict(layer=layer)
        for stride in strides:
            # xattn_estimate is block_sums + select_blocks; the sums are shared by the thresholds
            sums, first = ref.block_sums(q, k, BLOCK, stride, 16384, True, fp8_estimate)
            if share_kv_heads:
                sums = ref.kv_head_sums(sums, k.shape[1])
            for thr in thresholds:
                mask, density = ref.select_blocks(sums, first, thr)
                key = f"s{stride}_t{thr}"
                row[f"density_{key}"] = float(density)
                if stride in error_strides:
                    sparse = ref.block_sparse_attention(q, k, v, mask, BLOCK)
                    row[f"rel_err_{key}"] = float((sparse - dense).norm() / dense.norm())
        rows.append(row)
        print(f"layer {layer}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "layer"), flush=True)
    return rows


def compare_logits(model, input_ids, dense_hidden, sparse_hidden, chunk=1024):
    """Perplexity of the text under each prefill (all positions and the second half), the fraction of
    positions whose argmax agrees, and the mean KL(dense || sparse) of the next-token distributions."""
    targets = input_ids[1:]
    nll = {"dense": [], "sparse": []}
    agree, kl = 0, 0.0
    with torch.no_grad():
        for s in range(0, targets.shape[0], chunk):
            e = min(s + chunk, targets.shape[0])
            lp_d = F.log_softmax(model.compute_logits(dense_hidden[s:e]).float(), -1)
            lp_s = F.log_softmax(model.compute_logits(sparse_hidden[s:e]).float(), -1)
            nll["dense"].append(F.nll_loss(lp_d, targets[s:e], reduction="none"))
            nll["sparse"].append(F.nll_loss(lp_s, targets[s:e], reduction="none"))
            agree += int((lp_d.argmax(-1) == lp_s.argmax(-1)).sum())
            kl += float((lp_d.exp() * (lp_d - lp_s)).sum())
    half = targets.shape[0] // 2
    out = dict(tokens=int(input_ids.shape[0]), top1_agreement=agree / targets.shape[0],
               mean_kl_dense_sparse=kl / targets.shape[0])
    for name, parts in nll.items():
        t = torch.cat(parts)
        out[f"ppl_{name}"] = float(t.mean().exp())
        out[f"ppl_{name}_second_half"] = float(t[half:].mean().exp())
    return out


def needle_prompts(tokenizer, text, haystack_tokens, depths, seed=0):
    """(depth, passphrase, chat messages) per depth: the passphrase sentence inserted at the line break
    nearest below ``depth`` of a haystack of the text's first haystack_tokens tokens."""
    haystack = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids[:haystack_tokens])
    rng = random.Random(seed)
    out = []
    for depth in depths:
        phrase = " ".join(rng.sample(WORDS, 2))
        cut = haystack.rfind("\n", 0, int(depth * len(haystack))) + 1
        doc = f"{haystack[:cut]}The secret passphrase is {phrase}.\n{haystack[cut:]}"
        out.append((depth, phrase, [{"role": "user", "content": f"{doc}\n\nWhat is the secret passphrase?"}]))
    return out


def run_needles(prompts, max_tokens, sparse):
    """Greedy answers of the dense engine and of the XAttention engine; one request at a time and no
    prefix caching, so every prompt is one whole-prompt prefill step (sparse where the engine says so)."""
    common = dict(dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=8192)
    engines = {"dense": {}, "xattention": dict(sparse_prefill="xattention", xattn_threshold=sparse.threshold,
                                               xattn_stride=sparse.stride, xattn_block_size=sparse.block_size,
                                               xattn_share_kv_heads=sparse.share_kv_heads,
                                               xattn_min_prompt_len=1024)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rows = [dict(depth=d, passphrase=p) for d, p, _ in prompts]
    for name, options in engines.items():
        llm = LLM(MODEL, **common, **options)
        for row, (_, phrase, messages) in zip(rows, prompts):
            out = llm.chat(messages, params, use_tqdm=False)[0]
            text = out.outputs[0].text
            row["prompt_tokens"] = len(out.prompt_token_ids)
            row[f"{name}_answer"] = text
            row[f"{name}_found"] = phrase.lower() in text.lower()
            print(f"needle depth {row['depth']} ({name}): {text!r} -> found {row[f'{name}_found']}", flush=True)
        del llm
    return rows


def markdown(result) -> str:
    thresholds = result["thresholds"]
    keys = [f"s{s}_t{t}" for s in result["strides"] for t in thresholds]
    names = [f"stride {s}, thr {t}" for s in result["strides"] for t in thresholds]
    err_keys = [f"s{s}_t{t}" for s in result["error_strides"] for t in thresholds]
    err_names = [f"stride {s}, thr {t}" for s in result["error_strides"] for t in thresholds]
    # results from before the options lack them
    shared = result["engine_sparse_prefill"].get("share_kv_heads", False)
    fp8 = result["engine_sparse_prefill"].get("fp8_estimate", False)
    lines = [f"## XAttention on real text: SmolLM2-135M-Instruct, float32, CPU ({result['date']})", "",
             f"Text: {result['text']}; {result['length']} tokens; block {BLOCK}; selection "
             f"{'shared by each kv head' if shared else 'per query head'}; estimate on "
             f"{'fp8' if fp8 else 'float32'} Q and K.", "",
             "### Density (kept fraction of causal blocks) and attention-output relative error, per layer", "",
             "| layer | " + " | ".join(f"density {n}" for n in names) + " | "
             + " | ".join(f"rel err {n}" for n in err_names) + " |",
             "|---|" + "---|" * (len(keys) + len(err_keys))]
    rows = result["layers"] + [dict(layer="**mean**", **result["layer_mean"])]
    for r in rows:
        lines.append(f"| {r['layer']} | " + " | ".join(f"{r[f'density_{k}']:.3f}" for k in keys) + " | "
                     + " | ".join(f"{r[f'rel_err_{k}']:.4f}" for k in err_keys) + " |")
    p = result["perplexity"]
    sparse = result["engine_sparse_prefill"]
    lines += ["", f"### Perplexity, dense vs the model's XAttention prefill (threshold {sparse['threshold']}, "
              f"stride {sparse['stride']}, block {BLOCK}, all layers), {p['tokens']} tokens", "",
              "| prefill | ppl (all) | ppl (second half) |", "|---|---|---|",
              f"| dense | {p['ppl_dense']:.4f} | {p['ppl_dense_second_half']:.4f} |",
              f"| XAttention | {p['ppl_sparse']:.4f} | {p['ppl_sparse_second_half']:.4f} |", "",
              f"Top-1 agreement {p['top1_agreement']:.4f}; mean KL(dense || sparse) "
              f"{p['mean_kl_dense_sparse']:.2e} nats/token."]
    if result["needle"]:
        lines += ["", "### Needle in a haystack (greedy, chat template)", "",
                  "| depth | prompt tokens | passphrase | dense | XAttention | dense answer | XAttention answer |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["needle"]:
            answers = [r[f"{n}_answer"].strip().replace("\n", " ").replace("|", "\\|")[:80]
                       for n in ("dense", "xattention")]
            lines.append(f"| {r['depth']:.0%} | {r['prompt_tokens']} | {r['passphrase']} | "
                         f"{'found' if r['dense_found'] else 'missed'} | "
                         f"{'found' if r['xattention_found'] else 'missed'} | {answers[0]} | {answers[1]} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192, help="tokens of text for density and perplexity")
    parser.add_argument("--strides", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.9, 0.95])
    parser.add_argument("--error-strides", type=int, nargs="+", default=[8],
                        help="strides whose sparse attention output is compared with dense")
    parser.add_argument("--haystack", type=int, default=7500, help="haystack tokens (0 = no needle test)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--share-kv-heads", action="store_true",
                        help="one selection per kv head, from its query heads' block sums added together")
    parser.add_argument("--fp8-estimate", action="store_true", help="estimates score fp8 Q and K")
    parser.add_argument("--out", default=None, help="JSON path (the .md goes beside it)")
    args = parser.parse_args()
    sparse = dataclasses.replace(ENGINE_SPARSE, share_kv_heads=args.share_kv_heads, fp8_estimate=args.fp8_estimate)
    start = time.time()
    model, tokenizer, ids = load_text_model(torch.float32, "cpu")
    ids = ids[:args.length]

    with captured_qkv(model) as qkv:
        dense_hidden = prefill_hidden(model, ids, None)
    print(f"dense prefill done ({time.time() - start:.0f} s)", flush=True)
    layers = layer_stats(qkv, args.strides, args.thresholds, args.error_strides, args.share_kv_heads,
                         args.fp8_estimate)
    del qkv
    layer_mean = {k: sum(r[k] for r in layers) / len(layers) for k in layers[0] if k != "layer"}
    sparse_hidden = prefill_hidden(model, ids, sparse)
    print(f"sparse prefill done ({time.time() - start:.0f} s)", flush=True)
    perplexity = compare_logits(model, ids, dense_hidden, sparse_hidden)
    del model, dense_hidden, sparse_hidden

    needle = []
    if args.haystack:
        needle = run_needles(needle_prompts(tokenizer, reference_text(), args.haystack, args.depths),
                             args.max_tokens, sparse)

    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), model=MODEL, dtype="float32",
                  device="cpu", torch=torch.__version__, text=TEXT_SOURCE, length=int(ids.shape[0]),
                  block_size=BLOCK, strides=args.strides, thresholds=args.thresholds,
                  error_strides=args.error_strides,
                  engine_sparse_prefill=dataclasses.asdict(sparse),
                  layers=layers, layer_mean=layer_mean, perplexity=perplexity, needle=needle,
                  wall_s=round(time.time() - start))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"xattention_fidelity_cpu_{datetime.date.today():%Y%m%d}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    table = markdown(result)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    print("\n" + table + f"\nwrote {out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
