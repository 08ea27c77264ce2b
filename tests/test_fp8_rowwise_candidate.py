"""The rowwise FP8 fused-MoE candidate (``benchmarks/fp8_rowwise_moe.py``; not in the engine) in the
interpreter: its row quantization equals its torch oracle byte for byte, and the fused MoE lands on
its dequantized oracle and near the unquantized experts, over a few tiles."""
import pytest
import torch

from ainfer_pd.engine.model.moe import route
from benchmarks import fp8_rowwise_moe as rw

CPU = torch.device("cpu")


def test_row_quantization_equals_its_oracle():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 3, 300)
    q, s = rw.quantize_rows(x)
    qr, sr = rw.quantize_rows_torch(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.parametrize("tile", [(16, 32, 128, 1, 4, 1), (16, 64, 64, 2, 4, 1), (16, 64, 128, 1, 4, 1, True)],
                         ids=["16x32", "16x64-k64", "swapped"])
def test_rowwise_fused_moe_matches_its_oracle(tile):
    g = torch.Generator().manual_seed(1)
    E, D, I, k, T = 4, 256, 256, 2, 11
    w13 = torch.randn(E, 2 * I, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, I, generator=g) * I ** -0.5
    w13q, w13s = rw.quantize_rows_torch(w13)
    w2q, w2s = rw.quantize_rows_torch(w2)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    r = route(x, torch.randn(E, D, generator=g).to(torch.bfloat16), k)
    out = rw.fused_experts_rowwise(x, r, w13q, w13s, w2q, w2s, tile)
    ref = rw.rowwise_reference(x, r, w13q, w13s, w2q, w2s)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rw._rel(out, ref) < 1e-2, rw._rel(out, ref)
    # against the unquantized experts (float32): e4m3's rounding, not a wrong product
    h = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = int(r.topk_idx[t, j])
            a = w13[e] @ x[t].float()
            h[t] += float(r.topk_weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(a[:I]) * a[I:]))
    assert rw._rel(out, h) < 8e-2, rw._rel(out, h)


def test_the_benchmark_runs_its_figures_on_a_tiny_shape():
    """The script's whole measuring path (``run``) at a tiny float32 shape, each call timed as 0: every
    figure present, both FP8 paths near the unquantized experts, the rowwise one on its oracle."""
    res = rw.run([24], CPU, lambda fn: (fn(), 0.0)[1], shape=(4, 256, 256, 2), dtype=torch.float32, budget_s=600,
                 tiles=((16, 32, 128, 1, 4, 1),))
    row = res[24]
    assert row["rowwise_best_tile"] == [16, 32, 128, 1, 4, 1]
    assert row["rowwise_rel_err_vs_oracle"] < 1e-2
    assert row["blockwise_rel_err_vs_bf16"] < 8e-2 and row["rowwise_rel_err_vs_bf16"] < 8e-2


def test_the_grouped_gemm_call_passes_torchs_own_checks():
    """The grouped variant's call (CUDA only) against torch's meta checks of ``_scaled_grouped_mm``:
    row-major A, the weights read column-major, scales [M] / [E, N], int32 offsets; the output shape."""
    meta = torch.device("meta")
    E, D, I, M = 8, 256, 128, 40
    a = torch.empty(M, D, dtype=rw.FP8, device=meta)
    out = rw.grouped_gemm(a, torch.empty(M, device=meta), torch.empty(E, 2 * I, D, dtype=rw.FP8, device=meta),
                          torch.empty(E, 2 * I, device=meta), torch.empty(E, dtype=torch.int32, device=meta))
    assert out.shape == (M, 2 * I) and out.dtype == torch.bfloat16


def test_the_grouped_variant_sorts_gathers_and_scatters_its_rows(monkeypatch):
    """grouped_parts' layout (sort by expert, int32 end offsets, gathers, the scatter back to pair order)
    with a CPU stand-in of torch's grouped GEMM (per expert segment, dequantized, bf16 out): it lands on
    the rowwise oracle as the Triton candidate does."""
    def stand_in(a, sa, w, ws, offs):
        out, lo = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16), 0
        for e, hi in enumerate(offs.tolist()):
            out[lo:hi] = ((a[lo:hi].float() * sa[lo:hi, None]) @ (w[e].float() * ws[e][:, None]).t()).bfloat16()
            lo = hi
        return out
    monkeypatch.setattr(rw, "grouped_gemm", stand_in)
    g = torch.Generator().manual_seed(2)
    E, D, I, k, T = 4, 256, 256, 2, 13
    w13q, w13s = rw.quantize_rows_torch(torch.randn(E, 2 * I, D, generator=g) * D ** -0.5)
    w2q, w2s = rw.quantize_rows_torch(torch.randn(E, D, I, generator=g) * I ** -0.5)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    r = route(x, torch.randn(E, D, generator=g).to(torch.bfloat16), k)
    parts, box = rw.grouped_parts(x, r, w13q, w13s, w2q, w2s)
    for p in parts:
        p()
    ref = rw.rowwise_reference(x, r, w13q, w13s, w2q, w2s)
    assert rw._rel(box["out"], ref) < 3e-2, rw._rel(box["out"], ref)    # h rounded to bf16 before act


