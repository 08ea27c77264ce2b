"""The paged attention kernels compiled for the H200 (sm_90) on this CPU machine: Triton's own
front end, its NVIDIA back end and ptxas run (in a child process without ``TRITON_INTERPRET``, which
the suite sets); no GPU is needed. What the interpreter cannot show is checked in the PTX:

* the kernels compile for sm_90 with bfloat16 queries on an FP8 (e4m3) pool, and on a bfloat16 one;
* the TMA prefill kernel (the long plan's) loads with TMA bulk copies and spills nothing;
* on the FP8 pool the K / V tiles widen to float16 in one conversion per pair of elements
  (``cvt.rn.f16x2.e4m3x2``) and the MMAs run in float16: no widening through float32 to
  bfloat16 (``cvt.f32.f16`` then ``cvt.rn.bf16x2.f32``, which bound the H200's FP8-pool decode
  attention at 1.87x its bytes) is left in the decode kernel;
* the FP8 fused MoE's kernels (``benchmarks/kernel_ptx_report.py``, specialized as the runtime
  specializes them: aligned pointers and strides, which pipelines the loads): the decode plan's
  gate_up and down run e4m3 wgmma (swapped operands) with no float16 widening of the weights and
  no spills (the 16-row tiles before ran ``mma.sync ... f16.f16`` after a ``cvt.rn.f16x2.e4m3x2``
  of every weight pair); prefill-size tiles spill nothing: the table's, and the 64 x 128 gate_up
  with 4 warps and the 128 x 128 tiles that spilled 408 / 700 bytes before the scalar weight scale;
  each K step's product takes its rows' scales in one FMA an element (the scales multiplied a row,
  not an element: the FP32 work beside the e4m3 MMAs).
"""
from __future__ import annotations

import pytest

from tests._ptx_child import compile_in_child

pytest.importorskip("triton")

