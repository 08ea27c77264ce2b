"""The blockwise-FP8 Triton kernels (engine/quant/fp8_kernels.py, run on CPU under
TRITON_INTERPRET=1: conftest) against their torch oracles in engine/quant/fp8.py.

* Activation quantization: bit-exact (scales and e4m3 bytes), including every e4m3 value and
  every midpoint between two (ties to even, carries into the exponent, subnormals, -0.0).
* The FP8 GEMM and the FP8 fused MoE: the same quantized operands as the oracle, so they differ
  only by float32 summation order (and the act quantization of values that order moves across a
  rounding midpoint): relative error ||out - ref|| / ||ref|| <= 1e-4 with float32 outputs, 1e-2
  with bf16 ones. Weights get a different power-of-two magnitude per 128 x 128 block (and the
  activations per 1 x 128 group), so a scale read from the wrong block is an O(1) error.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ainfer_pd.engine.fused_moe import align_blocks_triton
from ainfer_pd.engine.fused_moe.plan import GemmPlan, MoEPlan
from ainfer_pd.engine.model.moe import route, routing_of
from ainfer_pd.engine.quant import fp8
from ainfer_pd.engine.quant.fp8_ops import (fp8_gemm, fp8_linear, fused_experts_fp8, launch_fp8_down, launch_fp8_gate_up,
                                            per_token_group_quant)
from ainfer_pd.engine.quant.fp8_plan import (Fp8MoEPlan, as_fp8_moe_plan, check_fp8_moe_plan, check_fp8_plan,
                                             fp8_gemm_plan, fp8_moe_plan, fuses_act_quant)
from ainfer_pd.errors import CheckpointError, ConfigError

F32, BF16 = torch.float32, torch.bfloat16
# The interpreter evaluates tl.sigmoid as 1 / (1 + exp(-g)) in numpy: exp overflows (to inf, the
# right limit: silu(g) -> -0) for gates below -88, which these wide-range activations reach.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def blocky(shape, seed: int, rows: int = 128) -> torch.Tensor:
    """Gaussian [..., N, K] (scaled by K^-1/2) times 2^j, j in [-3, 3], drawn per rows x 128 block."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    w = torch.randn(*shape, generator=g) * k ** -0.5
    f = 2.0 ** torch.randint(-3, 4, (*lead, fp8.blocks(n, rows), fp8.blocks(k)), generator=g).float()
    return w * f.repeat_interleave(rows, -2).repeat_interleave(128, -1)[..., :n, :k]


def activations(T: int, K: int, dtype, seed: int) -> torch.Tensor:
    """x [T, K]: a different magnitude per token and per 128-column group."""
    if T == 0:
        return torch.zeros(0, K, dtype=dtype)
    return (blocky((T, K), seed, rows=1) * K ** 0.5 * 4).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == fp8.FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------------- activation quantization
@pytest.mark.parametrize("T,K,dtype", [(0, 256, F32), (1, 128, F32), (5, 200, F32), (33, 300, BF16),
                                       (3, 1000, torch.float16)])
def test_activation_quant_is_bit_exact(T, K, dtype):
    x = activations(T, K, dtype, seed=T + K)
    if T > 2:
        x[1] = 0                                           # all-zero groups: the 1e-12 scale floor
        x[2, :5] = torch.tensor([1e-30, -1e-30, 3e-38, -0.0, 0.0]).to(dtype)
    q, s = per_token_group_quant(x)
    rq, rs = fp8.quantize_token_groups(x)
    assert q.shape == (T, K) and s.shape == (T, fp8.blocks(K)) and s.dtype == F32
    assert torch.equal(s, rs)
    assert same_bytes(q, rq)


def test_activation_quant_rounds_every_e4m3_midpoint_like_torch():
    """Groups whose amax is 448 have scale 1: the kernel's cast itself is compared, on every e4m3
    value, every midpoint between neighbours (ties to even; 127.94 -> 128 carries into the
    exponent), and just above and below each midpoint."""
    vals = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    eps = mids.abs() * 1e-6
    x = torch.cat([vals, mids, mids + eps, mids - eps, torch.tensor([-0.0, 127.9366, -127.9366, 447.9])])
    x = torch.cat([x, torch.zeros(-len(x) % 127)]).view(-1, 127)
    x = torch.cat([torch.full((x.shape[0], 1), 448.0), x], dim=1)          # amax 448 in every group
    q, s = per_token_group_quant(x)
    rq, rs = fp8.quantize_token_groups(x)
    assert torch.equal(s, torch.ones_like(s)) and torch.equal(s, rs)
    assert same_bytes(q, rq)


