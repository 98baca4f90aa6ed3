"""ModelRunner: owns the KV cache, turns a scheduled step into flat tensors, runs the model and samples."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pagedllm import ops
from pagedllm.config import EngineConfig
from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import Attention, AttentionMetadata, SparsePrefill, set_forward_context
from pagedllm.layers.sampler import (PromptLogprobs, Sampler, SamplerOutput, greedy_tokens, prompt_logprobs,
                                     prompt_logprobs_bytes)
from pagedllm.ops.xattention import prefill_workspace_bytes
from pagedllm.worker.buffers import HostBuffers, packed_size, packed_views, write_packed, zero_copy
from pagedllm.worker.cuda_graph import PIECEWISE_MAX_TOKENS, DecodeGraphs, PiecewiseGraphs, screen_bytes

logger = logging.getLogger(__name__)


def head_size_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = math.ceil(config.max_model_len / config.block_size)
        self.sampler = Sampler(self.device, config.seed)
        self.sparse_prefill = None
        if config.sparse_prefill == "xattention":
            self.sparse_prefill = SparsePrefill(config.xattn_threshold, config.xattn_stride,
                                                config.xattn_block_size, config.xattn_share_kv_heads,
                                                config.xattn_fp8_estimate)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_size = head_size_of(hf_config)
        self.hf_config = hf_config
        # The reference ops read lengths on the host, which a graph cannot replay.
        graphs_ok = self.device.type == "cuda" and ops.get_backend(self.device) is not ops.reference
        full, piecewise = config.graph_modes() if graphs_ok else (False, False)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit(full, piecewise)
        self._allocate_kv_cache()
        # The previous step's samples on the device, and the row of each request among them: a decode step
        # scheduled before they reached the host takes its input ids from there.
        self._sampled_rows: dict[str, int] = {}
        self._sampled_ids: torch.Tensor | None = None
        self.uploader = Uploader(self.device)
        self.decode_graphs = self.piecewise_graphs = None
        start = time.perf_counter()
        if full:
            self.decode_graphs = DecodeGraphs(model, self.device, config.max_num_seqs, config.max_model_len,
                                              self.block_size)
            self.decode_graphs.capture()
        if piecewise:
            self.piecewise_graphs = PiecewiseGraphs(model, self.device, config.max_num_batched_tokens,
                                                    hf_config.num_attention_heads, self.head_size, dtype)
            self.piecewise_graphs.capture()
        if full or piecewise:
            torch.cuda.empty_cache()  # the warm-up runs' activations: eager steps allocate their own
            logger.info("CUDA graphs captured in %.1f s: decode batch sizes %s (context bounds %s), piecewise "
                        "token counts %s", time.perf_counter() - start, self.decode_graphs and self.decode_graphs.sizes,
                        self.decode_graphs and self.decode_graphs.context_bounds,
                        self.piecewise_graphs and self.piecewise_graphs.sizes)
        if self.device.type == "cuda":
            self._load_step_kernels()

    @torch.inference_mode()
    def _load_step_kernels(self) -> None:
        """cuBLAS picks the LM head's kernel by row count, and CUDA loads a kernel lazily at its first launch,
        synchronising the device: a row count first seen mid-run stalls the pipeline of overlapped steps
        (~10 ms each time on the H100). So every row count a step can sample runs once here, and so do the
        zero-copy transfers (compiled, else, at the first step)."""
        hidden = torch.zeros(self.config.max_num_seqs, self.hf_config.hidden_size, dtype=self.dtype,
                             device=self.device)
        for rows in range(1, self.config.max_num_seqs + 1):
            greedy_tokens(self.model.compute_logits(hidden[:rows]))
        transfer = self.uploader.transfer
        if transfer is not None:
            host = torch.zeros(16, dtype=torch.int64, pin_memory=True)
            dev = torch.zeros(16, dtype=torch.int64, device=self.device)
            transfer.upload(host.view(torch.uint8), dev.view(torch.uint8), dev[:4].view(2, 2), 1, dev, dev)
            transfer.upload(host.view(torch.uint8), dev.view(torch.uint8))
            transfer.download(host, dev)
        torch.cuda.synchronize(self.device)

    def _cache_shapes(self, num_blocks: int):
        return ops.kv_cache_shapes(num_blocks, self.block_size, self.num_kv_heads, self.head_size,
                                   self.dtype, self.config.kv_cache_dtype, self.device)

    def _bytes_per_block(self) -> int:
        key_shape, value_shape, cache_dtype = self._cache_shapes(1)
        elem = torch.empty((), dtype=cache_dtype).element_size()
        return (math.prod(key_shape) + math.prod(value_shape)) * elem * len(self.attn_layers)

    def _blocks_that_fit(self, decode_graphs: bool, piecewise_graphs: bool) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Room for the largest step's activations (a few MLP-wide tensors per token) and its fp32 logits, or
            # after its samples the prompt logprobs' slices of them; the piecewise graphs' pool holds as much again
            # for their largest step, plus their static q and attention-output buffers. The graphs are captured
            # after the cache is allocated.
            cfg, hf = self.config, self.hf_config
            width = 4 * hf.intermediate_size + 8 * hf.hidden_size
            graph_tokens = min(cfg.max_num_batched_tokens, PIECEWISE_MAX_TOKENS) if piecewise_graphs else 0
            q_width = hf.num_attention_heads * self.head_size
            logits = max(3 * cfg.max_num_seqs * hf.vocab_size * 4, prompt_logprobs_bytes(hf.vocab_size))
            activations = (((cfg.max_num_batched_tokens + graph_tokens) * width + 2 * graph_tokens * q_width)
                           * self.dtype.itemsize + logits)
            if decode_graphs:  # the LM head's int8 screen they build, if any (DecodeGraphs.screen)
                activations += screen_bytes(self.model)
            if self.sparse_prefill is not None and cfg.max_model_len >= cfg.xattn_min_prompt_len:
                # a layer's sparse prefill of a chunk against a whole max_model_len context
                activations += prefill_workspace_bytes(
                    cfg.max_model_len, min(cfg.max_num_batched_tokens, cfg.max_model_len), hf.num_attention_heads,
                    self.num_kv_heads, self.head_size, self.dtype.itemsize, cfg.xattn_block_size, cfg.xattn_stride)
            budget = total * cfg.gpu_memory_utilization - used - activations
        else:
            budget = self.config.cpu_kv_cache_space_gb * (1 << 30)
        num_blocks = max(0, int(budget // self._bytes_per_block()))
        if num_blocks * self.block_size < self.config.max_model_len:  # vLLM refuses to start too
            raise ValueError(f"the memory left for the KV cache holds {num_blocks * self.block_size} tokens, fewer "
                             f"than max_model_len={self.config.max_model_len}, so a sequence of that length could "
                             "never run: lower max_model_len or max_num_batched_tokens, raise gpu_memory_utilization "
                             "/ cpu_kv_cache_space_gb, or set num_kv_blocks")
        # More blocks than every sequence at full length could use is wasted memory.
        needed = self.config.max_num_seqs * math.ceil(self.config.max_model_len / self.block_size)
        return min(num_blocks, needed)

    def _allocate_kv_cache(self) -> None:
        key_shape, value_shape, cache_dtype = self._cache_shapes(self.num_blocks)
        scale = torch.ones(1, dtype=torch.float32, device=self.device)
        for layer in self.attn_layers:
            layer.bind_cache(torch.zeros(key_shape, dtype=cache_dtype, device=self.device),
                             torch.zeros(value_shape, dtype=cache_dtype, device=self.device),
                             self.config.kv_cache_dtype, scale, scale)

    def prepare(self, items: list[ScheduledRequest], blocks_of: Callable[[Request], list[KVCacheBlock]],
                num_rows: int = 0) -> StepInputs:
        """One step's flat inputs on the host; items must have the decodes (one new token) first.

        num_rows pads a decode-only step to that many rows for a CUDA graph: the extra rows write no KV
        (slot -1) and attend to nothing (seq_len 0). A decode whose token is still a placeholder gets input
        id 0 here; StepInputs.placeholders says where the device fills it in from the previous samples.
        """
        bs = self.block_size
        num_decodes = next((i for i, it in enumerate(items) if it.num_new_tokens != 1), len(items))
        starts = np.array([it.num_computed_tokens for it in items], dtype=np.int64)
        num_new = np.array([it.num_new_tokens for it in items], dtype=np.int64)
        seq_lens = starts + num_new
        rows = [_block_row(it.request, blocks_of(it.request), self.max_blocks_per_seq) for it in items]
        widths = -(-seq_lens // bs)

        # Decodes: one token each, so their per-token arrays are per-row arrays; the prefills' tokens follow.
        d = slice(0, num_decodes)
        num_rows = max(num_rows, num_decodes)
        num_tokens = num_rows + sum(it.num_new_tokens for it in items[num_decodes:])
        decode_table = _block_table(rows[d], widths[d], num_rows)
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        input_ids[d] = [toks[c] if c < len(toks) else 0 for toks, c in
                        ((it.request.all_token_ids, it.num_computed_tokens) for it in items[d])]
        placeholder_rows = [i for i, it in enumerate(items[d]) if it.num_computed_tokens == it.request.num_tokens]
        placeholders = np.array([placeholder_rows, [self._sampled_rows[items[i].request.request_id]
                                                    for i in placeholder_rows]], dtype=np.int64)
        positions = np.zeros(num_tokens, dtype=np.int64)
        positions[d] = starts[d]
        slots = np.full(num_tokens, -1, dtype=np.int64)
        slots[d] = decode_table[np.arange(num_decodes), starts[d] // bs] * bs + starts[d] % bs
        decode_seq_lens = np.zeros(num_rows, dtype=np.int32)
        decode_seq_lens[d] = seq_lens[d]

        # Prefills: a run of tokens each.
        p = slice(num_decodes, len(items))
        first = num_rows  # a prefill's first token
        for it, row, start, end in zip(items[p], rows[p], starts[p].tolist(), seq_lens[p].tolist()):
            t = slice(first, first + end - start)
            input_ids[t] = it.request.all_token_ids[start:end]
            positions[t] = pos = np.arange(start, end)
            slots[t] = row[pos // bs] * bs + pos % bs
            first = t.stop
        query_start_loc = np.zeros(len(items) - num_decodes + 1, dtype=np.int32)
        np.cumsum(num_new[p], out=query_start_loc[1:])

        sample = np.array([it.sample for it in items], dtype=bool)
        return StepInputs(
            input_ids=input_ids, sample_slot=np.zeros(1, dtype=np.int64), placeholders=placeholders,
            positions=positions, slot_mapping=slots,
            num_decodes=num_decodes, decode_block_tables=decode_table, decode_seq_lens=decode_seq_lens,
            prefill_block_tables=_block_table(rows[p], widths[p], len(items) - num_decodes),
            prefill_seq_lens=seq_lens[p].astype(np.int32), prefill_query_start_loc=query_start_loc,
            logits_indices=(np.cumsum(num_new) - 1)[sample],
        )

    def _metadata(self, step: StepInputs, dev: dict[str, torch.Tensor],
                  decode_rows_share_blocks: bool = False) -> AttentionMetadata:
        has_decode, has_prefill = step.num_decodes > 0, len(step.prefill_seq_lens) > 0
        prefill_max_seq_len = int(step.prefill_seq_lens.max(initial=0))
        long_prefill = prefill_max_seq_len >= self.config.xattn_min_prompt_len
        return AttentionMetadata(
            slot_mapping=dev["slot_mapping"],
            num_decode_tokens=step.num_decodes,
            decode_block_tables=dev["decode_block_tables"] if has_decode else None,
            decode_seq_lens=dev["decode_seq_lens"] if has_decode else None,
            decode_max_seq_len=int(step.decode_seq_lens.max(initial=0)),
            prefill_block_tables=dev["prefill_block_tables"] if has_prefill else None,
            prefill_seq_lens=dev["prefill_seq_lens"] if has_prefill else None,
            prefill_query_start_loc=dev["prefill_query_start_loc"] if has_prefill else None,
            prefill_max_query_len=int(np.diff(step.prefill_query_start_loc).max(initial=0)),
            prefill_max_seq_len=prefill_max_seq_len,
            sparse_prefill=self.sparse_prefill if long_prefill else None,
            decode_rows_share_blocks=decode_rows_share_blocks,
        )

    def _upload(self, step: StepInputs, static: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The step's arrays on the device (one transfer), with placeholder input ids filled in from the previous
        step's samples: as new tensors, or in the leading corners of a decode graph's static inputs
        (DecodeGraphs.inputs) for a graph step, by the graph itself where it uploads them (staged)."""
        rows = step.placeholders[0]
        k = len(rows)
        if static is None:
            dev = dict(zip(_UPLOADED, self.uploader(*(getattr(step, name) for name in _UPLOADED))))
        else:
            dev, graphs, bs = static, self.decode_graphs, len(static["input_ids"])
            if graphs.uploads_inputs(bs):
                graphs.stage(bs, {name: getattr(step, name) for name in static}, self._sampled_ids if k else None)
                return dev
            if self.uploader.into(graphs.buffer, static.values(), [getattr(step, name) for name in static],
                                  (static["placeholders"], k, self._sampled_ids, static["input_ids"])):
                return dev
        if k:
            dev_rows, dev_sources = dev["placeholders"][:, :k]
            if rows[-1] == k - 1:
                # Rows 0..k-1, as when every decode row's token is on its way (the steady state): one gather
                # straight into them.
                torch.index_select(self._sampled_ids, 0, dev_sources, out=dev["input_ids"][:k])
            else:
                dev["input_ids"].index_copy_(0, dev_rows, self._sampled_ids.index_select(0, dev_sources))
        return dev

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, blocks_of: Callable[[Request], list[KVCacheBlock]]
                ) -> tuple[list[Request], SamplerOutput | None, PromptLogprobs | None]:
        """Queues one step on the device; returns the requests that sample a token in it, their samples, and the
        logprobs of the prompt tokens it computed for requests that asked for them. Nothing here waits for the
        device: reading the samples does."""
        # Decodes first, longest first: the decode kernel starts one program per (sequence, kv head) in row
        # order, so a long sequence started last would run on alone at the end of the launch.
        items = sorted(sched.scheduled, key=lambda it: (it.num_new_tokens != 1,
                                                        -it.num_computed_tokens - it.num_new_tokens))
        if not items:
            return [], None, None
        decode_only = items[-1].num_new_tokens == 1
        # The decode graphs return no hidden states to take prompt logprobs from: a step with any runs eagerly.
        spans = _prompt_spans(items)
        # The decode graphs hold the fused decoder-layer kernel, which such a step must not take (AttentionMetadata).
        shared = decode_only and _rows_share_written_blocks(items, blocks_of, self.block_size)
        graphs = self.decode_graphs
        head = None  # (logits or None where screened, greedy ids) of every row, where the step's graph computed them
        sample_slot = None  # where the graph also writes the greedy ids on the host
        if graphs is not None and decode_only and not shared and not spans and graphs.fits(len(items)):
            size = graphs.padded_size(len(items))
            step = self.prepare(items, blocks_of, size)
            sample_slot = graphs.take_sample_slot(size)
            if sample_slot is not None:
                step.sample_slot[0] = sample_slot[1]
            dev = self._upload(step, graphs.inputs[size])
            screened = graphs.has_screen(size) and Sampler.plain_greedy([it.request for it in items])
            hidden = graphs.run(size, max_seq_len=int(step.decode_seq_lens.max()), screened=screened)
            if graphs.has_head(size):
                head = (None if screened else graphs.logits), graphs.greedy
        else:
            step = self.prepare(items, blocks_of)
            dev = self._upload(step)
            meta = self._metadata(step, dev, shared)
            if self.piecewise_graphs is not None and self.piecewise_graphs.fits(len(step.input_ids)):
                hidden = self.piecewise_graphs.run(dev["input_ids"], dev["positions"], meta)
            else:
                with set_forward_context(meta):
                    hidden = self.model(dev["input_ids"], dev["positions"])
        sampling = [it.request for it in items if it.sample]
        out = None
        if sampling:
            # When rows 0..n-1 sample (every row of a decode-only step, as a rule), a slice replaces the gather.
            n = len(sampling)
            leading = step.logits_indices[-1] == n - 1
            rows = slice(0, n) if leading else dev["logits_indices"][:n]
            if head is None:
                out = self.sampler(self.model.compute_logits(hidden[rows]), sampling)
            else:
                logits, greedy = head
                out = self.sampler(None if logits is None else logits[rows], sampling, greedy[rows],
                                   sample_slot if leading else None)
            self._sampled_rows = {r.request_id: i for i, r in enumerate(sampling)}
            self._sampled_ids = out.device_token_ids
        # after the samples, which the step's other requests wait for
        return sampling, out, self._prompt_logprobs(spans, hidden) if spans else None

    def _prompt_logprobs(self, spans: list[tuple[Request, int, int, int, int]], hidden: torch.Tensor) -> PromptLogprobs:
        rows = np.concatenate([np.arange(row, row + count) for _, _, count, _, row in spans])
        targets = np.concatenate([r.prompt_token_ids[first:first + count] for r, first, count, _, _ in spans])
        rows, targets = self.sampler.upload_ints(rows, targets)
        return prompt_logprobs(self.model.compute_logits, hidden[rows], targets, [span[:4] for span in spans],
                               self.model.head_weight().shape[0])