_CHILD = r'''
import json, sys
from benchmarks.kernel_ptx_report import compile_stats, plan_stats
from ainfer_pd.engine.attention.triton_kernels import paged_decode_kernel, paged_prefill_kernel
from ainfer_pd.engine.attention.prologue_kernels import qkv_prologue_kernel
from ainfer_pd.engine.quant.fp8_plan import fp8_moe_plan

def ops(kernel, ptrs, const):
    try:
        return compile_stats(kernel, ptrs, {}, const, warps=4, stages=3)["ops"]
    except Exception as e:
        if "ptxas" in str(e).lower():
            print(json.dumps({"skip": str(e)[:300]})); sys.exit(0)
        raise

out = {}
for kv in ("fp8e4nv", "bf16"):
    ptr = {"Q": "*bf16", "O": "*bf16", "K": "*" + kv, "V": "*" + kv, "KV_SCALE": "*fp32", "scale_log2": "fp32",
           "OP": "*fp32", "LSE": "*fp32", **{n: "*i32" for n in ("TABLE", "LENS", "QSTART", "QLEN", "CTX", "TSEQ", "TM")}}
    fp8 = kv == "fp8e4nv"
    out["decode_" + kv] = ops(paged_decode_kernel, {**ptr, "LEAD": "*i32"},
                              dict(GROUP=8, M_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=64, SPLIT_KEYS=256,
                                   MAX_SPLITS=16, SINGLE=False, IEEE=False, KV_FP8=fp8, WIDTH=1))
    out["verify_" + kv] = ops(paged_decode_kernel, {**ptr, "LEAD": "*i32"},
                              dict(GROUP=8, M_PAD=32, HEAD_DIM=128, PAGE=16, BLOCK_N=64, SPLIT_KEYS=256,
                                   MAX_SPLITS=16, SINGLE=False, IEEE=False, KV_FP8=fp8, WIDTH=4))
    out["prefill_" + kv] = ops(paged_prefill_kernel, ptr,
                               dict(GROUP=8, HEAD_DIM=128, PAGE=16, BLOCK_M=64, BLOCK_N=64, IEEE=False, KV_FP8=fp8))
    pro = {**{n: "*bf16" for n in ("Q", "K", "V", "QW", "KW", "COS", "SIN")}, "KC": "*" + kv, "VC": "*" + kv,
           "SLOTS": "*i64", "KV_SCALE": "*fp32", "eps": "fp32"}
    out["prologue_" + kv] = compile_stats(qkv_prologue_kernel, pro, {}, dict(HEAD_DIM=128, HALF=64, QB=16, KB=4,
                                          HAS_NORM=True, KV_FP8=fp8, EXACT=False), warps=4, stages=1)
out["prologue_keep_k"] = compile_stats(qkv_prologue_kernel, pro, {}, dict(HEAD_DIM=128, HALF=64, QB=16, KB=4,
                                       HAS_NORM=True, KV_FP8=False, EXACT=False, KEEP_K=True), warps=4, stages=1)
from ainfer_pd.engine.attention.plan import LONG_PREFILL_TOKENS, prefill_plan
from ainfer_pd.engine.attention.triton_prefill_tma import prefill_tma_kernel
tp = prefill_plan(128, False, LONG_PREFILL_TOKENS, tma=True)
row = (32 + 2 * 4) * 128                   # q / k / v: views of the fused QKV output of Qwen3-30B-A3B's shape
out["prefill_tma"] = compile_stats(
    prefill_tma_kernel, {**dict.fromkeys(("Q", "KN", "VN", "K", "V", "O"), "*bf16"), "scale_log2": "fp32",
                         **dict.fromkeys(("TABLE", "QSTART", "QLEN", "CTX", "TSEQ", "TM"), "*i32")},
    {"stride_qt": row, "stride_knt": row, "stride_vnt": row, "stride_kn": 512, "stride_kh": 128, "stride_vn": 512,
     "stride_vh": 128, "stride_ot": 4096, "stride_oh": 128},
    dict(H=32, GROUP=8, HEAD_DIM=128, PAGE=16, BLOCK_M=tp.block_m, BLOCK_N=tp.block_n, IEEE=False, WS=False),
    tp.num_warps, tp.num_stages)

def moe(p, swap, direct=False):
    return plan_stats(p.block_m, p.block_n, p.block_k, p.group_m, p.num_warps, p.num_stages, swap, direct=direct)

decode, prefill, alone = fp8_moe_plan(8, 128), fp8_moe_plan(8 * 8192, 128), fp8_moe_plan(8, 128, tokens=1)
out["moe_decode"] = {"gate_up": moe(decode.gate_up, decode.swap_ab)["gate_up"],
                     "down": moe(decode.down, decode.swap_ab)["down"],
                     "gate_up direct": moe(alone.gate_up, alone.swap_ab, alone.direct)["gate_up"],
                     "down direct": moe(alone.down, alone.swap_ab, alone.direct)["down"]}
out["moe_prefill"] = {"gate_up": moe(prefill.gate_up, prefill.swap_ab)["gate_up"],
                      "down": moe(prefill.down, prefill.swap_ab)["down"]}
out["moe_gate_up_64x128_w4"] = plan_stats(64, 128, 128, 8, 4, 3)["gate_up"]

from ainfer_pd.engine.fused_moe import moe_plan
from ainfer_pd.engine.fused_moe.kernels import moe_down_kernel, moe_gate_up_kernel
for p in (moe_plan(8, 128, False, tokens=1), moe_plan(8 * 64, 128, False, tokens=64)):
    lay = dict.fromkeys(("SORTED", "BLOCK_EXPERT", "NUM_POST"), "*i64" if p.direct else "*i32")  # as launched
    c = dict(IEEE=False, DIRECT=p.direct)
    tiles = lambda g: dict(BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m)
    out["bf16_moe_direct" if p.direct else "bf16_moe_aligned"] = {
        "gate_up": compile_stats(moe_gate_up_kernel, {**lay, "X": "*bf16", "W": "*bf16", "ACT": "*bf16"}, {},
                                 dict(c, TOPK=8, **tiles(p.gate_up)), p.gate_up.num_warps, p.gate_up.num_stages),
        "down": compile_stats(moe_down_kernel, {**lay, "A": "*bf16", "W": "*bf16", "OUT": "*bf16", "TOPW": "*fp32"},
                              {}, dict(c, **tiles(p.down)), p.down.num_warps, p.down.num_stages)}
out["moe_128x128_w8"] = plan_stats(128, 128, 128, 8, 8, 3)
from ainfer_pd.engine.fused_moe.kernels import moe_sum_kernel
out["moe_sum"] = compile_stats(moe_sum_kernel, {"ROWS": "*bf16", "IDS": "*i64", "RES": "*bf16", "OUT": "*bf16"}, {},
                               dict(TOPK=8, BLOCK_D=1024, HAS_IDS=True, HAS_RES=True), warps=4, stages=1)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def ptx_ops() -> dict:
    return compile_in_child(_CHILD)


def _mmas(ops: dict) -> list[str]:
    """The matrix multiplies (mma.sync / wgmma.mma_async), not wgmma's fences and waits."""
    return [op for op in ops if "mma.sync" in op or "mma_async" in op]


@pytest.mark.parametrize("kernel", ["decode", "verify"])
def test_fp8_pool_decode_widens_to_float16_once_per_pair(ptx_ops, kernel):
    ops = ptx_ops[kernel + "_fp8e4nv"]
    assert ops.get("cvt.rn.f16x2.e4m3x2", 0) > 0
    assert ops.get("cvt.f32.f16", 0) == 0 and ops.get("cvt.rn.bf16x2.f32", 0) == 0, ops
    assert _mmas(ops) and all(".f16.f16." in op for op in _mmas(ops)), ops


def test_fp8_pool_prefill_runs_float16_mmas(ptx_ops):
    ops = ptx_ops["prefill_fp8e4nv"]
    assert ops.get("cvt.rn.f16x2.e4m3x2", 0) > 0 and _mmas(ops) and all(".f16.f16" in op for op in _mmas(ops)), ops


def test_bf16_pool_kernels_keep_bf16_mmas(ptx_ops):
    for name in ("decode_bf16", "verify_bf16", "prefill_bf16"):
        ops = ptx_ops[name]
        assert _mmas(ops) and all("bf16" in op for op in _mmas(ops)), ops
        assert ops.get("cvt.rn.f16x2.e4m3x2", 0) == 0, ops


def test_the_tma_prefill_kernel_loads_through_tma_without_spills(ptx_ops):
    """The long plan's TMA kernel (strided q / k / v views, the row stride a runtime argument): its
    own keys and queries load with TMA bulk copies, bf16 wgmma, nothing spilled; the prologue that
    keeps K for it spills nothing either."""
    s = ptx_ops["prefill_tma"]
    assert s["tma_loads"] > 0, s
    assert s["mma"] and all("wgmma" in m and "bf16" in m for m in s["mma"]), s
    assert s["spill"] == 0 and ptx_ops["prologue_keep_k"]["spill"] == 0, (s, ptx_ops["prologue_keep_k"])


def test_the_moe_sum_compiles_without_spills(ptx_ops):
    s = ptx_ops["moe_sum"]
    assert s["spill"] == 0 and s["regs"] > 0, s


def test_the_prologue_s_tiles_of_heads_compile_without_spills(ptx_ops):
    for kv in ("fp8e4nv", "bf16"):
        s = ptx_ops["prologue_" + kv]
        assert s["spill"] == 0 and s["regs"] > 0, s


def test_fp8_moe_decode_plan_runs_e4m3_wgmma_without_widening_or_spills(ptx_ops):
    for kernel, s in ptx_ops["moe_decode"].items():
        mmas = list(s["mma"])
        assert mmas and all(m.startswith("wgmma.mma_async") and m.endswith(".e4m3.e4m3") for m in mmas), (kernel, s)
        assert s["cvt_f16"] == 0 and s["spill"] == 0, (kernel, s)


def test_fp8_moe_prefill_tiles_spill_nothing(ptx_ops):
    tiles = {**{"table " + k: s for k, s in ptx_ops["moe_prefill"].items()},
             "gate_up 64x128 4 warps": ptx_ops["moe_gate_up_64x128_w4"],
             **{"128x128 " + k: s for k, s in ptx_ops["moe_128x128_w8"].items()}}
    # the 128 x 128 gate_up on 8 warps (no plan's: two accumulators and two products of 64 registers a thread)
    # sits at 255 registers and spills 40 bytes since each product takes one FMA (0 before, 408 before the
    # scalar weight scale): held under 64
    for name, s in tiles.items():
        assert s["spill"] <= (64 if name == "128x128 gate_up" else 0) and s["cvt_f16"] == 0, (name, s)
        assert s["mma"] and all(".e4m3.e4m3" in m for m in s["mma"]), (name, s)


def test_bf16_moe_kernels_compile_for_both_layouts(ptx_ops):
    """The bf16 fused MoE's kernels compile with the direct plan's int64 expert ids and the aligned
    plan's int32 layout (the interpreter does not type-check: a direct helper whose two returns
    differed in type compiled only on the GPU), each with its bf16 MMAs."""
    assert set(ptx_ops) >= {"bf16_moe_direct", "bf16_moe_aligned"}
    for name in ("bf16_moe_direct", "bf16_moe_aligned"):
        for kernel, s in ptx_ops[name].items():
            assert s["mma"] and all("bf16" in m for m in s["mma"]), (name, kernel, s)


def test_fp8_moe_scales_each_product_in_one_fma_an_element(ptx_ops):
    """Each K step's product times the rows' scales, added to the accumulator: one ``fma.rn.f32`` an
    element, the row scales multiplied once a row. With ``p * sa * sb`` (a multiply and an FMA an element)
    the prefill gate_up's K loop compiled to 64 ``mul.f32`` and 64 FMAs a thread a step, now 4 and 64
    (Triton 3.9, sm_90); the kernel's other multiplies are its SwiGLU epilogue's (96)."""
    for plan in ("moe_prefill", "moe_decode"):
        for kern in ("gate_up", "down"):
            ops = ptx_ops[plan][kern]["ops"]
            assert ops.get("fma.rn.f32", 0) > 0 and ops.get("mul.f32", 0) <= ops["fma.rn.f32"] + 40, (plan, kern, ops)
