"""The fused MoE (Triton, run on CPU under TRITON_INTERPRET=1) against the reference experts path.

Covers decode-like batches (a few rows per expert, most experts idle), prefill-like batches
(many rows per expert, several row blocks of one expert), the block-aligned layout itself, and
batch invariance (a token's output does not depend on which tokens share its batch).
"""
from __future__ import annotations

import pytest
import torch

from ainfer_pd.engine.fused_moe import GemmPlan, MoEPlan, align_blocks, fused_experts, moe_sum
from ainfer_pd.engine.model.moe import experts_local, route


def weights(E, D, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, D, 2 * I, generator=g) * D ** -0.5,
            torch.randn(E, I, D, generator=g) * I ** -0.5,
            torch.randn(E, D, generator=g))


@pytest.mark.parametrize("T,E,k,D,I", [(3, 8, 2, 32, 48), (40, 8, 2, 64, 32), (17, 16, 4, 48, 80)])
def test_fused_matches_reference(T, E, k, D, I):
    w13, w2, rw = weights(E, D, I)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    r = route(x, rw, k)
    ref = experts_local(x, r, w13, w2)
    out = fused_experts(x, r, w13, w2)
    assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_fused_several_blocks_per_expert_and_group_swizzle():
    """Row blocks of 16 with 8 experts and 60 x 2 rows: experts span several blocks; GROUP_M > 1."""
    E, D, I, T, k = 8, 32, 32, 60, 2
    w13, w2, rw = weights(E, D, I, seed=1)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    r = route(x, rw, k)
    plan = MoEPlan(GemmPlan(16, 16, 16, 4, 4, 1), GemmPlan(16, 16, 16, 4, 4, 1))
    out = fused_experts(x, r, w13, w2, plan)
    assert torch.allclose(out, experts_local(x, r, w13, w2), atol=1e-4)


def test_align_blocks_layout():
    E, k, T, bm = 6, 2, 11, 4
    x = torch.randn(T, 8)
    r = route(x, torch.randn(E, 8), k)
    sorted_ids, block_expert, num_post = align_blocks(r, bm)
    N = T * k
    P = sorted_ids.numel()
    assert P % bm == 0 and P >= N
    used = int(num_post)
    ids = sorted_ids[:used].tolist()
    real = [i for i in ids if i < N]
    assert sorted(real) == list(range(N))                       # every pair exactly once
    assert all(i == N for i in sorted_ids[used:].tolist())      # beyond num_post: padding only
    flat = r.topk_idx.reshape(-1)
    for b in range(used // bm):
        blk = [i for i in ids[b * bm:(b + 1) * bm] if i < N]
        assert blk, "no empty block below num_post"
        assert all(int(flat[i]) == int(block_expert[b]) for i in blk)


def test_fused_is_batch_invariant():
    E, D, I, k = 8, 32, 32, 2
    w13, w2, rw = weights(E, D, I, seed=2)
    x = torch.randn(24, D, generator=torch.Generator().manual_seed(3))
    full = fused_experts(x, route(x, rw, k), w13, w2)
    part = fused_experts(x[5:9], route(x[5:9], rw, k), w13, w2)
    assert torch.equal(full[5:9], part)


@pytest.mark.parametrize("T,E,k,norm", [(1, 128, 8, True), (37, 128, 8, True), (5, 60, 4, False), (9, 16, 1, True),
                                        (0, 8, 2, True)])
def test_fused_softmax_router_equals_the_torch_router(T, E, k, norm):
    """The one-launch softmax top-k (``fused_softmax_route``) against ``engine.routing.route``:
    the same experts in the same (descending) order, the same weights and receive counts."""
    from ainfer_pd.engine.fused_moe import fused_softmax_route
    from ainfer_pd.engine.model.routing import RouterSpec
    from ainfer_pd.engine.model.routing import route as torch_route
    D = 64
    g = torch.Generator().manual_seed(T * 31 + E)
    x = torch.randn(T, D, generator=g)
    rw = torch.randn(E, D, generator=g)
    ref = torch_route(x, rw, RouterSpec("softmax", k, norm_topk_prob=norm))
    got = fused_softmax_route(x, rw, k, norm)
    assert torch.equal(got.topk_idx, ref.topk_idx)
    assert torch.allclose(got.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(got.counts, ref.counts) and got.counts.dtype == torch.int64
    if T:
        assert torch.equal(got.order, ref.order)


def test_fused_softmax_router_breaks_exact_ties_by_the_lowest_expert_id():
    from ainfer_pd.engine.fused_moe import fused_softmax_route
    E, D = 16, 8
    rw = torch.zeros(E, D)
    rw[3] = rw[9] = rw[12] = 1.0                  # experts 3, 9 and 12 score exactly alike
    got = fused_softmax_route(torch.ones(2, D), rw, 2)
    assert got.topk_idx.tolist() == [[3, 9], [3, 9]]
    assert torch.allclose(got.topk_weights, torch.full((2, 2), 0.5))


def test_gate_router_check_accepts_either_expert_of_a_tie_and_refuses_a_wrong_choice():
    """The gate's router check (benchmarks/_gate_cases.topk_choice_error) compares a choice by the
    probabilities it took: both orders of an exact tie pass, a non-top-k expert or a repeat fails."""
    from benchmarks._gate_cases import topk_choice_error
    probs = torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.7, 0.2, 0.05, 0.05]], dtype=torch.float64)
    w = torch.tensor([[0.5, 0.5], [0.7 / 0.9, 0.2 / 0.9]])
    for idx in ([[1, 3], [0, 1]], [[3, 1], [0, 1]]):
        gap, werr = topk_choice_error(torch.tensor(idx), w, probs, norm=True)
        assert gap == 0.0 and werr < 1e-7
    gap, _ = topk_choice_error(torch.tensor([[1, 2], [0, 1]]), w, probs, norm=True)
    assert gap > 0.29
    _, werr = topk_choice_error(torch.tensor([[1, 3], [0, 1]]), w.flip(-1), probs, norm=True)
    assert werr > 0.5
    assert topk_choice_error(torch.tensor([[1, 1], [0, 1]]), w, probs, norm=True)[0] == float("inf")