def _prompt_spans(items: list[ScheduledRequest]) -> list[tuple[Request, int, int, int, int]]:
    """The prompt positions of the step whose next token's logprobs their request still needs, per item: (request,
    index of the first such next token in its prompt, how many, top n, the first position's row in the step)."""
    spans, row = [], 0
    for it in items:
        r = it.request
        if r.prompt_logprobs is not None:
            # positions [start, end): after any the request has (a preempted request runs its prompt again), before
            # the prompt's last, whose next token is sampled
            start = max(it.num_computed_tokens, len(r.prompt_logprobs) - 1)
            end = min(it.num_computed_tokens + it.num_new_tokens, r.num_prompt_tokens - 1)
            if end > start:
                spans.append((r, start + 1, end - start, r.sampling_params.prompt_logprobs,
                              row + start - it.num_computed_tokens))
        row += it.num_new_tokens
    return spans


def _rows_share_written_blocks(items: list[ScheduledRequest], blocks_of: Callable[[Request], list[KVCacheBlock]],
                               block_size: int) -> bool:
    """Whether a decode row's token goes into a block that another request also holds. Only full blocks are shared,
    so the token completes it and the step registered it in the prefix cache, where a request scheduled later in
    the same step found it: that request's row reads the keys this row writes (AttentionMetadata)."""
    return any(blocks_of(it.request)[it.num_computed_tokens // block_size].ref_cnt > 1 for it in items)


class Uploader:
    """Host->device transfer of a step's small arrays in one copy: they are written into a host buffer laid out
    as their device destination, instead of a pinned allocation and a copy per array."""

    def __init__(self, device: torch.device, num_buffers: int = 3) -> None:
        self.device = device
        self.buffers = HostBuffers(device, num_buffers)
        self.transfer = zero_copy(device)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays as new device tensors (on the CPU, the arrays themselves)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        specs = [(_TORCH_DTYPES[a.dtype], a.shape) for a in arrays]
        packed = torch.empty(packed_size(specs), dtype=torch.uint8, device=self.device)
        views = packed_views(packed, specs)
        self.into(packed, views, arrays)
        return views

    def into(self, buffer: torch.Tensor, views: Iterable[torch.Tensor], arrays: Iterable[np.ndarray],
             placeholders: tuple | None = None) -> bool:
        """Writes each array into the leading corner of its view, a view of the device buffer (uint8) with the
        array's dtype, in one transfer of the buffer's bytes from the first to the last one written: the other
        bytes in that range (parts of the views past the arrays) may change. A few KB go by a zero-copy kernel
        (buffers.zero_copy), which also fills in the placeholder ids where placeholders = (the placeholders'
        view, their count, the previous samples, the input ids' view) is given: then it returns True, else the
        caller gathers them."""
        host, copied = self.buffers.take(buffer.numel())  # laid out as the device buffer
        start, end = write_packed(host, buffer, views, arrays)
        kernel = self.transfer is not None and start < end and self.transfer.fits(end - start)
        if kernel:
            self.transfer.upload(host[start:end], buffer[start:end], *(placeholders or (None, 0, None, None)))
        elif start < end:
            buffer[start:end].copy_(host[start:end], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        return kernel and placeholders is not None


_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}
# StepInputs fields sent to the device each step.
_UPLOADED = ("input_ids", "placeholders", "positions", "slot_mapping", "logits_indices", "decode_block_tables",
             "decode_seq_lens", "prefill_block_tables", "prefill_seq_lens", "prefill_query_start_loc")


@dataclass
class StepInputs:
    """One step's flat inputs as host arrays, laid out as AttentionMetadata describes them. A decode-only
    step padded for a CUDA graph has more decode rows than scheduled requests."""
    input_ids: np.ndarray  # int64 per token
    sample_slot: np.ndarray  # int64 [1]: a decode graph's HostRing row for the greedy ids (DecodeGraphs)
    placeholders: np.ndarray  # int64 [2, n]: decode rows whose input id is the previous step's sample at index
    positions: np.ndarray  # int64 per token
    slot_mapping: np.ndarray  # int64 per token
    num_decodes: int
    decode_block_tables: np.ndarray  # int32 [decode rows, blocks]
    decode_seq_lens: np.ndarray  # int32 per decode row
    prefill_block_tables: np.ndarray  # int32 [prefills, blocks]
    prefill_seq_lens: np.ndarray  # int32 per prefill
    prefill_query_start_loc: np.ndarray  # int32 [prefills + 1]
    logits_indices: np.ndarray  # int64: the tokens whose logits are sampled


class _BlockRow:
    """A request's block ids as a numpy row of max_blocks_per_seq entries, extended as its block list grows.

    KVCacheManager only appends to a request's block list and drops the list when it frees the request
    (finish or preemption), so the row stays valid while it mirrors the same list object.
    """
    __slots__ = ("blocks", "ids", "count")

    def __init__(self, blocks: list[KVCacheBlock], capacity: int) -> None:
        self.blocks, self.ids, self.count = blocks, np.zeros(capacity, dtype=np.int64), 0


def _block_row(request: Request, blocks: list[KVCacheBlock], capacity: int) -> np.ndarray:
    """The request's block ids, followed by zeros up to capacity."""
    row = request.block_row
    if row is None or row.blocks is not blocks:
        row = request.block_row = _BlockRow(blocks, capacity)
    if row.count < len(blocks):
        row.ids[row.count:len(blocks)] = [b.block_id for b in blocks[row.count:]]
        row.count = len(blocks)
    return row.ids


def _block_table(rows: list[np.ndarray], widths: np.ndarray, num_rows: int) -> np.ndarray:
    """int32 [num_rows, widest row's width]: the rows, then zero rows."""
    table = np.zeros((num_rows, int(widths.max()) if rows else 0), dtype=np.int32)
    if rows:
        table[:len(rows)] = [row[:table.shape[1]] for row in rows]  # (np.stack takes twice as long)
    return table
