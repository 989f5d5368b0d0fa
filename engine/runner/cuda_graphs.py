"""Decode steps as replayed CUDA graphs, one per batch-size bucket.

A decode-only step (every scheduled sequence computes one token and needs one logits row) of
``n`` sequences runs as the graph captured for the smallest bucket ``>= n``. The graph reads its
inputs from persistent device buffers (``DecodeBuffers``) that each step overwrites in place, so
nothing is allocated and no launch grid changes between replays: Triton bakes the Python ints it
is launched with into the captured launch, and every grid of the forward is a function of the
bucket (tokens = sequences = bucket, max_seqlen_q = 1, a block table as wide as the longest
context). Rows ``n..bucket-1`` are padding: slot -1 (``store_kv`` writes nothing for it), context
length 1, token 0; their logits are never sampled. Where the attention would split a small
batch's keys over the full block-table width, a bucket has a second graph over a narrower table,
replayed when every context fits it (``DecodeGraphs``).

Index regions of the buffers for a step of 3 sequences in the bucket of 4::

    input_ids, positions, slot_mapping, seq_lens   | s0 | s1 | s2 | pad |  (rows >= 4: unused)
    cu_seqlens_q                                   0    1    2    3     4   (constant: arange)
    block_tables                                   rows 0..2: each sequence's blocks, then stale
                                                   ids the kernel never reads (past its length)

Prefill, mixed and speculative-verification steps run eagerly: their token counts and query
lengths vary per step, so a graph per shape would be one per (tokens, max query length) pair,
and those steps are compute-bound, where launch overhead is a small share of the step.

``GraphCapture`` is how a forward becomes a replayable callable: ``CudaGraphCapture`` records a
CUDA graph (all buckets share one memory pool); ``EagerCapture`` calls the forward each time on
the same buffers (what the CPU tests use to check the buffer bookkeeping, padding included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from engine.mathutils import cdiv
from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.runner.inputs import ScheduledSeq
from engine.sampling.sampler import greedy_tokens
from kernels.paged_attention import SPLIT_MIN_CONTEXT, decode_num_splits

BATCHED_STAGING_ROWS = 32  # from this many sequences a step's inputs are staged with numpy (below: row by row)


class StepLogits(NamedTuple):
    """A step's logits rows and, from a decode graph, each row's greedy token computed on the
    device in the same replay (-1 for a row without a finite maximum; None from an eager step):
    a plain greedy batch then costs one device-to-host copy and no launch after the replay."""

    logits: torch.Tensor  # [rows, vocab]
    greedy: torch.Tensor | None = None  # [rows] int64


Replay = Callable[[], StepLogits]  # runs the captured step on what the buffers hold


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (and it, last)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return (*sizes, max_num_seqs)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` sequences; None when none does."""
    return next((size for size in sizes if size >= num_seqs), None)


def is_decode_only(seqs: Sequence[ScheduledSeq]) -> bool:
    return all(len(s.token_ids) == 1 and s.num_logits == 1 for s in seqs)