@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (3, 8, 2), (1, 8, 8)])
def test_a_direct_plan_needs_no_layout_and_matches_the_aligned_one(T, E, k):
    """``MoEPlan.direct``: each pair its own row block, the expert read from the routing (no align /
    scatter launches): the reference's result, and a token decoding alone gets the aligned plan's
    bits (the same tiles over the same K steps, one row of the block used)."""
    D, I = 32, 48
    w13, w2, rw = weights(E, D, I, seed=4)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(11))
    r = route(x, rw, k)
    tiles = (GemmPlan(16, 16, 16, 1, 4, 1), GemmPlan(16, 16, 16, 1, 4, 1))
    direct = fused_experts(x, r, w13, w2, MoEPlan(*tiles, direct=True))
    ref = experts_local(x, r, w13, w2)
    assert (direct - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    aligned = fused_experts(x, r, w13, w2, MoEPlan(*tiles))
    assert torch.equal(direct, aligned)
    with pytest.raises(AssertionError, match="row groups"):
        fused_experts(x, r, w13, w2, MoEPlan(GemmPlan(16, 16, 16, 4, 4, 1), GemmPlan(16, 16, 16, 4, 4, 1), direct=True))


def test_a_token_alone_takes_the_direct_plan_with_the_small_tiles():
    from ainfer_pd.engine.fused_moe import moe_plan
    alone, small = moe_plan(8, 128, False, tokens=1), moe_plan(8, 128, False)
    assert alone.direct and not small.direct and (alone.gate_up, alone.down) == (small.gate_up, small.down)
    assert not moe_plan(16, 128, False, tokens=2).direct and not moe_plan(8, 128, True, tokens=1).direct


@pytest.mark.parametrize("direct", [False, True])
def test_padding_rows_route_nowhere_and_real_rows_are_unchanged(direct):
    """A graph bucket's (or a replica's) padding rows write the scratch slot: given the rows' slots
    and that slot, the fused router routes them nowhere (expert -1, weight 0, no receive count), the
    experts run for the real rows only, whose outputs are bitwise those of the same batch routed
    whole, and the padding rows' outputs are 0. A padding row alone (a replica with no rows) runs
    the direct plan with nothing to do."""
    from ainfer_pd.engine.fused_moe import fused_softmax_route
    E, D, I, k, T, scratch = 16, 32, 48, 4, 11, 999
    w13, w2, rw = weights(E, D, I, seed=5)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(13))
    slots = torch.arange(T, dtype=torch.int64)
    pad_rows = [3, 7, 8, 10]
    slots[pad_rows] = scratch
    live = [i for i in range(T) if i not in pad_rows]
    r = fused_softmax_route(x, rw, k, True, (slots, scratch))
    full = fused_softmax_route(x, rw, k, True)
    assert r.padded and not full.padded
    assert (r.topk_idx[pad_rows] == -1).all() and (r.topk_weights[pad_rows] == 0).all()
    assert torch.equal(r.topk_idx[live], full.topk_idx[live])
    assert torch.equal(r.counts, torch.bincount(full.topk_idx[live].reshape(-1), minlength=E))
    tiles = (GemmPlan(16, 16, 16, 1, 4, 1), GemmPlan(16, 16, 16, 1, 4, 1))
    out = fused_experts(x, r, w13, w2, MoEPlan(*tiles, direct=direct))
    routed_all = fused_experts(x, full, w13, w2, MoEPlan(*tiles, direct=direct))
    assert torch.equal(out[live], routed_all[live]) and (out[pad_rows] == 0).all()
    one = fused_softmax_route(x[:1], rw, k, True, (torch.tensor([scratch]), scratch))
    assert (fused_experts(x[:1], one, w13, w2) == 0).all() and int(one.counts.sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,D", [(5, 8, 48), (3, 2, 2048), (1, 4, 1500)])
def test_moe_sum_adds_each_token_s_rows_in_slot_order_in_float32(T, k, D, dtype):
    """The k rows of a token, added one after the other in float32 and rounded once (the same
    bits alone or in any batch); D past one column block and not a power of two."""
    g = torch.Generator().manual_seed(T * k + D)
    rows = (torch.randn(T * k, D, generator=g) * 3).to(dtype)
    want = torch.zeros(T, D, dtype=torch.float32)
    for j in range(k):
        want += rows.view(T, k, D)[:, j].float()
    got = moe_sum(rows, T, k)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:                    # Triton's interpreter rounds float32 -> bfloat16 toward zero: within one ulp
        torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(moe_sum(rows[k:2 * k], 1, k), got[1:2]) if T > 1 else True
    assert torch.equal(moe_sum(rows, T, k, torch.float32), want)


def test_moe_sum_skips_the_pairs_routed_nowhere_without_reading_their_rows():
    """A padded batch's padding pairs (expert -1) were never written: whatever their rows hold
    (NaN here), the token's sum is the sum of its other rows, and a token of padding pairs only is 0."""
    T, k, D = 4, 3, 40
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(T * k, D, generator=g)
    ids = torch.randint(0, 8, (T, k), generator=g)
    ids[1, 2] = -1
    ids[3] = -1
    skip = (ids.reshape(-1) < 0)
    rows[skip] = float("nan")
    got = moe_sum(rows, T, k, ids=ids)
    want = torch.where(skip[:, None], 0.0, rows).view(T, k, D)
    acc = torch.zeros(T, D)
    for j in range(k):
        acc += want[:, j]
    assert torch.equal(got, acc) and torch.equal(got[3], torch.zeros(D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_adds_the_residual_before_its_one_rounding(dtype):
    """``residual`` joins each token's float32 sum after its k rows (padding pairs skipped as without
    it), rounded once: in float32 the same bits as adding it after."""
    T, k, D = 4, 3, 40
    g = torch.Generator().manual_seed(5)
    rows = (torch.randn(T * k, D, generator=g) * 2).to(dtype)
    res = (torch.randn(T, D, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 8, (T, k), generator=g)
    ids[2, 1] = -1
    got = moe_sum(rows, T, k, ids=ids, residual=res)
    acc = torch.zeros(T, D)
    for j in range(k):
        acc += torch.where((ids[:, j] < 0)[:, None], 0.0, rows.view(T, k, D)[:, j].float())
    acc += res.float()
    if dtype == torch.float32:
        assert torch.equal(got, acc)
    else:
        torch.testing.assert_close(got.float(), acc.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


def test_fused_experts_with_the_residual_is_the_residual_plus_the_experts():
    """The residual stream added inside the k-slot sum equals adding it to the experts' output
    (float32), and an empty batch returns the residual."""
    T, E, k, D, I = 9, 8, 2, 64, 96
    w13, w2, rw = weights(E, D, I)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, D, generator=g)
    res = torch.randn(T, D, generator=g)
    r = route(x, rw, k)
    torch.testing.assert_close(fused_experts(x, r, w13, w2, residual=res), res + fused_experts(x, r, w13, w2),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_local(x, r, w13, w2, residual=res), res + experts_local(x, r, w13, w2))
    empty = route(x[:0], rw, k)
    assert torch.equal(fused_experts(x[:0], empty, w13, w2, residual=res[:0]), res[:0])
