"""The GPU gate's FP8 targets read from its figures (benchmarks/_gate_fp8.py): tokens/s over bf16
with FP8 weights alone and with the FP8 KV cache too (issue 37's "KV as configured")."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _gate_fp8 import summarize_fp8  # noqa: E402


def test_fp8_targets_with_and_without_the_fp8_kv_cache():
    figs = {"qwen3_decode_iteration_b64": {"graph_ms": 20.35}, "qwen3_decode_iteration_b128": {"graph_ms": 24.35},
            "qwen3fp8_decode_iteration_b64": {"graph_ms": 14.43, "ratio": 1.39, "bound_ms": 10.38},
            "qwen3fp8_decode_iteration_b128": {"graph_ms": 18.45, "ratio": 1.36, "bound_ms": 13.57},
            "qwen3fp8_kvfp8_decode_iteration_b64_l2048": {"graph_ms": 12.5}}
    got = {}
    summarize_fp8(figs, lambda name, met, detail: got.__setitem__(name, (met, detail)))
    assert got["fp8_kvfp8_over_bf16_tokens_per_s_b64_ge_1.6"][0] is True            # 20.35 / 12.5 = 1.63
    assert "1.63x" in got["fp8_kvfp8_over_bf16_tokens_per_s_b64_ge_1.6"][1]
    assert "fp8_kvfp8_over_bf16_tokens_per_s_b128_ge_1.6" not in got                # not measured: no target
    assert got["fp8_over_bf16_tokens_per_s_b64_ge_1.6"][0] is False                 # 1.41
    assert got["fp8_over_bf16_tokens_per_s_b128_ge_1.6"][0] is False                # 1.32
    assert got["fp8_decode_iteration_b64_le_1.25x"][0] is False