# ---------------------------------------------------------------------------- dense GEMM
@pytest.mark.parametrize("M,N,K,dtype,bias", [(1, 200, 300, F32, True), (19, 130, 257, F32, False),
                                              (19, 130, 257, BF16, True), (0, 64, 128, F32, True),
                                              (70, 256, 384, F32, False)])
def test_fp8_linear_matches_reference(M, N, K, dtype, bias):
    x = activations(M, K, dtype, seed=M)
    wq, ws = fp8.quantize_blockwise(blocky((N, K), seed=N))
    b = torch.randn(N).to(dtype) if bias else None
    y = fp8_linear(x, wq, ws, b)
    ref = fp8.fp8_linear_reference(x, wq, ws, b)
    assert y.shape == (M, N) and y.dtype == dtype
    if M:
        assert rel_err(y, ref) <= (1e-4 if dtype == F32 else 1e-2)


@pytest.mark.parametrize("plan", [GemmPlan(16, 32, 64, 2, 4, 1), GemmPlan(32, 16, 32, 3, 4, 1),
                                  GemmPlan(16, 128, 128, 1, 4, 1)])
def test_fp8_gemm_tiles_smaller_than_a_scale_block(plan):
    """K steps of 32 / 64 (several steps per scale column), tiles that straddle weight blocks
    (N tile 16 or 32 against 128-row blocks), grouped programs; leading dims on x."""
    x = activations(2 * 23, 300, F32, seed=5)
    wq, ws = fp8.quantize_blockwise(blocky((150, 300), seed=6))
    bias = torch.randn(150)
    y = fp8_linear(x.view(2, 23, 300), wq, ws, bias, plan=plan)
    assert y.shape == (2, 23, 150)
    assert rel_err(y.view(46, 150), fp8.fp8_linear_reference(x, wq, ws, bias)) <= 1e-4


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fp8_linear_quantizing_on_load_gives_the_launchs_bytes(dtype):
    """x quantized inside the GEMM (one launch) or by its own launch: bit-equal outputs (partial
    last group, partial row and column tiles); on load needs K steps of one whole group."""
    x = activations(19, 257, dtype, seed=3)
    wq, ws = fp8.quantize_blockwise(blocky((130, 257), seed=4))
    plan = GemmPlan(16, 32, 128, 1, 4, 1)
    y = fp8_linear(x, wq, ws, plan=plan, quant_on_load=True)
    assert torch.equal(y, fp8_linear(x, wq, ws, plan=plan, quant_on_load=False))
    assert rel_err(y, fp8.fp8_linear_reference(x, wq, ws)) <= (1e-4 if dtype == F32 else 1e-2)
    with pytest.raises(ValueError, match="on load"):
        fp8_linear(x, wq, ws, plan=GemmPlan(16, 32, 64, 1, 4, 1), quant_on_load=True)


def test_fp8_gemm_rejects_bad_operands():
    wq, ws = fp8.quantize_blockwise(torch.randn(130, 256))
    xq, xs = per_token_group_quant(torch.randn(4, 256))
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        fp8_gemm(xq, xs, wq, ws[:1])
    with pytest.raises(ValueError, match="K"):
        fp8_gemm(xq[:, :128], xs[:, :1], wq, ws)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_gemm(xq, xs, wq.t().contiguous().t(), ws)
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm(xq, xs, wq, ws, plan=GemmPlan(16, 32, 256, 1, 4, 1))


