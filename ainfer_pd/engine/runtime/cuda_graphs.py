"""Decode by CUDA-graph replay over (batch, context) buckets.

Each graph binds static, phase-owned inputs (token ids, positions, KV write slots, block
tables, context lengths) and writes static logits; the engine copies a decode batch into
the smallest bucket that fits, pads the rest with rows that write into a scratch KV
slot, and replays. The same graph replays whether P is active or not: P never touches
these buffers (SPEC 3.5).

A speculating runner (``RunnerSections.verify_width`` > 1) holds two sets over the same buckets: the
plain graphs, whose paged decode kernel attends each row alone, and the verify graphs, whose kernel
reads a turn's keys once for its 1 + k rows (``DecodeMeta.lead_off``). A plain pass replays the first,
so speculation's wider kernel (2-5% of a plain pass's attention time, H100) costs the passes that do
not verify nothing; the sets share one memory pool, and the plain set stops at the first batch size
that holds ``max_decode_batch`` rows (a plain pass has no more).

Context lengths are data, not shapes: a graph's block table is as wide as its context tier
and the decode kernels read each row's own length, with the split-KV layout sized at capture
for the tier's longest row (``attention.plan.MAX_DECODE_SPLITS`` caps it). The top tier is the
model's whole ``max_context_len`` by default, so no row falls off the graphs into the eager,
host-bound path; the lower tiers only spare short batches the grid of the longest rows.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from typing import Any, Iterator

import torch
from torch import Tensor

from ..attention import DecodeMeta, ForwardBatch

log = logging.getLogger("ainfer_pd.cuda_graphs")

CAPTURE_MODE = "thread_local"
"""The ``capture_error_mode`` of every CUDA-graph capture (``torch.cuda.graph``) in the library and
its benchmarks. Graphs are captured on a stream's launcher thread (:mod:`.streams`) while other
threads (the event loop, the other phase's launcher, the CUDA-event waiters) may make CUDA calls;
in torch's default ``"global"`` mode any such call from another thread invalidates the capture
(``cudaErrorStreamCaptureInvalidated``: a P-graph capture at the GPU gate). ``"thread_local"``
refuses only the capturing thread's own unsafe calls."""


def phase_capture(fn, stream: torch.cuda.Stream, pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(the CUDA graph of ``fn`` captured on ``stream``, ``fn``'s output). ``stream`` is the CUDA
    stream of the phase the graph belongs to, never a stream another phase's graphs were captured on.

    A captured cuBLAS GEMM keeps the workspace it was captured with, and torch keys that workspace by
    (thread's cuBLAS handle, current stream). Captured on torch's one default capture stream from one
    thread, the D graphs and the P graphs held the *same* workspace; replayed at once on the two
    phases' streams, a split-K GEMM of one overwrote the other's semaphores and spun for ever (the GPU
    gate's overlap and FP8 fine-grained hangs: one ``nvjet_sm90_tst`` kernel resident on all 132 SMs at
    100% utilisation, no other kernel; gone with a zero workspace). Captured on its phase's stream,
    every user of a workspace runs on that stream (or a lane FIFO-ordered with it): phase-owned state,
    as SPEC 3.5 asks of the communication buffers."""
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
        out = fn()
    return g, out


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """The captures of one graph set: cyclic garbage collected once before, the collector off until
    the last one ends. A collection that starts inside a capture, on the capturing thread, may free
    another worker's graphs (released, their runner <-> graphs cycle still to be found): destroying
    a CUDA graph is an unsafe call during capture, which invalidates it (the GPU gate's cuda_smoke:
    26 ``CUDAGraph::reset`` refused, then ``cudaErrorStreamCaptureInvalidated`` in a P-graph capture)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_buckets(batch_sizes: tuple[int, ...], max_decode_batch: int, context_tiers: tuple[int, ...],
                  graph_max_context: int, max_context_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(batch sizes, context buckets) to capture. The context buckets are the tiers below the
    covered context and the covered context itself: ``graph_max_context`` when set (> 0), else
    the model's ``max_context_len`` (the default: every row can replay)."""
    cover = min(graph_max_context, max_context_len) if graph_max_context > 0 else max_context_len
    ctxs = tuple(sorted({t for t in context_tiers if 0 < t < cover} | {cover}))
    sizes = tuple(b for b in batch_sizes if b <= max_decode_batch) or (1,)
    return sizes, ctxs


class DecodeGraphs:
    def __init__(self, runner, batch_sizes: tuple[int, ...], ctx_buckets: tuple[int, ...], scratch_slot: int,
                 ctx, stream: torch.cuda.Stream) -> None:
        self.runner = runner
        self.ctx = ctx                 # the D PhaseContext the graphs belong to
        self.stream = stream
        """The D phase's own CUDA stream: every graph is warmed up and captured on it
        (:func:`phase_capture`)."""
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.ctx_buckets = tuple(sorted(ctx_buckets))
        self.scratch = scratch_slot
        self.block_size = runner.kv.block_size
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        """The plain passes' graphs by (batch, context) bucket."""
        self.verify_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        """A speculating runner's verify passes' graphs (turn groups of ``verify_width`` rows); empty otherwise."""
        self.width = runner.sections.verify_width
        self.pool = None
        self.num_replays = 0
        self.num_verify_replays = 0
        """Of ``num_replays``, those of a verify graph."""
        self.capture_s = 0.0
        self.memory_bytes = 0
        """Device memory the capture took (the graphs' pool and static buffers)."""

    @property
    def max_context(self) -> int:
        return self.ctx_buckets[-1]

    def capture_all(self) -> None:
        """Capture largest first so smaller graphs reuse the memory pool."""
        import time
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        mem0, t0 = torch.cuda.memory_reserved(dev), time.perf_counter()
        plain = self.plain_batch_sizes()
        with capture_session():
            for B in reversed(self.batch_sizes):
                for L in reversed(self.ctx_buckets):
                    if self.width > 1:
                        self._capture(B, L, dev, verify=True)
                    if B in plain:
                        self._capture(B, L, dev)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved(dev) - mem0
        log.info("captured %d decode graphs (batch %s x context %s; %d for verify passes) in %.1f s, %.0f MiB",
                 len(self.graphs), list(plain), list(self.ctx_buckets), len(self.verify_graphs), self.capture_s,
                 self.memory_bytes / 2**20)

    def plain_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes of the plain graphs: every size while no pass verifies, else those up to the
        first that holds ``max_decode_batch`` rows (the verify passes' 1 + k rows a turn need the rest)."""
        if self.width == 1:
            return self.batch_sizes
        i = bisect.bisect_left(self.batch_sizes, self.runner.sections.scheduler.max_decode_batch)
        return self.batch_sizes[:i + 1]

    def _static(self, B: int, L: int, dev) -> dict[str, Tensor]:
        return {
            "ids": torch.zeros(B, dtype=torch.int64, device=dev),
            "pos": torch.zeros(B, dtype=torch.int64, device=dev),
            "write": torch.full((B,), self.scratch, dtype=torch.int64, device=dev),
            "table": torch.zeros(B, -(-L // self.block_size), dtype=torch.int64, device=dev),
            "lens": torch.ones(B, dtype=torch.int64, device=dev),
            "rows": torch.arange(B, dtype=torch.int64, device=dev),
            "lead": torch.zeros(B, dtype=torch.int64, device=dev),
        }

    def _fb(self, s: dict[str, Tensor], verify: bool = False) -> ForwardBatch:
        """The static batch of a plain graph, or (``verify``) of a verify graph: its rows in turn groups."""
        meta = DecodeMeta(None, s["lens"], block_table=s["table"], block_size=self.block_size,
                          lead_off=s["lead"] if verify else None, group_width=self.width if verify else 1)
        return ForwardBatch(s["ids"], s["pos"], s["write"], [], meta, s["rows"], block_size=self.block_size,
                            padded=True)                  # rows past a replay's batch: padding

    def _capture(self, B: int, L: int, dev, verify: bool = False) -> None:
        s = self._static(B, L, dev)
        fb = self._fb(s, verify)
        g, out = self._record(lambda: self._run(fb, s), dev)
        (self.verify_graphs if verify else self.graphs)[(B, L)] = (g, s, out)

    def _record(self, fn, dev):
        """(the CUDA graph of ``fn``, its static outputs): ``fn`` warmed up twice (Triton compiles,
        cuBLAS picks), then captured into the graphs' shared pool, both on the phase's stream."""
        self.stream.wait_stream(torch.cuda.current_stream(dev))     # the static inputs are written
        with torch.cuda.stream(self.stream), torch.inference_mode():
            for _ in range(2):                       # warm up outside the graph
                fn()
        g, out = phase_capture(fn, self.stream, self.pool)
        torch.cuda.current_stream(dev).wait_stream(self.stream)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def _run(self, fb: ForwardBatch, s: dict[str, Tensor]):
        """What a graph captures: one D pass over its static batch -> logits [B, V]."""
        return self.runner.forward_fb(fb, self.ctx)

    def release(self) -> None:
        """Drop every graph, its static buffers and the shared memory pool (and the runner
        reference: runner <-> graphs is a cycle the collector would otherwise have to find)."""
        self.graphs.clear()
        self.verify_graphs.clear()
        self.pool = None
        self.runner = None

    def bucket(self, B: int, L: int) -> tuple[int, int] | None:
        """The (batch, context) bucket of B rows of at most L keys; None past the largest."""
        i = bisect.bisect_left(self.batch_sizes, B)
        j = bisect.bisect_left(self.ctx_buckets, L)
        if i == len(self.batch_sizes) or j == len(self.ctx_buckets):
            return None
        return self.batch_sizes[i], self.ctx_buckets[j]

    def try_run(self, fb: ForwardBatch, *extra) -> Tensor | None:
        """Replay the bucket that fits ``fb`` (decode rows only; a verify pass's in the verify set where
        there is one); None if none fits. ``extra``: what a subclass's graphs take beside the batch
        (:meth:`_fill`, :meth:`_result`)."""
        d = fb.decode
        if d is None or fb.prefill:
            return None
        if d.block_table is None:
            return None
        B, nb = d.block_table.shape
        key = self.bucket(B, nb * self.block_size)
        graphs = self.verify_graphs if d.lead_off is not None and self.verify_graphs else self.graphs
        if key is None or key not in graphs:
            return None
        g, s, out = graphs[key]
        self._fill(s, fb, *extra)
        g.replay()
        self.num_replays += 1
        self.num_verify_replays += graphs is self.verify_graphs
        return self._result(out, B, *extra)

    def _fill(self, s: dict[str, Tensor], fb: ForwardBatch, *extra) -> None:
        """The static inputs of a replay: ``fb``'s B rows, the rest padding (scratch slot, block 0,
        one key, a row alone)."""
        d = fb.decode
        B, nb = d.block_table.shape
        s["ids"][:B].copy_(fb.input_ids)
        s["pos"][:B].copy_(fb.positions)
        s["write"][:B].copy_(fb.write_slots)
        s["write"][B:].fill_(self.scratch)
        s["table"][:B, :nb].copy_(d.block_table)
        s["table"][:B, nb:].zero_()
        s["table"][B:].zero_()                # padded rows: block 0, masked beyond their 1 key
        s["lens"][:B].copy_(d.ctx_lens)
        s["lens"][B:].fill_(1)
        if d.lead_off is not None:           # a verify pass: its turns' row groups; padding rows alone
            s["lead"][:B].copy_(d.lead_off)  # (a plain graph's kernel never reads "lead": nothing to reset)
            s["lead"][B:].zero_()

    def _result(self, out, B: int, *extra) -> Tensor:
        """The replay's logits of the batch's B rows (a copy: the next replay overwrites ``out``)."""
        return out[:B].clone()
