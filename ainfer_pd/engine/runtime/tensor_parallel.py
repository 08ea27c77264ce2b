"""Attention tensor parallelism and D's expert path of the multi-rank engine.

Inside one attention-DP replica of ATP ranks the attention is sharded by heads: QKV column
parallel (each TP rank keeps a contiguous block of query heads and the KV heads of their GQA
groups: ``num_kv_heads % ATP == 0``, its KV cache holds only those heads), O row parallel (the
matching columns of ``wo``; the output bias on TP rank 0 only). Each rank's attention output is a
partial sum over its heads; the TP group sums them:

* P (eager) with its own full attention-TP all-reduce (``attn_tp.P``), its own stream item
  between the attention and the router, routed by the ordering (:mod:`ainfer_pd.comm.ordering`);
* D inside its iteration (:class:`DecodeHooks`), with D's own communicators.

Experts are expert-parallel over every rank (rank ``r`` holds experts ``[r E/g, (r+1) E/g)``).
Each phase reaches them through its own phase-owned dispatcher (SPEC 3.4; P's: the normal path,
split at the notification; D's: the low-latency path, notify -> dispatch -> combine back to
back), never through shared state. With ATP = 1 a rank sends its rows as they are. With ATP > 1
D's attention reduce is a reduce-scatter: each TP rank of a replica keeps only its share of the
rows from the residual add through the experts (its share goes through D's dispatcher), and the
layer ends with the all-gather of the shares (as SGLang's attention-TP path around DeepEP; the
bytes of one all-reduce, where an all-reduce before and one after the experts moved twice that):

    o   = attention over this rank's heads                  [B, D]  (partial)
    o_s = reduce_scatter(o, attn_tp.D)                      [B_s, D] s = this TP rank's share
    xn  = ffn_norm(h[s] + o_s); routing of the share
    y_s = D dispatcher (EP over every rank) on rows s       [B_s, D]
    h   = all_gather(h[s] + o_s + y_s, attn_tp.D)           [B, D]  every TP rank's share

Shape legend: B = padded decode rows per replica (a multiple of ATP: equal shares), B_s = B / ATP,
D = hidden. P keeps its full attention-TP all-reduce (eager, its own item between the attention
and the router).

**D's DP-attention path** (ADP > 1, experts over every rank; SGLang's ``dp_gather`` / ``dp_scatter``
of ``layers/dp_attention.py``: a reduce-scatter over the attention-TP group, an all-gather across
the replicas, the part of the layer that runs over every rank, then the way back). Around each
MoE layer's routed experts, on D's own DP-attention communicator ``attn_dp.D`` (the ranks with this
TP index in every replica; with P's attention-TP all-reduce the crossed pair of SPEC 2):

    g   = all_gather(xn_s, attn_dp.D)                       [ADP B_s, D]  every replica's share
    r   = router(g); keep the (row t, slot j) pairs with (t k + j) % ADP == m   (others: -1, not sent)
    y_m = D dispatcher (EP over every rank) on g, pairs m   [ADP B_s, D]  partial: this member's pairs
    y_s = reduce_scatter(y_m, attn_dp.D)                    [B_s, D]      every member's slots, own rows

The part run over every rank is the routed-expert sum: this engine's experts are expert-parallel
with ETP = 1 (each expert whole on one rank), so the gathered rows' partial sums are split by (row,
top-k slot) pair across the DP group (``m`` = this rank's index in it, ``m = dp_rank``) instead of by
intermediate column as an expert-TP MoE would: every pair is dispatched exactly once in the world,
as without the gather, and the sum of the members' partials is the layer's output (up to float
summation order). Dense layers and the shared
expert stay local (their weights are whole on every rank: nothing to gather for).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...comm.ordering import D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_GATHER, D_ATP_REDUCE_SCATTER, P_ATP_ALL_REDUCE
from ...errors import TopologyError
from ..model.moe import Routing

__all__ = ["PhaseHooks", "DecodeHooks", "PrefillHooks", "shard_attention_", "decode_dispatch_rows"]


@dataclass(frozen=True, slots=True)
class PhaseHooks:
    """What a phase's forward pass calls between segments: ``attn_reduce(o)`` after the
    attention (it may return this rank's share of the rows: a reduce-scatter), ``experts(x,
    routing, layer)`` for the routed experts (None: local), ``gather(h)`` at the layer end when
    ``attn_reduce`` left a share (the all-gather of the shares; None: the rows are whole)."""

    attn_reduce: Callable[[Tensor], Tensor] | None = None
    experts: Callable[[Tensor, Routing, int], Tensor] | None = None
    gather: Callable[[Tensor], Tensor] | None = None


LOCAL = PhaseHooks()


# ====================================================================== sharding
@torch.no_grad()
def shard_attention_(model: Any, tp_rank: int, atp: int) -> Any:
    """Keep only TP shard ``tp_rank`` of ``atp`` of ``model``'s attention, in place.

    Query and KV heads split into ``atp`` contiguous blocks (GQA groups stay together: local query
    head h uses local KV head h // (H / Hk), as globally); ``wqkv`` / ``bqkv`` keep the matching
    rows, ``wo`` the matching columns, ``bo`` stays on TP rank 0 only (the shards are summed).
    ``model.cfg`` becomes the shard's (its head counts), ``model.tp_shard`` = (tp_rank, atp).
    Everything else (norms, QK-norms, router, experts, embeddings, head) is untouched.
    """
    c = model.cfg
    H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    if atp < 1 or Hk % atp or H % atp:
        raise TopologyError(f"attention TP {atp} must divide num_heads={H} and num_kv_heads={Hk}")
    if not 0 <= tp_rank < atp:
        raise TopologyError(f"tp_rank {tp_rank} outside [0, {atp})")
    model.tp_shard = (tp_rank, atp)
    if atp == 1:
        return model
    hq, hk = H // atp, Hk // atp
    dev = model.embed.device
    q = torch.arange(tp_rank * hq * hd, (tp_rank + 1) * hq * hd, device=dev)
    k = H * hd + torch.arange(tp_rank * hk * hd, (tp_rank + 1) * hk * hd, device=dev)
    v = (H + Hk) * hd + torch.arange(tp_rank * hk * hd, (tp_rank + 1) * hk * hd, device=dev)
    rows = torch.cat([q, k, v])
    cols = slice(tp_rank * hq * hd, (tp_rank + 1) * hq * hd)
    for lyr in model.layers:
        lyr.wqkv = torch.nn.Parameter(lyr.wqkv.index_select(0, rows).contiguous(), requires_grad=False)
        if lyr.bqkv is not None:
            lyr.bqkv = torch.nn.Parameter(lyr.bqkv.index_select(0, rows).contiguous(), requires_grad=False)
        lyr.wo = torch.nn.Parameter(lyr.wo[:, cols].contiguous(), requires_grad=False)
        if lyr.bo is not None and tp_rank != 0:
            lyr.bo.zero_()
    model.cfg = dataclasses.replace(c, num_heads=hq, num_kv_heads=hk)
    return model


# ====================================================================== phase hooks
def decode_dispatch_rows(max_decode_batch: int, topology: Any) -> int:
    """The most rows one D dispatch of this rank carries: its share of a replica's padded batch
    (``ceil(max_decode_batch / ATP)``), times ADP when D's DP-attention path gathers every
    replica's share (ADP > 1)."""
    share = -(-max_decode_batch // topology.atp)
    return share * topology.adp if topology.adp > 1 else max_decode_batch


class DecodeHooks:
    """D's collectives and expert path inside its iteration (module docstring). ``colls``: the
    rank's D-phase :class:`~ainfer_pd.comm.collectives.PhaseCollectives`; ``model``: the (sharded)
    model; ``ep``: the :class:`~ainfer_pd.engine.runtime.expert_parallel.ExpertParallel` (D's dispatcher
    chosen by ``ctx``, D's phase context). With ADP > 1 and expert parallelism the routed experts
    run on the rows of every replica (:meth:`experts_dp`)."""

    def __init__(self, colls: Any, model: Any, ep: Any, ctx: Any) -> None:
        self.colls, self.model, self.ep, self.ctx = colls, model, ep, ctx
        self.tp = colls.active(D_ATP_REDUCE_SCATTER)
        self.tp_rank, self.atp = getattr(model, "tp_shard", (0, 1))
        self.dp = ep is not None and colls.active(D_ADP_ALL_GATHER)
        """D's DP-attention gather / scatter runs around the routed experts."""
        self.adp = colls.size(D_ADP_ALL_GATHER.comm)
        self.dp_index = colls.members[D_ADP_ALL_GATHER.comm].index(colls.topology.rank) if self.dp else 0

    def schedule(self) -> list:
        """The attention collectives of one D iteration, in the order it runs them (D's expert
        exchange is its dispatcher's, on its own communicator: not an attention collective); a
        model with an MTP layer runs it last (its catch-up)."""
        return [k for i in range(len(self.model.layers)) for k in self.layer_schedule(i)]

    def layer_schedule(self, layer: int) -> list:
        """The attention collectives of one pass of layer ``layer`` (an MTP chain step: the MTP layer's)."""
        out: list = [D_ATP_REDUCE_SCATTER] if self.tp else []
        if self.dp and self.model.layers[layer].is_moe:
            out += [D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER]
        return out + ([D_ATP_ALL_GATHER] if self.tp else [])

    def hooks(self) -> PhaseHooks:
        experts = None if self.ep is None else (self.experts_dp if self.dp else self.experts)  # None: every expert local
        return PhaseHooks(attn_reduce=self.attn_reduce if self.tp else None, experts=experts,
                          gather=self.gather if self.tp else None)

    def attn_reduce(self, o: Tensor) -> Tensor:
        """[B, D] partial sums over this rank's heads -> [B / ATP, D], this rank's rows, summed."""
        return self.colls.run(D_ATP_REDUCE_SCATTER, o)

    def experts(self, xn: Tensor, r: Routing, layer: int) -> Tensor:
        """This rank's rows (its share under ATP > 1) through D's dispatcher."""
        return self.ep.run(self.ctx, xn, r, layer)

    def experts_dp(self, xn: Tensor, r: Routing, layer: int) -> Tensor:
        """[B_s, D] this rank's rows -> [B_s, D] their routed-expert sum, computed over the rows of
        every replica (module docstring): all-gather on ``attn_dp.D``, this member's top-k slots of
        every gathered row through D's dispatcher, reduce-scatter on ``attn_dp.D``. ``r`` (the
        routing of this rank's rows) is recomputed over the gathered rows: every member of the
        DP group routes the same rows alike."""
        g = self.colls.run(D_ADP_ALL_GATHER, xn)
        rg = self.model.route_rows(layer, g)
        T, k = rg.topk_idx.shape
        others = torch.arange(T * k, device=g.device).view(T, k) % self.adp != self.dp_index
        idx = rg.topk_idx.masked_fill(others, -1)           # [ADP B_s, k]: this member's pairs, -1 elsewhere
        w = rg.topk_weights.masked_fill(others, 0.0)
        y = self.ep.run(self.ctx, g, Routing(idx, w, None, None), layer)
        return self.colls.run(D_ADP_REDUCE_SCATTER, y)

    def gather(self, h: Tensor) -> Tensor:
        """[B / ATP, D] this rank's rows -> [B, D], every TP rank's, in TP-rank order."""
        return self.colls.run(D_ATP_ALL_GATHER, h)


class PrefillHooks:
    """P's hooks for a whole forward pass in one item (CUDA warm-up): the attention all-reduce
    inline on the P stream, the experts through the P dispatcher. The P epoch walk launches
    the all-reduce as its own item instead (the ordering routes it)."""

    def __init__(self, colls: Any, ep: Any, ctx: Any) -> None:
        self.colls, self.ep, self.ctx = colls, ep, ctx

    def hooks(self) -> PhaseHooks:
        reduce = None
        if self.colls is not None and self.colls.active(P_ATP_ALL_REDUCE):
            def reduce(o: Tensor) -> Tensor:
                if self.colls.booking:
                    self.colls.enqueue(P_ATP_ALL_REDUCE, stream="P")
                return self.colls.run(P_ATP_ALL_REDUCE, o)
        experts = None
        if self.ep is not None:
            ep, ctx = self.ep, self.ctx
            experts = lambda x, r, i: ep.run(ctx, x, r, i)       # noqa: E731
        return PhaseHooks(attn_reduce=reduce, experts=experts)