# ---------------------------------------------------------------------------- fused MoE
def expert_weights(E: int, D: int, inter: int, seed: int):
    """(w13_q [E, 2I, D], w13_scale, w2_q [E, D, I], w2_scale): gate and up with their own block magnitudes."""
    w13_q, w13_s = fp8.quantize_w13(blocky((E, inter, D), seed), blocky((E, inter, D), seed + 1))
    w2_q, w2_s = fp8.quantize_blockwise(blocky((E, D, inter), seed + 2))
    return w13_q, w13_s, w2_q, w2_s


# The paths (fp8_plan's flags): x and act quantized by launches of their own (a plain MoEPlan:
# act by a second launch when gate_up's block_n is not 128, in its epilogue when it is), on load
# by the GEMM that reads them, mixed, and down folding the k-slot sum.
UNFUSED = MoEPlan(GemmPlan(16, 32, 64, 2, 4, 1), GemmPlan(16, 64, 128, 2, 4, 1))
FUSED = MoEPlan(GemmPlan(16, 128, 128, 1, 4, 1), GemmPlan(16, 128, 64, 1, 4, 1))
LOAD = Fp8MoEPlan(GemmPlan(16, 32, 128, 2, 4, 1), GemmPlan(16, 64, 128, 2, 4, 1))
LOAD_FOLD = Fp8MoEPlan(GemmPlan(16, 32, 128, 2, 4, 1), GemmPlan(16, 64, 128, 2, 4, 1), fold_sum=True)
X_LOAD_ACT_EPILOGUE = Fp8MoEPlan(GemmPlan(32, 128, 128, 1, 4, 1), GemmPlan(32, 32, 64, 1, 4, 1),
                                 quant_act_on_load=False, fold_sum=True)
X_LAUNCH_ACT_LOAD = Fp8MoEPlan(GemmPlan(16, 64, 32, 1, 4, 1), GemmPlan(16, 32, 128, 1, 4, 1), quant_x_on_load=False)
# Swapped operands (the weight tile as the MMA's M side, the products transposed): separate
# launches with act quantized apart (the decode table's kind), in the gate_up epilogue with 64-
# column K steps in down, and quantized on load with the k-slot fold.
SWAP = Fp8MoEPlan(GemmPlan(16, 64, 128, 1, 4, 1), GemmPlan(16, 64, 128, 1, 4, 1), quant_x_on_load=False,
                  quant_act_on_load=False, swap_ab=True)
SWAP_FUSED = Fp8MoEPlan(GemmPlan(16, 128, 128, 1, 4, 1), GemmPlan(16, 64, 64, 1, 4, 1), quant_x_on_load=False,
                        quant_act_on_load=False, swap_ab=True)
SWAP_LOAD_FOLD = Fp8MoEPlan(GemmPlan(32, 64, 128, 1, 4, 1), GemmPlan(32, 128, 128, 1, 4, 1), fold_sum=True,
                            swap_ab=True)


def moe_case(T, E, k, D, inter, dtype):
    """Weights, x and routing drawn from seeds of the case (the routing too: drawn from the global
    generator, it depended on the tests run before; see test_a_tokens_output_does_not_depend_on_its_batch)."""
    ws = expert_weights(E, D, inter, seed=T + E)
    x = activations(T, D, dtype, seed=k)
    router = torch.randn(E, D, generator=torch.Generator().manual_seed(T * 100 + E)).to(dtype)
    return x, route(x, router, k), ws


