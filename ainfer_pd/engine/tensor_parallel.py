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
the TP ranks of a replica hold the same rows after the attention reduce, so each sends only its
share through D's dispatcher and the TP group gathers the shares back:

    o   = attention over this rank's heads                  [B, D]  (partial)
    o   = all_reduce(o, attn_tp.D)                          [B, D]
    xn  = ffn_norm(h + o)
    y_s = D dispatcher (EP over every rank) on rows s       [B_s, D]  s = this TP rank's share
    y   = all_reduce(y_s at rows s, 0 elsewhere; attn_tp.D) [B, D]  the TP all-gather of the shares

Shape legend: B = padded decode rows per replica, B_s = this TP rank's share of them, D = hidden.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..comm.ordering import D_ATP_ALL_REDUCE, P_ATP_ALL_REDUCE
from ..errors import TopologyError
from .moe import Routing, routing_of

__all__ = ["PhaseHooks", "DecodeHooks", "PrefillHooks", "shard_attention_", "tp_share"]


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


# ====================================================================== phase hooks
def tp_share(rows: int, tp_rank: int, atp: int) -> slice:
    """The rows [lo, hi) of ``rows`` that TP rank ``tp_rank`` of ``atp`` sends through its phase's
    expert dispatcher (contiguous, sizes differ by at most one; pure)."""
    base, extra = divmod(rows, atp)
    lo = tp_rank * base + min(tp_rank, extra)
    return slice(lo, lo + base + (1 if tp_rank < extra else 0))


class DecodeHooks:
    """D's collectives and expert path inside its iteration (module docstring). ``colls``: the
    rank's D-phase :class:`~ainfer_pd.comm.collectives.PhaseCollectives`; ``model``: the (sharded)
    model; ``ep``: the :class:`~ainfer_pd.engine.expert_parallel.ExpertParallel` (D's dispatcher
    chosen by ``ctx``, D's phase context)."""

    def __init__(self, colls: Any, model: Any, ep: Any, ctx: Any) -> None:
        self.colls, self.model, self.ep, self.ctx = colls, model, ep, ctx
        self.tp = colls.active(D_ATP_ALL_REDUCE)
        self.tp_rank, self.atp = getattr(model, "tp_shard", (0, 1))

    def schedule(self) -> list:
        """The attention collectives of one D iteration, in the order it runs them (D's expert
        exchange is its dispatcher's, on its own communicator: not an attention collective)."""
        out = []
        for i in range(self.model.cfg.num_layers):
            if self.tp:
                out.append(D_ATP_ALL_REDUCE)
                if self.model.layers[i].is_moe and self.ep is not None:
                    out.append(D_ATP_ALL_REDUCE)
        return out

    def hooks(self) -> PhaseHooks:
        return PhaseHooks(attn_reduce=self.attn_reduce if self.tp else None,
                          experts=self.experts if self.ep is not None else None)    # None: every expert local

    def attn_reduce(self, o: Tensor) -> Tensor:
        return self.colls.run(D_ATP_ALL_REDUCE, o)

    def experts(self, xn: Tensor, r: Routing, layer: int) -> Tensor:
        if not self.tp:
            return self.ep.run(self.ctx, xn, r, layer)
        s = tp_share(int(xn.shape[0]), self.tp_rank, self.atp)
        share = routing_of(r.topk_idx[s], r.topk_weights[s], self.model.cfg.num_experts)
        y = torch.zeros_like(xn)
        y[s] = self.ep.run(self.ctx, xn[s], share, layer)
        return self.colls.run(D_ATP_ALL_REDUCE, y)              # every TP rank's share, on every TP rank


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