class DecodeBuffers:
    """The graphs' inputs: device tensors written in place each step, for up to ``max_seqs``
    sequences with block tables ``max_blocks`` wide, staged in (pinned, on CUDA) host memory and
    copied to the device in one non-blocking copy per tensor. The staging is written again only
    once the last step's copies have read it."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_seqs, self.max_blocks, self.block_size = max_seqs, max_blocks, block_size
        pin = device.type == "cuda"

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, torch.zeros(shape, dtype=dtype, device=device)

        self._input_ids = pair((max_seqs,), torch.int64)
        self._positions = pair((max_seqs,), torch.int64)
        self._slot_mapping = pair((max_seqs,), torch.int64)
        self._seq_lens = pair((max_seqs,), torch.int32)
        self._block_tables = pair((max_seqs, max_blocks), torch.int32)
        self._pairs = (self._input_ids, self._positions, self._slot_mapping, self._seq_lens)
        self.cu_seqlens_q = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self._pad(0, max_seqs)
        for host, dev in (*self._pairs, self._block_tables):
            dev.copy_(host)
        # numpy views of the host staging: the per-row writes below cost ~0.1 us each
        self._np = [host.numpy() for host, _ in self._pairs]
        self._np_tables = self._block_tables[0].numpy()
        # Block tables converted from Python ints once each: the engine hands a request the
        # same tuple until its table changes (``KVCacheManager.block_table``), and a batched
        # step gathers each table's row from here (``_table_rows_of``), where it converted
        # every id of every table each step (~5,000 for 256 rows: ~0.2 ms)
        self._table_rows = np.zeros((2 * max_seqs, max_blocks), dtype=np.int32)
        self._row_of: dict[int, tuple[Sequence[int], int]] = {}  # id(table) -> (table, its row)
        self._free_rows = list(range(2 * max_seqs - 1, -1, -1))
        # set when the last step's copies have read the staging (a chained step is staged while
        # the step before may not have reached its copies yet: async scheduling)
        self._staged = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) as padding: token 0 at position 0, nothing stored, context 1."""
        self._input_ids[0][start:stop] = 0
        self._positions[0][start:stop] = 0
        self._slot_mapping[0][start:stop] = -1
        self._seq_lens[0][start:stop] = 1

    def write(self, seqs: Sequence[ScheduledSeq], bucket: int, input_ids: torch.Tensor | None = None) -> int:
        """Stage one decode token per sequence and pad up to ``bucket`` rows; ValueError if a
        block table is too short or the step does not fit the buffers. ``input_ids`` (on the
        device) replace the first sequences' tokens. Returns the most blocks a sequence reads."""
        n = len(seqs)
        if not n <= bucket <= self.max_seqs:
            raise ValueError(f"{n} sequences in a bucket of {bucket}: at most {self.max_seqs}")
        if self._staged is not None:
            self._staged.synchronize()
        most = self._stage_rows(seqs) if n < BATCHED_STAGING_ROWS else self._stage_batch(seqs)
        self._pad(n, bucket)
        for host, dev in (*self._pairs, self._block_tables):
            dev[:bucket].copy_(host[:bucket], non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        if input_ids is not None:
            self._input_ids[1][:len(input_ids)].copy_(input_ids)
        return most

    def _too_short(self, i: int, seq: ScheduledSeq) -> ValueError:
        needed = seq.start_pos // self.block_size + 1
        return ValueError(f"sequence {i} needs {needed} blocks for {seq.start_pos + 1} tokens, its block "
                          f"table has {len(seq.block_ids)} (at most {self.max_blocks} fit)")

    def _stage_rows(self, seqs: Sequence[ScheduledSeq]) -> int:
        """``write``'s staging, row by row (a few rows: ~1 us each)."""
        bs, most = self.block_size, 1
        host_ids, positions, slot_mapping, seq_lens = self._np
        for i, s in enumerate(seqs):
            pos = s.start_pos
            needed = pos // bs + 1
            if len(s.block_ids) < needed or needed > self.max_blocks:
                raise self._too_short(i, s)
            host_ids[i] = s.token_ids[0]
            positions[i] = pos
            slot_mapping[i] = s.block_ids[pos // bs] * bs + pos % bs
            seq_lens[i] = pos + 1
            self._np_tables[i, :needed] = s.block_ids[:needed]
            most = max(most, needed)
        return most

    def _stage_batch(self, seqs: Sequence[ScheduledSeq]) -> int:
        """``write``'s staging as a dozen numpy operations over every row, the block tables
        gathered from their converted rows (``_table_rows_of``): a block table's row written
        from a list costs ~1.5 us, ~0.4 ms of a 256-row step row by row."""
        n, bs = len(seqs), self.block_size
        host_ids, positions, slot_mapping, seq_lens = self._np
        pos = np.fromiter([s.start_pos for s in seqs], np.int64, n)
        tables = [s.block_ids for s in seqs]
        lengths = np.fromiter(map(len, tables), np.int64, n)
        needed = pos // bs + 1
        bad = np.flatnonzero((lengths < needed) | (needed > self.max_blocks))
        if bad.size:
            raise self._too_short(int(bad[0]), seqs[int(bad[0])])
        rows = self._table_rows_of(tables)
        most = int(needed.max())
        host_ids[:n] = [s.token_ids[0] for s in seqs]
        positions[:n] = pos
        slot_mapping[:n] = self._table_rows[rows, needed - 1] * bs + pos % bs
        seq_lens[:n] = pos + 1
        # each row's first ``most`` columns: its table's first needed[i] ids, then what a
        # row of ``_table_rows`` held before (never read: attention reads needed[i] blocks)
        self._np_tables[:n, :most] = self._table_rows[rows, :most]
        return most

    def _table_rows_of(self, tables: Sequence[Sequence[int]]) -> np.ndarray:
        """The row of ``_table_rows`` holding each table's ids. A tuple seen in the step before
        keeps its row; any other table is converted into a free row. Rows of tuples this step
        does not have are freed; a list (mutable: it may change in place) is converted every
        time, into a row freed at once."""
        # keyed by id(): each entry holds its table, so no id is reused while it is there
        old, new = self._row_of, {}
        rows = [-1] * len(tables)
        misses = []
        for i, table in enumerate(tables):
            hit = old.get(id(table))
            if hit is not None:
                new[id(table)] = hit
                rows[i] = hit[1]
            else:
                misses.append(i)
        free = self._free_rows
        free.extend(row for key, (_, row) in old.items() if key not in new)
        scratch = []
        for i in misses:
            table = tables[i]
            hit = new.get(id(table))
            if hit is None:  # (a tuple twice in one step converts once)
                row = free.pop()
                width = min(len(table), self.max_blocks)
                self._table_rows[row, :width] = table[:width]
                hit = (table, row)
                if type(table) is tuple:
                    new[id(table)] = hit
                else:
                    scratch.append(row)
            rows[i] = hit[1]
        free.extend(scratch)
        self._row_of = new
        return np.array(rows, dtype=np.int64)

    def inputs(self, bucket: int, num_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                          AttentionMetadata]:
        """(input_ids, positions, attention metadata): views of the first ``bucket`` rows, the
        block tables' first ``num_blocks`` columns (None: all)."""
        attn = AttentionMetadata(slot_mapping=self._slot_mapping[1][:bucket],
                                 block_tables=self._block_tables[1][:bucket, :num_blocks],
                                 seq_lens=self._seq_lens[1][:bucket],
                                 cu_seqlens_q=self.cu_seqlens_q[:bucket + 1], max_seqlen_q=1)
        return self._input_ids[1][:bucket], self._positions[1][:bucket], attn


class GraphCapture(Protocol):
    def capture(self, step: Replay) -> Replay:
        """A callable that runs ``step`` again on whatever its buffers then hold."""


class EagerCapture:
    """Runs the step each time (no graph): the CPU stand-in for the bookkeeping tests."""

    def capture(self, step: Replay) -> Replay:
        return step


class CudaGraphCapture:
    """Records each step as a CUDA graph; all of them allocate from one memory pool (the graphs
    never run at the same time: each replay's output is read before the next replay)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Replay) -> Replay:
        step()  # compile every Triton kernel of the step outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> StepLogits:
            graph.replay()
            return out
        return replay


class DecodeGraphs:
    """One replayable decode step per bucket over ``model`` and ``kv_cache``, and a second one
    for short contexts where the first splits the keys.

    A graph's attention grid is fixed at capture, from the block table's width: over the full
    width (``max_model_len``), a small batch splits each sequence's keys into equal spans of
    that width, one program each, and merges them in a second kernel
    (``kernels.paged_attention``), which pays over a long context. A context within the first
    span is read by one program either way, the others exit at once: a step whose sequences all
    fit one span (at most ``short_blocks``, and fewer token slots than
    ``paged_attention.SPLIT_MIN_CONTEXT``, where the attention never splits) replays the
    bucket's short graph instead, captured over that many columns: unsplit, the same reads, one
    launch fewer per layer. ``short_graphs``: None captures them where the full graph splits
    (on CUDA), True everywhere (the tests, with a small ``short_blocks``), False nowhere."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, max_num_seqs: int,
                 max_model_len: int, block_size: int, capture: GraphCapture,
                 short_graphs: bool | None = None, short_blocks: int | None = None) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(max_num_seqs, cdiv(max_model_len, block_size), block_size,
                                     kv_cache.device)
        if short_blocks is None:
            short_blocks = (SPLIT_MIN_CONTEXT - 1) // block_size
        self.short_blocks = min(self.buffers.max_blocks, short_blocks)
        self._short_graphs = short_graphs
        self._capture = capture
        self._replays: dict[int, Replay] = {}
        self._short: dict[int, tuple[int, Replay]] = {}  # bucket -> (its width in blocks, its step)
        self.capture_seconds = 0.0

    @property
    def short_sizes(self) -> dict[int, int]:
        """Each bucket with a short-context graph: how many blocks its contexts may span."""
        return {bucket: blocks for bucket, (blocks, _) in sorted(self._short.items())}

    def capture_all(self) -> float:
        """Capture every bucket, largest first (the pool then serves the smaller ones from the
        memory the largest reserved). Returns the seconds it took."""
        started = time.perf_counter()
        for bucket in reversed(self.sizes):
            self._replays[bucket] = self._capture.capture(self._step(bucket))
            blocks = self._short_width(bucket)
            if blocks:
                self._short[bucket] = (blocks, self._capture.capture(self._step(bucket, blocks)))
        self.capture_seconds = time.perf_counter() - started
        return self.capture_seconds

    def _short_width(self, bucket: int) -> int:
        """The blocks of ``bucket``'s short graph: its full graph's span per key split (at most
        ``short_blocks``); 0: none (the full graph does not split)."""
        full = self.buffers.max_blocks
        if self.short_blocks >= full or self._short_graphs is False:
            return 0
        if self._short_graphs:
            return self.short_blocks
        splits = decode_num_splits(self.kv_cache.device, bucket, self.model.config.num_kv_heads,
                                   full * self.buffers.block_size)
        return min(self.short_blocks, full // splits) if splits > 1 else 0

    def _step(self, bucket: int, num_blocks: int | None = None) -> Replay:
        input_ids, positions, attn = self.buffers.inputs(bucket, num_blocks)

        def step() -> StepLogits:
            hidden = self.model.forward(input_ids, positions, attn, self.kv_cache)
            logits = self.model.compute_logits(hidden)
            return StepLogits(logits, greedy_tokens(logits))
        return step

    def can_run(self, seqs: Sequence[ScheduledSeq]) -> bool:
        return bool(seqs) and len(seqs) <= self.sizes[-1] and is_decode_only(seqs)

    def run(self, seqs: Sequence[ScheduledSeq], input_ids: torch.Tensor | None = None) -> StepLogits:
        """The logits [len(seqs), vocab] and greedy tokens of one decode step (views into the
        graph's output: read them before the next ``run``, on the device or the host).
        ``input_ids``: the step's tokens already on the device (``DecodeBuffers.write``)."""
        bucket = bucket_for(len(seqs), self.sizes)
        assert bucket is not None, "run() needs can_run(seqs)"
        most_blocks = self.buffers.write(seqs, bucket, input_ids)
        blocks, short = self._short.get(bucket, (0, None))
        logits, greedy = (short if short is not None and most_blocks <= blocks else self._replays[bucket])()
        assert greedy is not None
        return StepLogits(logits[:len(seqs)], greedy[:len(seqs)])


class NoDecodeGraphs:
    """Graphs off (a CPU, or ``--enforce-eager``): every step runs eagerly."""

    sizes: tuple[int, ...] = ()
    capture_seconds = 0.0

    def capture_all(self) -> float:
        return 0.0

    def can_run(self, seqs: Sequence[ScheduledSeq]) -> bool:
        return False

    def run(self, seqs: Sequence[ScheduledSeq], input_ids: torch.Tensor | None = None) -> StepLogits:
        raise RuntimeError("decode graphs are off")