_PTX_CHILD = r'''
import json
from benchmarks.kernel_ptx_report import DOWN_INTS, GATE_UP_INTS, compile_stats, plan_stats
from benchmarks import fp8_rowwise_moe as rw
lay = dict.fromkeys(("SORTED", "BLOCK_EXPERT", "NUM_POST"), "*i32")
bm, bn, bk, gm, warps, stages = 64, 128, 128, 8, 4, 3
t = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, SWAP_AB=False)
out = {"rowwise_gate_up": compile_stats(
           rw.rowwise_gate_up_kernel, {**lay, "XQ": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32",
                                       "ACT": "*fp32"},
           {"K": 2048, "I": 768, "stride_xt": 2048, "stride_we": 1536 * 2048, "stride_wn": 2048, "stride_wse": 1536,
            "stride_an": 768}, dict(TOPK=8, **t), warps, stages),
       "rowwise_down": compile_stats(
           rw.rowwise_down_kernel, {**lay, "AQ": "*fp8e4nv", "AS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32",
                                    "TOPW": "*bf16", "ROWS": "*bf16"},
           {"K": 768, "N": 2048, "stride_an": 768, "stride_we": 2048 * 768, "stride_wn": 768, "stride_wse": 2048,
            "stride_rn": 2048}, t, warps, stages),
       "blockwise": plan_stats(bm, bn, bk, gm, warps, stages, kernels=("gate_up",))["gate_up"]}
from ainfer_pd.engine.fused_moe.kernels import moe_gate_up_kernel
out["bf16_gate_up"] = compile_stats(       # the prefill plan's tile; stride_wn 1 specialized, as at launch
    moe_gate_up_kernel, {**lay, "X": "*bf16", "W": "*bf16", "ACT": "*bf16"},
    {"K": 2048, "I": 768, "stride_xt": 2048, "stride_we": 2048 * 1536, "stride_wk": 1536, "stride_an": 768},
    dict(IEEE=False, DIRECT=False, TOPK=8, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, stride_wn=1), 8, 4)
d = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SWAP_AB=True)
out["rowwise_gate_up_swapped"] = compile_stats(
    rw.rowwise_gate_up_kernel, {**lay, "XQ": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "ACT": "*fp32"},
    {"K": 2048, "I": 768, "stride_xt": 2048, "stride_we": 1536 * 2048, "stride_wn": 2048, "stride_wse": 1536,
     "stride_an": 768}, dict(TOPK=8, **d), 4, 4)
out["rowwise_down_swapped"] = compile_stats(
    rw.rowwise_down_kernel, {**lay, "AQ": "*fp8e4nv", "AS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "TOPW": "*bf16",
                             "ROWS": "*bf16"},
    {"K": 768, "N": 2048, "stride_an": 768, "stride_we": 2048 * 768, "stride_wn": 768, "stride_wse": 2048,
     "stride_rn": 2048}, d, 4, 4)
print(json.dumps(out))
'''


def test_the_rowwise_k_loop_keeps_an_mma_in_flight_where_the_blockwise_one_waits():
    """Compiled for sm_90 on this CPU (Triton's back end and ptxas, no GPU). The candidate's K loops run
    e4m3 wgmma and wait for all but one MMA group a dot (``wgmma.wait_group 1``; gate_up's two dots:
    ``2``), so the next step's MMAs issue while these are in flight; nothing spills. The engine's
    blockwise gate_up at the same tile waits for all of them every K step (``wait_group 0`` only): the
    tensor cores idle through its scaling. The engine's bf16 gate_up, specialized as it is launched
    (``stride_wn`` 1), keeps its MMAs in flight like the candidate (compiled with that stride a runtime
    value, it waited 0 every step: what ``docs/history.md`` once read as bf16 waiting the same way). A manual two-step software pipelining of the blockwise loop
    compiled to the same waits, and ``warp_specialize`` fails in Triton 3.9's pass on it for sm_90."""
    from tests._ptx_child import compile_in_child
    s = compile_in_child(_PTX_CHILD)
    for name in ("rowwise_gate_up", "rowwise_down", "rowwise_gate_up_swapped", "rowwise_down_swapped",
                 "bf16_gate_up"):
        k = s[name]
        assert k["mma"] and all("wgmma" in m and ("bf16" if name.startswith("bf16") else "e4m3") in m
                                for m in k["mma"]), k["mma"]
        assert any(int(n) >= 1 for n in k["wgmma_waits"]) and k["spill"] == 0, (name, k["wgmma_waits"], k["spill"])
    b = s["blockwise"]
    assert b["mma"] and set(b["wgmma_waits"]) == {"0"}, b["wgmma_waits"]
