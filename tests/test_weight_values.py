"""The weight-sync value check: one aminmax pass finds a NaN or inf anywhere and a magnitude the
parameter's dtype cannot hold (the host-side check of every synced tensor)."""
import pytest
import torch

from ainfer_pd.engine.model.weights import _check_values
from ainfer_pd.engine.quant.fp8 import FP8
from ainfer_pd.errors import WeightUpdateError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 4097, -1])
def test_a_non_finite_value_anywhere_is_refused(dtype, bad, where):
    t = torch.randn(3, 4099).to(dtype)
    t.view(-1)[where] = bad
    with pytest.raises(WeightUpdateError, match="non-finite"):
        _check_values("w", t, dtype)


def test_a_magnitude_beyond_the_parameter_dtype_is_refused_and_a_finite_one_passes():
    t = torch.randn(64, 64)
    _check_values("w", t, torch.bfloat16)
    t[5, 7] = -3.4e38                                    # finite in float32, beyond bfloat16 (max 3.39e38)
    with pytest.raises(WeightUpdateError, match="magnitude"):
        _check_values("w", t, torch.bfloat16)
    _check_values("w", t, torch.float32)
    h = torch.randn(8).to(torch.bfloat16)
    h[3] = 70000.0                                       # fits bfloat16, not float16
    with pytest.raises(WeightUpdateError, match="magnitude"):
        _check_values("w", h, torch.float16)


def test_e4m3_nan_bit_patterns_are_refused():
    q = torch.randn(16, 16).to(FP8)
    _check_values("w", q, FP8)
    q.view(torch.uint8)[2, 3] = 0xFF
    with pytest.raises(WeightUpdateError, match="non-finite"):
        _check_values("w", q, FP8)