@pytest.mark.parametrize("T,E,k,D,inter,dtype,plan", [
    (1, 8, 1, 200, 96, F32, None),                  # decode (the table: both on load): one row, 7 idle experts
    (1, 8, 1, 200, 96, F32, LOAD_FOLD),
    (3, 16, 2, 256, 130, F32, None),                # most experts idle; I one past a block
    (0, 4, 2, 128, 64, F32, None),                  # no tokens
    (0, 4, 2, 128, 64, F32, LOAD_FOLD),
    (40, 4, 2, 160, 136, F32, UNFUSED),             # 20 rows per expert: 2 row blocks each; act quantized apart
    (40, 4, 2, 160, 136, F32, FUSED),               # act quantized in the gate_up epilogue
    (40, 4, 2, 160, 136, F32, LOAD),                # x and act quantized on load
    (40, 4, 2, 160, 136, F32, X_LOAD_ACT_EPILOGUE),  # 32-row blocks, fold
    (9, 8, 3, 160, 200, BF16, FUSED),               # bf16 activations, top-3
    (9, 8, 3, 160, 200, BF16, LOAD_FOLD),
    (9, 8, 3, 160, 200, BF16, X_LAUNCH_ACT_LOAD),
    (1, 8, 1, 200, 96, F32, SWAP),                  # swapped: decode, partial K step and column tile
    (3, 16, 2, 256, 130, BF16, SWAP),
    (40, 4, 2, 160, 136, F32, SWAP_FUSED),          # 2 row blocks per expert, act quantized in the epilogue
    (40, 4, 2, 256, 256, F32, SWAP_FUSED),          # K a multiple of block_k (EVEN_K), whole column tiles
    (40, 4, 2, 160, 136, F32, SWAP_LOAD_FOLD),
    (9, 8, 3, 160, 200, BF16, SWAP_LOAD_FOLD),
])
def test_fused_experts_fp8_matches_reference(T, E, k, D, inter, dtype, plan):
    x, r, ws = moe_case(T, E, k, D, inter, dtype)
    out = fused_experts_fp8(x, r, *ws, plan=plan)
    ref = fp8.experts_fp8_reference(x, r.topk_idx, r.topk_weights, *ws)
    assert out.shape == (T, D) and out.dtype == dtype
    if T:
        assert rel_err(out, ref) <= (1e-4 if dtype == F32 else 1e-2)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_quantizing_on_load_gives_the_separate_launches_bytes(dtype):
    """The same tiles with x and act quantized on load or by launches of their own: the GEMMs see
    the same e4m3 bytes and scales, so the outputs are equal bit for bit; folding the k-slot sum
    into down changes only the summation (float32 rows, slot order): within 1e-6 with float32 x."""
    x, r, ws = moe_case(9, 6, 3, 200, 136, dtype)
    launched = fused_experts_fp8(x, r, *ws, plan=dataclasses.replace(LOAD, quant_x_on_load=False,
                                                                       quant_act_on_load=False))
    on_load = fused_experts_fp8(x, r, *ws, plan=LOAD)
    assert torch.equal(on_load, launched)
    folded = fused_experts_fp8(x, r, *ws, plan=LOAD_FOLD)
    assert rel_err(folded, on_load) <= (1e-6 if dtype == F32 else 1e-2)
    assert rel_err(folded, fp8.experts_fp8_reference(x, r.topk_idx, r.topk_weights, *ws)) <= (1e-4 if dtype == F32
                                                                                                 else 1e-2)


@pytest.mark.parametrize("plan", [LOAD, LOAD_FOLD, SWAP_LOAD_FOLD], ids=["load", "fold", "swap_fold"])
def test_a_tokens_output_does_not_depend_on_its_batch(plan):
    """Token rows taken out of a batch of 9 into one of 4 (other row blocks, other programs,
    with fold another last arriver): their outputs are bit-equal. Under the interpreter tl.dot is
    numpy's matmul, whose BLAS rounds a row by its position in the tile for some routings (1 ulp;
    a GPU MMA does not): the case's routing is seeded (moe_case), not the global generator's."""
    x, r, ws = moe_case(9, 6, 3, 160, 96, F32)
    sub = torch.tensor([8, 0, 5, 3])
    rs = routing_of(r.topk_idx[sub], r.topk_weights[sub], 6)
    assert torch.equal(fused_experts_fp8(x[sub], rs, *ws, plan=plan), fused_experts_fp8(x, r, *ws, plan=plan)[sub])


def test_gate_up_zeroes_the_fold_counters():
    """The fold's counters come from torch.empty: gate_up zeroes them (here filled with garbage
    first), and down leaves each at k (every pair counted once)."""
    x, r, (w13_q, w13_s, w2_q, w2_s) = moe_case(5, 4, 2, 160, 96, F32)
    layout = align_blocks_triton(r, LOAD_FOLD.block_m)
    ncnt = fp8.blocks(160, 64)
    counters = torch.full((5, ncnt), 7, dtype=torch.int32)
    act, act_s = launch_fp8_gate_up(x, None, w13_q, w13_s, layout, 2, LOAD_FOLD, counters)
    assert act.dtype == F32 and act_s is None and torch.equal(counters, torch.zeros_like(counters))
    rows, out = torch.empty(10, 160), torch.empty(5, 160)
    launch_fp8_down(act, None, w2_q, w2_s, rows, layout, r.topk_weights.reshape(-1), LOAD_FOLD.down, 2, (counters, out))
    assert torch.equal(counters, torch.full_like(counters, 2))
    assert torch.allclose(out, rows.view(5, 2, 160).sum(1), rtol=1e-6, atol=0)


