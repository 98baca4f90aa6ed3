"""CUDA graphs of the decode-only forward pass, one per batch size of a ladder.

A decode step launches a few kernels per layer, each shorter than Python's launch cost, so the step is
captured once per batch size and replayed. The graphs read static buffers: a step copies its inputs (already
on the device, padded up to the next captured size with rows that write no KV (slot -1) and attend to
nothing (seq_len 0)) into them. Captured with max_seq_len = max_model_len so one graph serves every context
length.
"""
from __future__ import annotations

import math

import torch

from pagedllm.layers.attention import AttentionMetadata, set_forward_context

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs]
        if max_num_seqs not in self.sizes and max_num_seqs < CAPTURE_SIZES[-1]:
            self.sizes.append(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, math.ceil(max_model_len / block_size), dtype=torch.int32,
                                        device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs], decode_seq_lens=self.seq_lens[:bs],
            decode_max_seq_len=self.max_model_len, prefill_block_tables=None, prefill_seq_lens=None,
            prefill_query_start_loc=None, prefill_max_query_len=0, prefill_max_seq_len=0)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs reuse its memory pool.
        for bs in reversed(self.sizes):
            with set_forward_context(self._metadata(bs)):
                # A run outside the graph compiles every kernel for this shape before capture.
                self.model(self.input_ids[:bs], self.positions[:bs])
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        """The captured batch size a decode step of num_seqs sequences runs at (see fits)."""
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Hidden states of a decode-only step from its inputs on the device, already padded to a captured
        size."""
        bs = input_ids.shape[0]
        for static, new in ((self.input_ids, input_ids), (self.positions, positions),
                            (self.slot_mapping, slot_mapping), (self.seq_lens, seq_lens)):
            static[:bs].copy_(new)
        # Entries past a row's width are stale but never read: kernels stop at ceil(seq_len / block_size).
        self.block_tables[:bs, :block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs]
