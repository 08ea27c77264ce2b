"""P passes by piecewise CUDA-graph replay at token buckets (a P epoch's launches off the host).

An eager P pass of the Qwen3-30B-A3B shape launches ~9 Triton kernels and a few GEMMs per layer:
~0.6 ms of host time a layer, so a short continuation's epoch was set by its launches (29 ms of
host for 17 ms of GPU work at 512 new tokens, H200). Here each piece of a layer that has fixed
shapes for a padded token count is one captured graph, and only the varlen attention runs eagerly,
as vLLM captures prefill piecewise:

    embed:        E    = graph [embedding, RoPE cos / sin]
    attn<l>:      A_l  = graph [norm, QKV GEMM, QK-norm + RoPE + K/V write]  -> q (and the roped K, V)
                  attention (eager, varlen: the sequences' own metadata)    -> o
                  B_l  = graph [O GEMM, residual + norm, router]             -> h, xn, routing
    experts<l>:   C_l  = graph [routed + shared experts, residual]           -> h
    head:         eager over the real rows.

The segments, their boundaries and the P walk are unchanged: a segment replays its pieces instead
of launching its kernels. A bucket whose passes may read their own keys contiguous (the TMA prefill
plan, from ``attention.plan.TMA_PREFILL_TOKENS``) keeps the roped K and V in static buffers too, and
a pass hands them to the attention as the eager pass does: replayed or not, a pass runs the same
kernel. Padded rows (ids 0, position 0) write their K/V into the scratch slot and
only ever meet themselves (attention is over the real rows only; MoE and GEMMs are row-wise).

A bucket's graphs share one memory pool and replay in capture order; its static inputs (ids,
positions, write slots), the q / o buffers around the eager attention and the last residual are
held outside the pool. Two epochs of one bucket never overlap: every P item runs on the one FIFO
P stream. Used only where a P pass is local and fixed-shape: one rank (no attention TP hooks, no
expert parallelism), the triton attention backend, no routing-replay sink, a 16-bit model (fp32
keeps the eager path, the oracle runs compare bitwise across policies).
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..attention import ForwardBatch, keeps_own_kv
from ..model.model import MoETransformer, SegmentState
from .cuda_graphs import capture_session, phase_capture

log = logging.getLogger("ainfer_pd.prefill_graphs")


def prefill_graph_buckets(tokens: tuple[int, ...], max_prefill_tokens: int) -> tuple[int, ...]:
    """The token buckets to capture: the configured ones up to the P budget."""
    return tuple(sorted({t for t in tokens if 0 < t <= max_prefill_tokens}))


@dataclass(slots=True)
class _Bucket:
    T: int
    ids: Tensor                       # [T] static inputs
    pos: Tensor
    write: Tensor
    q: Tensor                         # [T, H, hd] A_l's output, the eager attention's input
    o: Tensor                         # [T, H, hd] the eager attention's output, B_l's input
    embed: Any = None                 # the graphs
    pre: list = field(default_factory=list)
    post: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    h_out: Tensor | None = None       # [T, D] the last residual (the head's input)
    rope: Any = None                  # E's RoPE cos / sin, read by every A_l (held: the pool must not reuse it)
    own_kv: tuple[Tensor, Tensor] | None = None
    """[T, Hk, hd] each: A_l's roped K and V, where a pass of this bucket may read them (TMA); else None."""