def test_fused_experts_fp8_rejects_the_bf16_layout():
    """w13 [E, D, 2I] (the bf16 kernels' layout) is refused, not silently misread."""
    E, D, inter = 4, 160, 64
    w13_q, w13_s, w2_q, w2_s = expert_weights(E, D, inter, seed=0)
    x = torch.randn(2, D)
    r = route(x, torch.randn(E, D), 2)
    with pytest.raises(ValueError, match="w13"):
        fused_experts_fp8(x, r, w13_q.transpose(1, 2).contiguous(), w13_s, w2_q, w2_s)
    with pytest.raises(ValueError, match="contiguous"):
        fused_experts_fp8(x, r, w13_q, w13_s, w2_q.transpose(1, 2).contiguous().transpose(1, 2), w2_s)


def test_fp8_plan_table():
    """Every size quantizes by launches of its own (on load measured slower on the H200); medium sizes
    quantize act in the gate_up epilogue, prefill (64-column gate_up tiles, 3 CTAs an SM: faster on the
    H100) by a launch of its own; every K step within one scale column; on load needs K steps of 128."""
    decode, medium, prefill = fp8_moe_plan(8, 128), fp8_moe_plan(32 * 128, 128), fp8_moe_plan(8 * 8192, 128)
    assert decode.block_m <= 16 < prefill.block_m
    assert not (decode.quant_x_on_load or decode.quant_act_on_load or decode.fold_sum)
    assert decode.swap_ab and not prefill.swap_ab
    assert not medium.quant_x_on_load and fuses_act_quant(medium)
    assert not (prefill.quant_x_on_load or prefill.quant_act_on_load) and not fuses_act_quant(prefill)
    assert prefill.gate_up.block_n == 64 and prefill.gate_up.num_warps == 4
    # 4 stages up to 128 rows an expert (H100: faster at 2,048 tokens, slower at 8,192), else 3; nothing else differs
    short = fp8_moe_plan(8 * 2048, 128)
    assert (short.gate_up.num_stages, prefill.gate_up.num_stages) == (4, 3)
    assert dataclasses.replace(short.gate_up, num_stages=3) == prefill.gate_up and short.down == prefill.down
    assert fp8_moe_plan(8 * 2048 + 1, 128).gate_up.num_stages == 3
    assert fp8_gemm_plan(1).block_m <= 16 < fp8_gemm_plan(8192).block_m
    for n in (1, 64, 1024, 65536):
        check_fp8_moe_plan(fp8_moe_plan(n, 128))
        check_fp8_plan(fp8_gemm_plan(n))
    for bad in (256, 96, 16):
        with pytest.raises(ValueError):
            check_fp8_plan(GemmPlan(16, 64, bad, 1, 4, 1))
    with pytest.raises(ValueError, match="on load"):
        check_fp8_plan(GemmPlan(16, 64, 64, 1, 4, 1), on_load=True)
    for bad_n in (96, 256):                            # one weight scale row per column tile
        with pytest.raises(ConfigError, match="block_n"):
            check_fp8_plan(GemmPlan(16, bad_n, 128, 1, 4, 1))
    with pytest.raises(ValueError, match="block_m"):
        check_fp8_moe_plan(Fp8MoEPlan(GemmPlan(16, 32, 128, 1, 4, 1), GemmPlan(32, 32, 128, 1, 4, 1)))
    with pytest.raises(ConfigError, match="gate_up.block_n"):
        check_fp8_moe_plan(Fp8MoEPlan(GemmPlan(16, 32, 128, 1, 4, 1), GemmPlan(16, 64, 128, 1, 4, 1), swap_ab=True))
    old = as_fp8_moe_plan(UNFUSED)
    assert (old.gate_up, old.down) == (UNFUSED.gate_up, UNFUSED.down)
    assert not (old.quant_x_on_load or old.quant_act_on_load or old.fold_sum)
    assert as_fp8_moe_plan(LOAD) is LOAD


