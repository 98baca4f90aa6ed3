"""ModelRunner: owns the KV cache, turns a scheduled step into flat tensors, runs the model and samples."""
from __future__ import annotations

import math
from typing import Callable

import torch

from pagedllm import ops
from pagedllm.config import EngineConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.layers.attention import Attention, AttentionMetadata, SparsePrefill, set_forward_context
from pagedllm.layers.sampler import Sampler, SamplerOutput
from pagedllm.worker.cuda_graph import DecodeGraphs


def head_size_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, hf_config, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.sampler = Sampler(self.device, config.seed)
        self.sparse_prefill = None
        if config.sparse_prefill == "xattention":
            self.sparse_prefill = SparsePrefill(config.xattn_threshold, config.xattn_stride,
                                                config.xattn_block_size)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_size = head_size_of(hf_config)
        self.hf_config = hf_config
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self._allocate_kv_cache()
        self.graphs = None
        # The reference ops read lengths on the host, which a graph cannot replay.
        if (self.device.type == "cuda" and not config.enforce_eager
                and ops.get_backend(self.device) is not ops.reference):
            self.graphs = DecodeGraphs(model, self.device, config.max_num_seqs, config.max_model_len,
                                       self.block_size)
            self.graphs.capture()

    def _cache_shapes(self, num_blocks: int):
        return ops.kv_cache_shapes(num_blocks, self.block_size, self.num_kv_heads, self.head_size,
                                   self.dtype, self.config.kv_cache_dtype, self.device)

    def _bytes_per_block(self) -> int:
        key_shape, value_shape, cache_dtype = self._cache_shapes(1)
        elem = torch.empty((), dtype=cache_dtype).element_size()
        return (math.prod(key_shape) + math.prod(value_shape)) * elem * len(self.attn_layers)

    def _blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Room for the largest step's activations (a few MLP-wide tensors per token) and its fp32 logits.
            cfg, hf = self.config, self.hf_config
            width = 4 * hf.intermediate_size + 8 * hf.hidden_size
            activations = (cfg.max_num_batched_tokens * width * self.dtype.itemsize
                           + 3 * cfg.max_num_seqs * hf.vocab_size * 4)
            budget = total * cfg.gpu_memory_utilization - used - activations
        else:
            budget = self.config.cpu_kv_cache_space_gb * (1 << 30)
        num_blocks = int(budget // self._bytes_per_block())
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower max_num_batched_tokens, raise "
                             "gpu_memory_utilization / cpu_kv_cache_space_gb, or set num_kv_blocks")
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

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_table(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return self._tensor([r + [0] * (width - len(r)) for r in rows], torch.int32)

    def prepare(self, items: list[ScheduledRequest], block_ids_of: Callable[[Request], list[int]]):
        """Flat inputs of one step; items must have the decodes (one new token) first."""
        bs = self.block_size
        input_ids, positions, slots, logits_indices = [], [], [], []
        tables, seq_lens, query_start = [], [], [0]
        num_decodes = sum(1 for it in items if it.num_new_tokens == 1)
        for it in items:
            req, start = it.request, it.num_computed_tokens
            end = start + it.num_new_tokens
            block_ids = block_ids_of(req)
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if it.sample:
                logits_indices.append(len(input_ids) - 1)
            tables.append(block_ids[:math.ceil(end / bs)])
            seq_lens.append(end)
            if len(tables) > num_decodes:
                query_start.append(query_start[-1] + it.num_new_tokens)
        d, p = slice(0, num_decodes), slice(num_decodes, len(items))
        has_prefill = num_decodes < len(items)
        prefill_max_seq_len = max(seq_lens[p], default=0)
        long_prefill = prefill_max_seq_len >= self.config.xattn_min_prompt_len
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=num_decodes,
            decode_block_tables=self._block_table(tables[d]) if num_decodes else None,
            decode_seq_lens=self._tensor(seq_lens[d], torch.int32) if num_decodes else None,
            decode_max_seq_len=max(seq_lens[d], default=0),
            prefill_block_tables=self._block_table(tables[p]) if has_prefill else None,
            prefill_seq_lens=self._tensor(seq_lens[p], torch.int32) if has_prefill else None,
            prefill_query_start_loc=self._tensor(query_start, torch.int32) if has_prefill else None,
            prefill_max_query_len=max((it.num_new_tokens for it in items[p]), default=0),
            prefill_max_seq_len=prefill_max_seq_len,
            sparse_prefill=self.sparse_prefill if long_prefill else None,
        )
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                self._tensor(logits_indices, torch.int64))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_ids_of: Callable[[Request], list[int]]
                ) -> tuple[list[Request], SamplerOutput | None]:
        """Runs one step; returns the requests that sample a token this step and what they sampled."""
        items = sorted(sched.scheduled, key=lambda it: it.num_new_tokens != 1)
        if not items:
            return [], None
        input_ids, positions, meta, logits_indices = self.prepare(items, block_ids_of)
        num_tokens = input_ids.shape[0]
        if self.graphs is not None and meta.num_decode_tokens == num_tokens and self.graphs.fits(num_tokens):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            with set_forward_context(meta):
                hidden = self.model(input_ids, positions)
        sampling = [it.request for it in items if it.sample]
        if not sampling:
            return [], None
        logits = self.model.compute_logits(hidden[logits_indices])
        return sampling, self.sampler(logits, sampling)
