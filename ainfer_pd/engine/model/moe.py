"""MoE FFN pieces: softmax top-k router (other routers: :mod:`.routing`), local grouped expert compute, SwiGLU.

Shape legend: T = tokens, D = hidden, E = routed experts, k = top-k,
I = expert intermediate, N = T * k routed rows.

Everything here avoids host synchronisation (no ``bincount``, no tensor-valued
``repeat_interleave``) so the decode path can be captured in a CUDA graph:
counts come from ``scatter_add_`` into a fixed-size tensor and offsets from
``cumsum`` (SPEC section 8).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class Routing:
    """Top-k routing of T tokens, and the expert-sorted layout of the N = T*k rows.

    ``topk_idx [T, k] int64``, ``topk_weights [T, k]`` (final combine weights), ``counts [E]
    int64`` rows per expert (device tensor: the "receive counts"). ``order [N]`` (row ids sorted
    by expert, stable; row = token * k + slot) and ``offsets [E] int32`` (cumulative counts,
    the grouped GEMM ends) are computed on first use: the fused MoE kernels need neither.
    """

    __slots__ = ("topk_idx", "topk_weights", "counts", "_order", "_offsets", "padded")

    def __init__(self, topk_idx: Tensor, topk_weights: Tensor, order: Tensor | None, counts: Tensor,
                 offsets: Tensor | None = None, padded: bool = False) -> None:
        self.topk_idx, self.topk_weights, self.counts = topk_idx, topk_weights, counts
        self._order, self._offsets = order, offsets
        self.padded = padded
        """Padding rows may be routed nowhere (expert -1, weight 0, not counted;
        ``fused_moe.fused_softmax_route``): only the fused expert kernels take such a routing."""

    @property
    def order(self) -> Tensor:
        if self._order is None:
            self._order = torch.sort(self.topk_idx.reshape(-1), stable=True).indices
        return self._order

    @property
    def offsets(self) -> Tensor:
        if self._offsets is None:
            self._offsets = torch.cumsum(self.counts, 0).to(torch.int32)
        return self._offsets


def route(x: Tensor, router_w: Tensor, top_k: int) -> Routing:
    """Softmax router, top-k, renormalised weights; expert-sorted layout (the other router
    variants: :mod:`.routing`)."""
    scores = F.linear(x, router_w)                              # [T, E] in the model dtype
    probs = torch.softmax(scores.float(), dim=-1)
    topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)         # [T, k]
    topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    return routing_of(topk_idx, topk_w.to(x.dtype), router_w.shape[0])


def routing_of(topk_idx: Tensor, topk_weights: Tensor, num_experts: int) -> Routing:
    """The expert-sorted layout of a top-k choice: topk_idx [T, k] int64, topk_weights [T, k]
    (the final combine weights) -> Routing. No host sync (counts by ``scatter_add_``)."""
    flat = topk_idx.reshape(-1)                                  # [N]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return Routing(topk_idx, topk_weights, None, counts)


def swiglu_grouped(xs: Tensor, w13: Tensor, w2: Tensor, offsets: Tensor) -> Tensor:
    """Grouped SwiGLU over expert-sorted rows.

    xs [N, D] sorted by expert, w13 [E, D, 2I], w2 [E, I, D], offsets [E] int32 -> [N, D]
    """
    if xs.shape[0] == 0:
        return xs
    if _grouped_ok(xs):
        h = torch._grouped_mm(xs, w13, offs=offsets)             # [N, 2I]
    else:  # host-synchronising fallback (float64, or float32 on CUDA): not graph-capturable
        h = _loop_mm(xs, w13, offsets)
    g, u = h.chunk(2, dim=-1)
    y = F.silu(g) * u                                            # [N, I]
    if _grouped_ok(y):
        return torch._grouped_mm(y, w2, offs=offsets)            # [N, D]
    return _loop_mm(y, w2, offsets)


def _grouped_ok(t: Tensor) -> bool:
    """``torch._grouped_mm`` runs natively for bf16 on CUDA and for fp32/bf16 on CPU."""
    return t.dtype == torch.bfloat16 if t.is_cuda else t.dtype in (torch.float32, torch.bfloat16)


def _loop_mm(xs: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    out = xs.new_empty(xs.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = xs[start:end] @ w[e]
        start = end
    return out


def experts_local(x: Tensor, r: Routing, w13: Tensor, w2: Tensor, residual: Tensor | None = None) -> Tensor:
    """Routed experts on this rank (no expert parallelism): permute, grouped GEMM, combine.

    x [T, D] -> [T, D]. The combine un-permutes with a plain scatter (unique indices, no
    atomics) and sums the k slots of each token in a fixed order, so a token's output does
    not depend on which other tokens share its batch. ``residual`` [T, D]: added to the result.
    """
    T, D = x.shape
    k = r.topk_idx.shape[1]
    tok = torch.div(r.order, k, rounding_mode="floor")          # [N] source token of each sorted row
    xs = x.index_select(0, tok)                                 # [N, D]
    ys = swiglu_grouped(xs, w13, w2, r.offsets)                 # [N, D]
    rows = torch.empty_like(ys)
    rows[r.order] = ys                                          # [N, D] back in (token, slot) order
    y = (rows.view(T, k, D) * r.topk_weights.unsqueeze(-1)).sum(dim=1)
    return y if residual is None else residual + y


def swiglu_dense(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Shared expert: x [T, D], w13 [D, 2I], w2 [I, D] -> [T, D]."""
    g, u = (x @ w13).chunk(2, dim=-1)
    return (F.silu(g) * u) @ w2