@pytest.mark.parametrize("plan", [SWAP, LOAD_FOLD, SWAP_LOAD_FOLD], ids=["swap", "fold", "swap_fold"])
@pytest.mark.parametrize("T", [1, 3])
def test_a_direct_plan_gives_the_aligned_plans_bits(plan, T):
    """``direct``: each pair its own row block, its expert read from the routing (no layout launches);
    the same tiles over the same K steps, so the aligned plan's output bit for bit (the fold's last
    arriver sums the same rows in slot order). A token alone gets a direct plan by default."""
    x, r, ws = moe_case(T, 8, 2 if T > 1 else 4, 200, 96, F32)
    direct = dataclasses.replace(plan, gate_up=dataclasses.replace(plan.gate_up, group_m=1),
                                 down=dataclasses.replace(plan.down, group_m=1))
    aligned = fused_experts_fp8(x, r, *ws, plan=direct)
    assert torch.equal(fused_experts_fp8(x, r, *ws, plan=dataclasses.replace(direct, direct=True)), aligned)
    assert rel_err(aligned, fp8.experts_fp8_reference(x, r.topk_idx, r.topk_weights, *ws)) <= 1e-4
    assert fp8_moe_plan(4, 8, tokens=1).direct and not fp8_moe_plan(8, 8, tokens=2).direct
    with pytest.raises(ValueError, match="row groups"):
        check_fp8_moe_plan(dataclasses.replace(LOAD, direct=True))


@pytest.mark.parametrize("plan", [None, LOAD_FOLD, SWAP, SWAP_LOAD_FOLD, "direct"])
def test_padding_rows_run_no_fp8_expert_and_come_back_zero(plan):
    """A routing with padding rows (expert -1, weight 0: ``fused_softmax_route`` given the rows' KV
    slots): the real rows' outputs are bit-equal to the batch routed whole, the padding rows' are
    0, under separate launches, the k-slot fold (whose counters a padding row never reaches) and a
    direct plan."""
    from ainfer_pd.engine.fused_moe import fused_softmax_route
    T, E, k, D, inter, scratch = 9, 8, 3, 160, 96, 10_000
    x, _, ws = moe_case(T, E, k, D, inter, F32)
    router = torch.randn(E, D, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(T, dtype=torch.int64)
    pad_rows = [1, 4, 8]
    slots[pad_rows] = scratch
    live = [i for i in range(T) if i not in pad_rows]
    padded, whole = fused_softmax_route(x, router, k, True, (slots, scratch)), fused_softmax_route(x, router, k, True)
    if plan == "direct":
        plan = dataclasses.replace(SWAP, direct=True)
    out, ref = fused_experts_fp8(x, padded, *ws, plan=plan), fused_experts_fp8(x, whole, *ws, plan=plan)
    assert torch.equal(out[live], ref[live]) and (out[pad_rows] == 0).all()


@pytest.mark.parametrize("plan", [SWAP, LOAD_FOLD], ids=["moe_sum", "fold"])
@pytest.mark.parametrize("T", [0, 9])
def test_fused_experts_fp8_adds_the_residual(plan, T):
    """The residual stream joins the experts' output (in moe_sum's float32 sum, or after down's fold);
    the torch reference adds it after. An empty batch returns the residual."""
    x, r, ws = moe_case(T, 8, 3, 160, 200, F32)
    res = activations(T, 160, F32, seed=99)
    got = fused_experts_fp8(x, r, *ws, plan=plan, residual=res)
    torch.testing.assert_close(got, res + fused_experts_fp8(x, r, *ws, plan=plan), rtol=1e-5, atol=1e-5)
    from ainfer_pd.engine.model.linear import experts_fp8_torch
    if T:
        assert rel_err(got, experts_fp8_torch(x, r, *ws, residual=res)) <= 1e-4
