"""CUDA graphs of the forward pass (vLLM's cudagraph modes "full_decode_only" and "piecewise" together).

A step launches ~10 kernels per layer and Python spends longer launching most of them than the GPU spends
running them, so steps replay captured graphs instead:

- DecodeGraphs: decode-only steps, the whole forward pass in one graph per batch size of a ladder. The step's
  arrays, padded up to the next captured size with rows that write no KV (slot -1) and attend to nothing
  (seq_len 0), are sent from the host straight into the graph's static buffers. A graph planned for
  max_seq_len = L serves every step whose sequences are at most L long. Large batches are captured at
  L = max_model_len; small ones (up to SPLIT_MAX_BATCH) split each sequence's context across the GPU by a plan
  that depends on L, so they are captured at a ladder of context bounds and a step replays the smallest that
  holds it.
- PiecewiseGraphs: any other step (prefills, mixed batches) up to PIECEWISE_MAX_TOKENS, one graph per layer
  boundary per token count of a ladder: everything but the attention kernels, whose launch grids depend on
  the step's sequences, is captured; attention runs eagerly between the replays. A step is padded up to the
  next captured token count with tokens that write no KV (slot -1); attention sees only the real tokens.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from pagedllm.layers.attention import Attention, AttentionMetadata, set_forward_context
from pagedllm.layers.norm import fused_kernels
from pagedllm.layers.sampler import greedy_tokens
from pagedllm.worker.buffers import HostRing, UploadRing, packed_size, packed_views, write_packed, zero_copy

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Token counts of the piecewise graphs: doubling while a step is small enough that padding costs little, then
# every 1024 (a step pads by at most 1023 tokens). Bigger steps run eagerly: their GPU work outlasts the
# launches.
PIECEWISE_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
PIECEWISE_MAX_TOKENS = PIECEWISE_SIZES[-1]
# Decode batches up to this size leave SMs idle with one attention program per (sequence, kv head) and split
# the context (benchmarks/results/README.md: 8 sequences of 1.2-2K tokens take 40 us a layer planned for 4096
# tokens, 28 us planned for 2048). Their graphs are captured at max_model_len and at every power of two below
# it from about an eighth of it, or from MIN_CONTEXT_BOUND where that is lower: a step's plan is then at most
# twice its longest sequence (past the lowest bound) whatever max_model_len is. Three halves left a 40960-token
# model's short steps planned for 5120, where the batch-1 decoder-layer kernel also takes its slower wide tiles.
SPLIT_MAX_BATCH = 32
MIN_CONTEXT_BOUND = 512
# Decode graphs of up to this many rows also run the LM head and the greedy argmax, into buffers all of them
# share. Launched eagerly, those three Triton kernels cost the host 0.12-0.19 ms a step on the H100's machine,
# which made the batch-1 step host-bound: 0.76-0.84 ms a step against 0.71-0.72 ms of GPU work (benchmarks/
# results/README.md, twenty-seventh session). Larger batches' steps take milliseconds of GPU work.
HEAD_MAX_BATCH = 32
# With zero-copy transfers (buffers.zero_copy) the argmax also writes the ids into one of this many pinned rows
# (HostRing), the one the step uploaded: the host reads them there, without a copy kernel after the graph. The engine
# reads a step's samples one step later, so two would do; a third is a margin.
SAMPLE_SLOTS = 3
# A graph whose inputs fit the zero-copy upload kernel in one pass (transfer.MAX_WORDS) uploads them itself, from
# one of this many pinned slots (UploadRing), the host filling the next while earlier steps run. Launched before the
# graph, the upload left a gap before the graph's first kernel, which could not start early beside it.
UPLOAD_SLOTS = 3
# Steps of one sequence whose rows all take the plain argmax get a graph of their own that screens the LM head on an
# int8 copy (ops.triton.greedy_head, V x K bytes more memory) instead of computing every logit. PAGEDLLM_GREEDY_SCREEN=0
# keeps the head as it is (benchmarks/results/README.md's A/B).
SCREEN_ENV_VAR = "PAGEDLLM_GREEDY_SCREEN"


class _Ladder:
    """The captured sizes, ascending; a step runs at the smallest one that holds it."""
    sizes: list[int]

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)


class DecodeGraphs(_Ladder):
    def __init__(self, model: torch.nn.Module, device: torch.device, max_num_seqs: int, max_model_len: int,
                 block_size: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs]
        if max_num_seqs not in self.sizes and max_num_seqs < CAPTURE_SIZES[-1]:
            self.sizes.append(max_num_seqs)
        # Each size's static inputs lie packed at the start of one buffer, so that a step's arrays reach them in
        # one copy from the host (ModelRunner._upload); the sizes' layouts overlap, as one graph runs at a time.
        specs = {bs: _input_specs(bs, math.ceil(max_model_len / block_size)) for bs in self.sizes}
        self.buffer = torch.zeros(max(packed_size(s.values()) for s in specs.values()), dtype=torch.uint8,
                                  device=device)
        self.inputs = {bs: dict(zip(spec, packed_views(self.buffer, spec.values()))) for bs, spec in specs.items()}
        self.nbytes = {bs: packed_size(spec.values()) for bs, spec in specs.items()}
        self.transfer = zero_copy(device)
        # the sizes whose graphs upload their own inputs (uploads_inputs)
        self.staged = {bs for bs, n in self.nbytes.items() if self.transfer is not None and self.transfer.fits(n)}
        self.ring = (UploadRing(device, UPLOAD_SLOTS, max(self.nbytes[bs] for bs in self.staged)) if self.staged
                     else None)
        # the previous step's samples, where the graphs that upload their inputs gather the placeholder ids from;
        # the greedy ids of the graphs with the head are its first rows
        self.sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        lowest = min(MIN_CONTEXT_BOUND, 1 << max(0, (max_model_len // 8).bit_length() - 1))
        self.context_bounds = _powers_of_two(lowest, max_model_len) + [max_model_len]
        # (batch size, context bound, screened) -> graph and its output
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.screen = None  # the LM head's int8 screen (built at capture, _screened_head)
        # the head's logits and greedy ids of the graphs of up to HEAD_MAX_BATCH rows (allocated at capture), and
        # where the Triton argmax also writes the ids on the host
        self.logits: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None
        self.greedy_host: HostRing | None = None

    def bounds_of(self, bs: int) -> list[int]:
        return self.context_bounds if bs <= SPLIT_MAX_BATCH else [self.max_model_len]

    def _metadata(self, bs: int, bound: int) -> AttentionMetadata:
        inputs = self.inputs[bs]
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"], num_decode_tokens=bs,
            decode_block_tables=inputs["decode_block_tables"], decode_seq_lens=inputs["decode_seq_lens"],
            decode_max_seq_len=bound, prefill_block_tables=None, prefill_seq_lens=None,
            prefill_query_start_loc=None, prefill_max_query_len=0, prefill_max_seq_len=0)

    def uploads_inputs(self, bs: int) -> bool:
        """Whether the graphs of bs rows upload their inputs themselves (from stage()), else they are to be in
        self.inputs[bs] before run()."""
        return bs in self.staged

    def stage(self, bs: int, arrays: dict[str, np.ndarray], sampled: torch.Tensor | None) -> None:
        """For graphs that uploads_inputs(bs): writes a step's arrays (self.inputs[bs]'s names) where the next run()
        uploads them, placeholders [2, k] padded to bs columns; sampled: the previous step's samples, which the
        placeholders index (None where k = 0)."""
        placeholders = np.full((2, bs), -1, dtype=np.int64)
        placeholders[:, :arrays["placeholders"].shape[1]] = arrays["placeholders"]
        views = self.inputs[bs]
        write_packed(self.ring.slot(), self.buffer, views.values(),
                     [placeholders if name == "placeholders" else arrays[name] for name in views])
        if sampled is not None and sampled.data_ptr() != self.sampled.data_ptr():
            self.sampled[:len(sampled)].copy_(sampled)

    def _pad(self, bs: int) -> None:
        """Sets the inputs of size bs to a step of padding rows only (slot -1, seq_len 0, no placeholders), which
        writes nothing, where the next run uploads them from."""
        self.buffer.zero_()
        self.inputs[bs]["slot_mapping"].fill_(-1)
        self.inputs[bs]["placeholders"].fill_(-1)
        if self.uploads_inputs(bs):
            self.ring.slot()[:self.nbytes[bs]].copy_(self.buffer[:self.nbytes[bs]])

    def _ran(self, bs: int) -> None:
        if self.uploads_inputs(bs):
            self.ring.commit()

    @torch.inference_mode()
    def capture(self) -> None:
        self.screen = _screened_head(self.model)
        pool = None
        # Largest first, so the smaller graphs reuse its memory pool.
        for bs in reversed(self.sizes):
            inputs = self.inputs[bs]
            for bound in reversed(self.bounds_of(bs)):
                for screened in (False, True) if self.screen is not None and bs == 1 else (False,):
                    self._pad(bs)
                    with set_forward_context(self._metadata(bs, bound)):
                        # A run outside the graph compiles every kernel for this shape before capture.
                        self._forward(bs, inputs, screened)
                        self._ran(bs)
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            self.outputs[bs, bound, screened] = self._forward(bs, inputs, screened)
                    pool = graph.pool()
                    self.graphs[bs, bound, screened] = graph
        # A graph's first launch uploads it to the device (0.3 ms of host time on the H100, benchmarks/
        # engine_probe.py graph-launch), which would land on the first step of each shape mid-run. These
        # replays of padding write nothing.
        for (bs, _, _), graph in self.graphs.items():
            self._pad(bs)
            graph.replay()
            self._ran(bs)
        torch.cuda.synchronize()

    def _forward(self, bs: int, inputs: dict[str, torch.Tensor], screened: bool = False) -> torch.Tensor:
        if self.uploads_inputs(bs):
            self.transfer.upload_from_ring(self.ring.host, self.ring.counter, self.buffer[:self.nbytes[bs]],
                                           inputs["placeholders"], self.sampled, inputs["input_ids"])
        hidden = self.model(inputs["input_ids"], inputs["positions"])
        if bs <= HEAD_MAX_BATCH:
            if self.logits is None:  # at the first capture's warm-up run
                logits = self.model.compute_logits(hidden)
                rows = max(s for s in self.sizes if s <= HEAD_MAX_BATCH)
                self.logits = torch.empty(rows, logits.shape[1], dtype=logits.dtype, device=logits.device)
                self.greedy = self.sampled[:rows]
                if fused_kernels(logits) is not None and zero_copy(logits.device) is not None:
                    self.greedy_host = HostRing(SAMPLE_SLOTS, rows)
            host = () if self.greedy_host is None else (self.greedy_host.rows, inputs["sample_slot"])
            if screened:
                self.screen.greedy(hidden, self.greedy[:bs], *host)
                return hidden
            logits = self.model.compute_logits(hidden, self.logits[:bs])
            if self.greedy_host is None:
                greedy_tokens(logits, self.greedy[:bs])
            else:
                fused_kernels(logits).argmax(logits, self.greedy[:bs], *host)
        return hidden

    def take_sample_slot(self, bs: int) -> tuple[HostRing, int] | None:
        """The HostRing slot a step of the graphs of bs rows is to upload as its sample_slot, where their argmax
        writes the ids on the host too (SamplerOutput's ring_slot)."""
        if self.greedy_host is None or not self.has_head(bs):
            return None
        return self.greedy_host, self.greedy_host.take()

    def has_head(self, bs: int) -> bool:
        """Whether the graphs of bs rows compute the logits and greedy ids (HEAD_MAX_BATCH)."""
        return self.logits is not None and bs <= HEAD_MAX_BATCH

    def has_screen(self, bs: int) -> bool:
        """Whether bs rows have graphs that compute the greedy ids by the screened head, and no logits."""
        return self.screen is not None and bs == 1

    def run(self, bs: int, max_seq_len: int, screened: bool = False) -> torch.Tensor:
        """Hidden states [bs, hidden] of a decode-only step padded to the captured size bs, whose arrays are in
        self.inputs[bs] or, where uploads_inputs(bs), staged (stage()); max_seq_len: its longest sequence;
        screened: by the graph of the screened head (has_screen). Valid until the next run(), as are, where
        has_head(bs), the first bs rows of self.greedy and, unless screened, of self.logits."""
        key = bs, next(b for b in self.bounds_of(bs) if b >= max_seq_len), screened
        self.graphs[key].replay()
        self._ran(bs)
        return self.outputs[key]


def _screen_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The LM head weight the decode graphs screen for greedy steps of one sequence (DecodeGraphs.screen): the
    model's, where the fused kernels run it, SCREEN_ENV_VAR does not switch the screen off and ScreenedHead takes
    its shape and dtype; else None."""
    weight = model.head_weight()
    if (fused_kernels(weight) is None
            or os.environ.get(SCREEN_ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no")):
        return None
    from pagedllm.ops.triton.greedy_head import ScreenedHead
    return weight if ScreenedHead.supported(weight[:1], weight) else None


def _screened_head(model: torch.nn.Module):
    weight = _screen_weight(model)
    if weight is None:
        return None
    from pagedllm.ops.triton.greedy_head import ScreenedHead
    return ScreenedHead(weight)


def screen_bytes(model: torch.nn.Module) -> int:
    """Device memory the decode graphs' screen of the model's LM head takes (greedy_head.ScreenedHead), 0 where
    they build none."""
    weight = _screen_weight(model)
    return 0 if weight is None else weight.shape[0] * weight.shape[1] + 12 * weight.shape[0]


def _powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... below high."""
    out = []
    while low < high:
        out.append(low)
        low *= 2
    return out


def _input_specs(bs: int, width: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A decode step's arrays (StepInputs' names) in the order of the packed static buffers: the graph's inputs
    (sample_slot: the HostRing row its argmax writes), and placeholders and logits_indices, which the runner uses
    beside the graph, sent in the same copy.

    The block table comes last, its rows as wide as max_model_len's blocks. A step's narrower table fills the
    start of each row and the copy ends after its last row's blocks, so it carries nearly the whole table (4 * B *
    max_model_len / block_size bytes for B rows: 256 KiB at 256 rows of 4096 tokens, 2.5 MiB of 40960), the
    entries past the step's blocks holding whatever the host buffer held. Kernels never read those: they stop at
    ceil(seq_len / block_size)."""
    return {"input_ids": (torch.int64, (bs,)), "sample_slot": (torch.int64, (1,)),
            "positions": (torch.int64, (bs,)), "slot_mapping": (torch.int64, (bs,)),
            "placeholders": (torch.int64, (2, bs)), "logits_indices": (torch.int64, (bs,)),
            "decode_seq_lens": (torch.int32, (bs,)), "decode_block_tables": (torch.int32, (bs, width))}


class PiecewiseGraphs(_Ladder):
    """Graphs of everything between the attention kernels, for steps of up to max_tokens tokens (at most
    PIECEWISE_MAX_TOKENS).

    Per captured token count there are num_layers + 1 graphs; graph i ends where layer i's attention would
    run, after its q/k/v projection and the cache write, which leaves the rotated q in a static buffer; graph
    i + 1 starts by reading the attention output from another static buffer. All graphs share one memory
    pool: the graphs of one size replay in capture order and two sizes never interleave, so a graph may reuse
    memory another has finished with. That includes a smaller size's output, which the next step's graphs
    may overwrite: run()'s result must be consumed (on the same stream) before the next run().
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int, num_heads: int,
                 head_size: int, dtype: torch.dtype) -> None:
        self.model = model
        max_tokens = min(max_tokens, PIECEWISE_MAX_TOKENS)
        self.sizes = [s for s in PIECEWISE_SIZES if s < max_tokens] + [max_tokens]
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, num_heads, head_size, dtype=dtype, device=device)
        self.out = torch.zeros(n, num_heads, head_size, dtype=dtype, device=device)
        self.layers: list[Attention] = []  # in the order the forward pass reaches them
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self._num_tokens = 0  # of the size being captured
        self._pool = None

    def split(self, layer: Attention) -> torch.Tensor:
        """Called by each layer while capturing, its q already in self.q: the graph ends here."""
        if self._capturing is not None:
            self._end_graph()
            self._begin_graph()
        elif not self.graphs:  # the first warm-up run
            self.layers.append(layer)
        return self.out[:self._num_tokens].view(self._num_tokens, -1)

    def _begin_graph(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._capturing.append(graph)

    def _end_graph(self) -> None:
        self._capturing[-1].capture_end()

    @torch.inference_mode()
    def capture(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], num_decode_tokens=0, decode_block_tables=None,
                decode_seq_lens=None, decode_max_seq_len=0, prefill_block_tables=None, prefill_seq_lens=None,
                prefill_query_start_loc=None, prefill_max_query_len=0, prefill_max_seq_len=0,
                graph_split=self)
            self._num_tokens = size
            with set_forward_context(meta):
                # A run outside the graphs compiles every kernel for this shape (the first also lists the layers).
                self.model(self.input_ids[:size], self.positions[:size])
                torch.cuda.synchronize()
                self._capturing = []
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._begin_graph()
                    self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size])
                    self._end_graph()
                torch.cuda.current_stream().wait_stream(stream)
            if len(self._capturing) != len(self.layers) + 1:
                raise RuntimeError(f"piecewise capture found {len(self._capturing) - 1} attention layers, "
                                   f"expected {len(self.layers)}")
            self.graphs[size], self._capturing = self._capturing, None
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of a step of T <= max_tokens tokens from its inputs on the device; valid
        until the next run()."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        # A larger step left real slots here: padding must not write its garbage K/V over them.
        self.slot_mapping[n:size].fill_(-1)
        graphs = self.graphs[size]
        q, out = self.q[:n], self.out[:n]
        for graph, layer in zip(graphs, self.layers):
            graph.replay()
            layer.attend(meta, q, out)
        graphs[-1].replay()
        return self.outputs[size][:n]
