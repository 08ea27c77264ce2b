"""Fused MoE: routing layout, permutation and the grouped expert GEMMs without round trips.

``fused_experts`` replaces the reference ``experts_local`` (gather ``[N, D]`` rows, grouped
GEMM into ``[N, 2I]``, SwiGLU, grouped GEMM, scatter): it builds the block-aligned expert
layout on the device (no host sync, so it is captured inside decode graphs) and runs two
Triton kernels that read the tokens in place and write each (token, slot) row once.

Shape legend: T = tokens, k = top-k, N = T * k, D = hidden, I = expert intermediate,
E = experts, P = padded sorted length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..model.moe import Routing
from ..tma import has_tma
from .plan import GemmPlan, MoEPlan, gate_up_tma_ok, moe_plan

__all__ = ["GemmPlan", "MoEPlan", "align_blocks", "align_blocks_triton", "direct_layout", "fused_experts", "layout_rows",
           "moe_sum",
           "fused_softmax_route", "launch_down", "launch_gate_up", "launch_gate_up_planned", "moe_plan"]


def align_blocks(r: Routing, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert-sorted pair ids padded per expert to multiples of ``block_m``.

    Returns ``sorted_ids [P]`` int32 (sentinel N for padding), ``block_expert [P / block_m]``
    int32 and ``num_post [1]`` (padded rows in use). P = N + min(E, N) * (block_m - 1) is fixed
    for a given N, so the shapes never depend on device values.
    """
    flat = r.topk_idx.reshape(-1)
    N = flat.numel()
    E = r.counts.numel()
    dev = flat.device
    counts = r.counts
    padded = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor") * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = r.offsets.to(torch.int64) - counts
    e_sorted = flat.index_select(0, r.order)
    rank = torch.arange(N, device=dev) - start.index_select(0, e_sorted)
    dest = pad_start.index_select(0, e_sorted) + rank
    P = N + min(E, N) * (block_m - 1)
    P = -(-P // block_m) * block_m
    sorted_ids = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, r.order.to(torch.int32))
    starts = torch.arange(0, P, block_m, device=dev, dtype=torch.int64)
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_(max=E - 1).to(torch.int32)
    return sorted_ids, block_expert, pad_end[-1:]


