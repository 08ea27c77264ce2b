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


@pytest.mark.parametrize("tile", [(16, 32, 128, 1, 4, 1), (16, 64, 64, 2, 4, 1)])
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
