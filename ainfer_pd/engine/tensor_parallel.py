"""Attention tensor parallelism and the DP-attention expert path of the multi-rank engine.

Inside one attention-DP replica of ATP ranks the attention is sharded by heads: QKV column
parallel (each TP rank keeps a contiguous block of query heads and the KV heads of their GQA
groups: ``num_kv_heads % ATP == 0``, its KV cache holds only those heads), O row parallel (the
matching columns of ``wo``; the output bias on TP rank 0 only). Each rank's attention output is a
partial sum over its heads; the TP group sums them:

* P (eager) with its own full attention-TP all-reduce (``attn_tp.P``), its own stream item
  between the attention and the router, routed by the ordering (:mod:`ainfer_pd.comm.ordering`);
* D inside its iteration (:class:`DecodeHooks`), with D's own communicators.

Experts are expert-parallel over every rank (rank ``r`` holds experts ``[r E/g, (r+1) E/g)``).
P reaches them through its phase-owned dispatcher (the split at notification: receive counts,
then the permit, then the data). D uses the DP-attention gather / scatter *around the experts*
instead of an all-to-all, so its collectives have static shapes (the agreed padded batch) and can
be captured in the CUDA graph with the rest of the iteration:

    o   = attention over this rank's heads                  [B, D]  (partial)
    o   = all_reduce(o, attn_tp.D)                          [B, D]
    xn  = ffn_norm(h + o)
    X   = all_gather(xn, attn_dp.D)                         [d B, D]  every replica's rows
    y   = experts of this rank over the rows of X routed to them, 0 elsewhere
    y   = reduce_scatter(y, attn_dp.D)                      [B, D]  this replica's rows, summed over d
    y   = all_reduce(y, attn_tp.D)                          [B, D]  summed over the other TP ranks' experts

Shape legend: B = padded decode rows per replica, d = ADP, D = hidden, k = top-k.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..comm.ordering import D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_REDUCE, P_ATP_ALL_REDUCE
from ..errors import TopologyError
from .moe import Routing, experts_local, swiglu_grouped

__all__ = ["PhaseHooks", "DecodeHooks", "PrefillHooks", "shard_attention_", "local_experts"]


@dataclass(frozen=True, slots=True)
class PhaseHooks:
    """What a phase's forward pass calls between segments: ``attn_reduce(o)`` after the
    attention, ``experts(x, routing, layer)`` for the routed experts (None: local)."""

    attn_reduce: Callable[[Tensor], Tensor] | None = None
    experts: Callable[[Tensor, Routing, int], Tensor] | None = None


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


# ====================================================================== experts of a shard
def local_experts(model: Any, layer: int, x: Tensor, r: Routing) -> Tensor:
    """This rank's experts' contribution to every row of ``x`` [N, D] -> [N, D]; a (row, slot)
    routed to another rank's expert contributes 0. No host sync (graph-capturable)."""
    lyr = model.layers[layer]
    lo, hi = model.expert_range
    idx, w = r.topk_idx, r.topk_weights                         # [N, k]
    here = (idx >= lo) & (idx < hi)
    El = hi - lo
    if model.expert_kernel is not experts_local:
        # another kernel (fused Triton): every (row, slot) through local expert 0 at weight 0 when
        # it is not ours. Correct; wastes the other ranks' share of the expert rows.
        loc = torch.where(here, idx - lo, torch.zeros_like(idx))
        from .moe import routing_of
        return model.expert_kernel(x, routing_of(loc, torch.where(here, w, torch.zeros_like(w)), El),
                                   lyr.w13, lyr.w2)
    N, k = idx.shape
    flat = torch.where(here, idx - lo, torch.full_like(idx, El)).reshape(-1)       # [N k], El = not ours
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(El + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts[:El], 0).to(torch.int32)
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))             # [N k, D] by expert
    ys = swiglu_grouped(xs, lyr.w13, lyr.w2, offsets)                              # rows past ours: garbage
    ys = torch.where((flat.index_select(0, order) < El).unsqueeze(-1), ys, torch.zeros_like(ys))
    rows = torch.empty_like(ys)
    rows[order] = ys                                                               # (row, slot) order
    wk = torch.where(here, w, torch.zeros_like(w))
    return (rows.view(N, k, -1) * wk.unsqueeze(-1)).sum(dim=1)


# ====================================================================== phase hooks
class DecodeHooks:
    """D's collectives inside its iteration (module docstring). ``colls``: the rank's
    :class:`~ainfer_pd.comm.collectives.PhaseCollectives`; ``model``: the (sharded) model."""

    def __init__(self, colls: Any, model: Any) -> None:
        self.colls, self.model = colls, model
        self.tp = colls.active(D_ATP_ALL_REDUCE)
        self.dp = colls.active(D_ADP_ALL_GATHER)

    def schedule(self) -> list:
        """The collectives of one D iteration, in the order it runs them."""
        out = []
        for i in range(self.model.cfg.num_layers):
            if self.tp:
                out.append(D_ATP_ALL_REDUCE)
            if self.model.layers[i].is_moe:
                out += [D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER] if self.dp else []
                out += [D_ATP_ALL_REDUCE] if self.tp else []
        return out

    def hooks(self) -> PhaseHooks:
        return PhaseHooks(attn_reduce=self.attn_reduce if self.tp else None, experts=self.experts)

    def attn_reduce(self, o: Tensor) -> Tensor:
        return self.colls.run(D_ATP_ALL_REDUCE, o)

    def experts(self, xn: Tensor, r: Routing, layer: int) -> Tensor:
        colls = self.colls
        if self.dp:
            X = colls.run(D_ADP_ALL_GATHER, xn)                    # [d B, D]
            y = local_experts(self.model, layer, X, self.model.route_rows(layer, X))
            y = colls.run(D_ADP_REDUCE_SCATTER, y)                 # [B, D]
        else:
            y = local_experts(self.model, layer, xn, r)
        return colls.run(D_ATP_ALL_REDUCE, y) if self.tp else y


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