class PrefillGraphs:
    def __init__(self, model: MoETransformer, kv_cache_of, buckets: tuple[int, ...], scratch_slot: int,
                 device: torch.device, stream: torch.cuda.Stream) -> None:
        self.model = model
        self.stream = stream
        """The P phase's own CUDA stream: the pieces are warmed up and captured on it
        (:func:`.cuda_graphs.phase_capture`: never the stream of D's graphs)."""
        self.kv_cache_of = kv_cache_of          # () -> the runner's KV pool (it is reallocated on wake)
        self.buckets = tuple(sorted(buckets))
        self.scratch = scratch_slot
        self.device = device
        self.pool = None
        self.graphs: dict[int, _Bucket] = {}
        self.num_replays = 0
        """P passes replayed (each: 1 + 3 per layer graphs)."""
        self.capture_s = 0.0
        self.memory_bytes = 0

    # ------------------------------------------------------------------ capture
    def capture_all(self) -> None:
        dev = self.device
        torch.cuda.synchronize(dev)
        mem0, t0 = torch.cuda.memory_reserved(dev), time.perf_counter()
        with capture_session():
            for T in reversed(self.buckets):         # largest first: smaller buckets reuse the pool
                self.graphs[T] = self._capture(T)
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved(dev) - mem0
        log.info("captured P graphs for %d token buckets %s (%d graphs each) in %.1f s, %.0f MiB",
                 len(self.graphs), list(self.buckets), 1 + 3 * self.model.cfg.num_layers, self.capture_s,
                 self.memory_bytes / 2**20)

    def _graph(self, fn) -> tuple[Any, Any]:
        g, out = phase_capture(fn, self.stream, self.pool)
        if self.pool is None:
            self.pool = g.pool()
        return g, out

    def _new_bucket(self, T: int, kv) -> _Bucket:
        """Bucket T's static buffers (``kv``: the pool's layers, whose format says whether a pass of T
        tokens may read its own K/V: then ``own_kv`` too)."""
        m, c, dev = self.model, self.model.cfg, self.device
        H, hd, dt = c.num_heads, c.head_dim, m.embed.dtype
        b = _Bucket(T, torch.zeros(T, dtype=torch.int64, device=dev), torch.zeros(T, dtype=torch.int64, device=dev),
                    torch.full((T,), self.scratch, dtype=torch.int64, device=dev),
                    torch.zeros(T, H, hd, dtype=dt, device=dev), torch.zeros(T, H, hd, dtype=dt, device=dev))
        if keeps_own_kv(m.kernels, T, dt, hd, kv[0]):
            b.own_kv = tuple(torch.zeros(T, c.num_kv_heads, hd, dtype=dt, device=dev) for _ in range(2))
        return b

    def _capture(self, T: int) -> _Bucket:
        c, dev = self.model.cfg, self.device
        kv = self.kv_cache_of()
        b = self._new_bucket(T, kv)
        fb = ForwardBatch(b.ids, b.pos, b.write, [], None, None, block_size=0, padded=True)   # tokens past T's: padding
        cs = self.stream
        cs.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(cs), torch.inference_mode():
            # warm up every piece once outside capture (Triton compiles, cuBLAS picks), then capture
            st = self._embed(fb)
            for i in range(c.num_layers):
                self._pre(i, st, fb, kv[i], b)
                st = self._experts(i, self._post(i, st, fb, b))
            cs.synchronize()
            b.embed, st = self._graph(lambda: self._embed(fb))
            rope = b.rope = fb.rope
            for i in range(c.num_layers):
                fb.rope = rope
                g, _ = self._graph(lambda: self._pre(i, st, fb, kv[i], b))
                b.pre.append(g)
                g, st = self._graph(lambda: self._post(i, st, fb, b))
                b.post.append(g)
                g, st = self._graph(lambda: self._experts(i, st))
                b.experts.append(g)
            b.h_out = st.h
        torch.cuda.current_stream(dev).wait_stream(cs)
        return b

    # ------------------------------------------------------------------ the pieces (captured)
    def _embed(self, fb: ForwardBatch) -> SegmentState:
        return self.model.embed_tokens(fb)

    def _pre(self, i: int, st: SegmentState, fb: ForwardBatch, kv: Tensor, b: _Bucket) -> None:
        """A_l: norm, QKV GEMM, QK-norm + RoPE + this pass's K/V into the cache -> b.q (and the roped
        K and V -> b.own_kv, where the bucket keeps them)."""
        q = self.model.attention_prologue(i, st, fb, kv, keep=b.own_kv is not None)
        b.q.copy_(q)
        if b.own_kv is not None:
            for held, new in zip(b.own_kv, fb.own_kv):
                held.copy_(new)
            fb.own_kv = None

    def _post(self, i: int, st: SegmentState, fb: ForwardBatch, b: _Bucket) -> SegmentState:
        """B_l: O projection of b.o, residual + FFN norm, router."""
        T = b.T
        o = self.model.attention_out(i, b.o.view(T, -1))
        return self.model.after_attention(i, st, o, fb)

    def _experts(self, i: int, st: SegmentState) -> SegmentState:
        return self.model.experts(i, st)

    # ------------------------------------------------------------------ replay
    def bucket(self, T: int) -> int | None:
        j = bisect.bisect_left(self.buckets, T)
        return self.buckets[j] if j < len(self.buckets) else None

    def binding(self, fb: ForwardBatch) -> "PrefillBinding | None":
        """The replay of one P pass of ``fb`` (prefill rows only), or None when no bucket fits."""
        if fb.decode is not None or not fb.prefill:
            return None
        T = int(fb.input_ids.shape[0])
        key = self.bucket(T)
        if key is None or key not in self.graphs:
            return None
        return PrefillBinding(self, self.graphs[key], fb, T)

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None
        self.model = None
        self.kv_cache_of = None


class PrefillBinding:
    """One P pass replayed through a bucket's graphs; each method is one segment, run in the
    segments' order on the P stream (the walk's items)."""

    __slots__ = ("g", "b", "fb", "T")

    def __init__(self, graphs: PrefillGraphs, bucket: _Bucket, fb: ForwardBatch, T: int) -> None:
        self.g, self.b, self.fb, self.T = graphs, bucket, fb, T

    def embed(self) -> None:
        b, fb, T = self.b, self.fb, self.T
        b.ids[:T].copy_(fb.input_ids, non_blocking=True)
        b.ids[T:].zero_()
        b.pos[:T].copy_(fb.positions, non_blocking=True)
        b.pos[T:].zero_()
        b.write[:T].copy_(fb.write_slots, non_blocking=True)
        b.write[T:].fill_(self.g.scratch)
        b.embed.replay()

    def attn_route(self, layer: int, kv: Tensor) -> None:
        b, T = self.b, self.T
        b.pre[layer].replay()
        model = self.g.model
        kc, vc = kv[0], kv[1]
        own = None if b.own_kv is None else (b.own_kv[0][:T], b.own_kv[1][:T])    # the backend's plan decides
        model.kernels.prefill(b.q[:T], kc, vc, self.fb, b.o[:T], kv_scale=model.kv_scale(layer), own_kv=own)
        b.post[layer].replay()

    def experts(self, layer: int) -> None:
        self.b.experts[layer].replay()

    def hidden(self) -> Tensor:
        """The pass's last hidden states [T, D] (before the final norm; valid until the bucket's next
        replay): what the MTP catch-up reads after the head."""
        return self.b.h_out[:self.T]

    def head(self) -> Tensor:
        self.g.num_replays += 1
        return self.g.model.head(SegmentState(h=self.b.h_out[:self.T]), self.fb.logits_rows)
