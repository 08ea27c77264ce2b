"""The FP8 linear layer's cuBLASLt path (engine/quant/fp8_cublas.py): which shapes take it, the probe
that decides whether it runs at all, and the arguments it hands ``F.scaled_mm``.

The CPU has no blockwise-scaled GEMM (torch refuses ``BlockWise1x128`` there), so the argument test
runs ``F.scaled_mm``'s CPU stand-in below: it dequantizes exactly as cuBLASLt's documented layouts say
(activation scales outer-major [M, nb(K)], weight scales [nb(K), nb(N)], mat2 [K, N]) and refuses
any other layout. The GPU path beside it ran in ``benchmarks/fp8_dense_sweep.py`` (H100, f20a8d9:
this layout matched the oracle) and is checked by the gate's ``fp8_linear_cublas_*`` checks. The
activation quantization is the Triton kernel (TRITON_INTERPRET=1: conftest)."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ainfer_pd.engine.quant import fp8, fp8_cublas
from ainfer_pd.engine.quant.fp8_ops import fp8_linear, select_fp8_linear

BF16 = torch.bfloat16


def scaled_mm_stand_in(calls: list):
    """A CPU stand-in for ``F.scaled_mm`` with blockwise scales (the layouts cuBLASLt reads)."""
    st = F.ScalingType

    def scaled_mm(a, b, scale_a, type_a, scale_b, type_b, output_dtype):
        M, K = a.shape
        N = b.shape[1]
        assert a.dtype == b.dtype == fp8.FP8 and b.shape[0] == K
        assert (type_a, type_b) == (st.BlockWise1x128, st.BlockWise128x128)
        assert scale_a.shape == (M, fp8.blocks(K)) and scale_a.stride(0) == 1, "activation scales outer-major"
        assert scale_b.shape == (fp8.blocks(K), fp8.blocks(N)), "weight scales [nb(K), nb(N)]"
        sa = scale_a.repeat_interleave(fp8.BLOCK, 1)[:, :K]
        sb = scale_b.repeat_interleave(fp8.BLOCK, 0)[:K].repeat_interleave(fp8.BLOCK, 1)[:, :N]
        calls.append((M, K, N))
        return ((a.float() * sa) @ (b.float() * sb)).to(output_dtype)
    return scaled_mm


@pytest.fixture
def stand_in(monkeypatch):
    calls: list = []
    monkeypatch.setattr(fp8_cublas, "F", types.SimpleNamespace(scaled_mm=scaled_mm_stand_in(calls),
                                                               ScalingType=F.ScalingType))
    return calls


def test_fits_takes_whole_blocks_from_the_smallest_measured_row_count():
    assert fp8_cublas.fits(64, 2048, 5120, BF16) and fp8_cublas.fits(4096, 4096, 2048, torch.float16)
    assert not fp8_cublas.fits(63, 2048, 5120, BF16)            # below the measured sizes: Triton
    assert not fp8_cublas.fits(64, 2000, 5120, BF16)            # K not whole blocks
    assert not fp8_cublas.fits(64, 2048, 5000, BF16)            # N not whole blocks
    assert not fp8_cublas.fits(64, 2048, 5120, torch.float32)   # cuBLASLt writes 16-bit outputs here


def test_the_probe_refuses_a_device_without_it_and_the_triton_layer_is_chosen():
    assert fp8_cublas.cublas_blockwise_works(torch.device("cpu")) is False
    assert select_fp8_linear(torch.device("cpu")) is fp8_linear


@pytest.mark.parametrize("bias", [False, True])
def test_cublas_path_hands_scaled_mm_the_layouts_it_reads(stand_in, bias):
    """Rows that fit go to ``scaled_mm`` with outer-major activation scales and [nb(K), nb(N)] weight
    scales, and equal the FP8 oracle; leading dims and bias as the Triton layer's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 256, generator=g).to(BF16)          # 80 rows
    wq, ws = fp8.quantize_blockwise(torch.randn(384, 256, generator=g) / 16)
    b = torch.randn(384, generator=g).to(BF16) if bias else None
    y = fp8_linear(x, wq, ws, b, cublas=True)
    assert stand_in == [(80, 256, 384)] and y.shape == (2, 40, 384) and y.dtype == BF16
    ref = fp8.fp8_linear_reference(x.reshape(80, 256), wq, ws, b).float().view(2, 40, 384)
    assert float((y.float() - ref).abs().max()) <= 1e-2 * float(ref.abs().max())


def test_rows_below_the_floor_or_an_explicit_plan_stay_on_triton(stand_in):
    from ainfer_pd.engine.quant.fp8_plan import fp8_gemm_plan
    g = torch.Generator().manual_seed(1)
    wq, ws = fp8.quantize_blockwise(torch.randn(256, 128, generator=g) / 16)
    few = torch.randn(8, 128, generator=g).to(BF16)
    assert torch.equal(fp8_linear(few, wq, ws, cublas=True), fp8_linear(few, wq, ws))
    many = torch.randn(64, 128, generator=g).to(BF16)
    fp8_linear(many, wq, ws, plan=fp8_gemm_plan(64), cublas=True)
    assert stand_in == []