def align_blocks_triton(r: Routing, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The layout of :func:`align_blocks` in two launches (the order of pairs inside an expert's
    run differs from run to run; no result depends on it)."""
    from .kernels import moe_align_kernel, moe_scatter_kernel
    flat = r.topk_idx.reshape(-1)
    N = flat.numel()
    E = r.counts.numel()
    dev = flat.device
    P = N + min(E, N) * (block_m - 1)
    P = -(-P // block_m) * block_m
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    block_expert = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(E, dtype=torch.int32, device=dev)
    e_pad = 1 << max(0, (E - 1).bit_length())
    moe_align_kernel[(1,)](r.counts, sorted_ids, block_expert, num_post, cursor, E, P, N,
                           BLOCK_M=block_m, E_PAD=e_pad, FILL=1024, BLOCKS_PER_STEP=max(1, 4096 // e_pad),
                           num_warps=4)
    moe_scatter_kernel[(triton_cdiv(N, 1024),)](flat, sorted_ids, cursor, N, BLOCK=1024, num_warps=4)
    return sorted_ids, block_expert, num_post


def direct_layout(r: Routing) -> tuple[Tensor, Tensor, Tensor]:
    """The layout of a :attr:`MoEPlan.direct` plan: the routing's flat expert ids, nothing built
    (row block m is pair m; the kernels read only the expert ids)."""
    flat = r.topk_idx.reshape(-1)
    return flat, flat, flat


def layout_rows(layout: tuple[Tensor, Tensor, Tensor], block_m: int, direct: bool) -> int:
    """``P``, the padded rows the expert GEMMs walk over ``layout``: the aligned layout's sorted
    length, or a direct plan's pairs times ``block_m`` (one row block each)."""
    return layout[0].numel() * (block_m if direct else 1)


def launch_gate_up(x: Tensor, w13: Tensor, act: Tensor, layout: tuple[Tensor, Tensor, Tensor], top_k: int,
                   g: GemmPlan, direct: bool = False) -> None:
    """act [N, I] = silu(x[tok] @ W13[e, :, :I]) * (x[tok] @ W13[e, :, I:]) for every pair."""
    from .kernels import moe_gate_up_kernel
    _launch(moe_gate_up_kernel, layout, g, act.shape[1], x, w13, act, num_k=x.shape[1], direct=direct, TOPK=top_k)


def launch_gate_up_planned(x: Tensor, w13: Tensor, act: Tensor, layout: tuple[Tensor, Tensor, Tensor], top_k: int,
                           plan: MoEPlan) -> None:
    """gate_up as ``plan`` says: through TMA descriptors (:attr:`MoEPlan.gate_up_tma`) or pointer loads."""
    if plan.gate_up_tma:
        assert not plan.direct and gate_up_tma_ok(x, w13, plan.gate_up.block_n), "TMA gate_up: aligned, w13 ok"
        from .kernels_tma import launch_gate_up_tma
        launch_gate_up_tma(x, w13, act, layout, top_k, plan.gate_up)
    else:
        launch_gate_up(x, w13, act, layout, top_k, plan.gate_up, plan.direct)


def launch_down(act: Tensor, w2: Tensor, rows: Tensor, layout: tuple[Tensor, Tensor, Tensor], topw: Tensor,
                g: GemmPlan, direct: bool = False) -> None:
    """rows [N, D] = topw[pair] * act[pair] @ W2[e] for every pair."""
    from .kernels import moe_down_kernel
    _launch(moe_down_kernel, layout, g, rows.shape[1], act, w2, rows, num_k=act.shape[1], topw=topw, direct=direct)


def _launch(kernel, layout, g: GemmPlan, ncols: int, a: Tensor, w: Tensor, out: Tensor, *, num_k: int,
            topw: Tensor | None = None, direct: bool = False, **meta) -> None:
    """One expert GEMM over the aligned row blocks (``direct``: one block a pair, :func:`direct_layout`):
    a [N or T, K] rows, w [E, K, ncols] -> out [N, ncols]."""
    sorted_ids, block_expert, num_post = layout
    P = layout_rows(layout, g.block_m, direct)
    grid = (triton_cdiv(P, g.block_m) * triton_cdiv(ncols, g.block_n),)
    ptrs = (a, w, out, sorted_ids, block_expert, num_post) + ((topw,) if topw is not None else ())
    kernel[grid](*ptrs, out.shape[0], P, num_k, ncols,
                 a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                 BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
                 IEEE=a.dtype == torch.float32, DIRECT=direct, num_warps=g.num_warps, num_stages=g.num_stages, **meta)


def fused_experts(x: Tensor, r: Routing, w13: Tensor, w2: Tensor, plan: MoEPlan | None = None,
                  residual: Tensor | None = None) -> Tensor:
    """Routed experts: x [T, D], w13 [E, D, 2I], w2 [E, I, D] -> [T, D] (+ ``residual`` [T, D], added in
    the k-slot sum: :func:`moe_sum`)."""
    T, D = x.shape
    k = r.topk_idx.shape[1]
    E, _, I2 = w13.shape
    N = T * k
    if N == 0:
        return torch.zeros_like(x) if residual is None else residual.clone()
    plan = plan or moe_plan(N, E, x.dtype == torch.float32, tokens=T,
                            tma=has_tma(x.device) and gate_up_tma_ok(x, w13))
    assert plan.gate_up.block_m == plan.down.block_m, "both GEMMs walk the same aligned blocks"
    assert not plan.direct or plan.gate_up.group_m == plan.down.group_m == 1, "a direct plan has no row groups"
    layout = direct_layout(r) if plan.direct else align_blocks_triton(r, plan.block_m)
    x = x.contiguous()
    act = torch.empty(N, I2 // 2, dtype=x.dtype, device=x.device)
    launch_gate_up_planned(x, w13, act, layout, k, plan)
    rows = torch.empty(N, D, dtype=x.dtype, device=x.device)
    launch_down(act, w2, rows, layout, r.topk_weights.reshape(-1).contiguous(), plan.down, plan.direct)
    # padding rows' pairs run nowhere (r.padded): their rows are never written, the sum skips them
    return moe_sum(rows, T, k, ids=r.topk_idx if r.padded else None, residual=residual)


def moe_sum(rows: Tensor, T: int, k: int, dtype: torch.dtype | None = None, ids: Tensor | None = None,
            residual: Tensor | None = None) -> Tensor:
    """Each token's k rows of ``rows`` [T * k, D] added in slot order (float32, one rounding) ->
    [T, D] in ``dtype`` (rows' by default): :func:`~.kernels.moe_sum_kernel`, one launch. ``ids``
    [T, k] (a padded batch's routing): a pair routed nowhere (expert -1) adds 0, its row unread.
    ``residual`` [T, D]: added to each token's sum before the rounding (the layer's residual stream)."""
    from .kernels import moe_sum_kernel
    D = rows.shape[1]
    out = torch.empty(T, D, dtype=dtype or rows.dtype, device=rows.device)
    if T == 0 or D == 0:
        return out
    assert rows.stride(1) == 1 and rows.shape[0] == T * k, "rows [T * k, D] with unit column stride"
    block = min(1024, 1 << (D - 1).bit_length())
    if ids is not None:
        assert ids.shape == (T, k) and ids.is_contiguous(), "ids [T, k], contiguous"
    if residual is not None:
        assert residual.shape == (T, D) and residual.stride(1) == 1, "residual [T, D] with unit column stride"
    res = residual if residual is not None else rows
    moe_sum_kernel[(T, triton_cdiv(D, block))](rows, ids if ids is not None else rows, res, out, D, rows.stride(0),
                                               res.stride(0), out.stride(0), TOPK=k, BLOCK_D=block,
                                               HAS_IDS=ids is not None, HAS_RES=residual is not None, num_warps=4)
    return out


def fused_softmax_route(x: Tensor, router_w: Tensor, top_k: int, norm_topk_prob: bool = True,
                        pad: tuple[Tensor, int] | None = None) -> Routing:
    """The softmax router (``engine.routing``, kind ``softmax``) in two launches after the router
    GEMM: x [T, D], router_w [E, D] -> Routing (counts included). Same choice as the torch path
    up to float32 rounding of the softmax; exact ties go to the lowest expert id. ``pad`` =
    (the rows' KV write slots [T], the padding slot): a row writing the padding slot (a graph
    bucket's or a replica's padding) is routed nowhere (expert -1, weight 0, no count): padding
    rows cost no expert reads (:attr:`Routing.padded`)."""
    from .kernels import softmax_topk_kernel
    T = x.shape[0]
    E = router_w.shape[0]
    logits = torch.nn.functional.linear(x, router_w)                  # [T, E] in the model dtype
    topk_w = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    topk_idx = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device)
    slots, pad_slot = pad if pad is not None else (counts, 0)
    if T:
        softmax_topk_kernel[(T,)](logits, topk_w, topk_idx, counts, slots, E, logits.stride(0), pad_slot, K=top_k,
                                  K_PAD=max(2, 1 << (top_k - 1).bit_length()), E_PAD=max(16, 1 << (E - 1).bit_length()),
                                  NORM=norm_topk_prob, HAS_PAD=pad is not None, num_warps=1 if E <= 256 else 4)
    return Routing(topk_idx, topk_w, None, counts, padded=pad is not None)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
