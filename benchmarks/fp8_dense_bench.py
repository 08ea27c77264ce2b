"""FP8 with bf16 dense weights (the default) against FP8 dense weights (``model.fp8_dense``: the QKV /
O / shared-expert GEMMs on cuBLASLt's blockwise FP8 from 64 rows, the Triton FP8 GEMM below), on the
Qwen3-30B-A3B shape, random init quantized at load, one GPU.

Per variant, in one process: eager prefill passes of 2K / 4K / 8K new tokens (wall, the median of
``triton.testing.do_bench``), their GPU busy time, and the GPU busy time of one decode iteration at
B 16 / 64 / 128, ctx 2K (the kernels a graph replays; no graphs are captured here), against the FP8
roofline the gate uses. Prints FIG lines.

    python benchmarks/fp8_dense_bench.py [--config configs/qwen3-30b-a3b-shape.yaml]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_gate as gate  # noqa: E402

from ainfer_pd.engine.kv.kv_cache import KVCacheManager  # noqa: E402
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402

PREFILL = (2048, 4096, 8192)
DECODE = (16, 64, 128)
CTX = 2048


def variant(cfg_path: str, dense: bool, peak: float, bw: float) -> dict:
    num_blocks = max(DECODE) * CTX // 16 + 1024
    cfg = gate.model_cfg(cfg_path, num_blocks, {"model.quantization": "fp8", "model.fp8_dense": dense,
                                                "device.cuda_graphs": False, "device.prefill_graphs": False})
    runner = ModelRunner(RunnerSections.from_config(cfg), gate.DEV, KVCacheManager(num_blocks, 16))
    runner.kv_cache.normal_(0, 1)
    dctx, pctx = PhaseContext(Phase.DECODE, None), PhaseContext(Phase.PREFILL, None)
    out = {}
    with torch.inference_mode():
        for n in PREFILL:
            pfb = gate.prefill_fb(runner, n, 0)

            def step():
                pfb.prefill_meta = None
                return runner.forward_fb(pfb, pctx)
            ms = gate.bench_ms(step, 300)
            busy = gate.gpu_busy_ms(step)
            roof = gate.prefill_roofline_ms(runner.model, n, 0, peak, bw)
            out[f"prefill_{n}"] = {"ms": round(ms, 2), "gpu_busy_ms": round(busy, 2),
                                   "roofline_fraction": round(roof / ms, 3)}
        for B in DECODE:
            fb = gate.decode_fb(runner, B, CTX, seed=B)
            out[f"decode_b{B}_gpu_busy_ms"] = round(gate.gpu_busy_ms(lambda: runner.forward_fb(fb, dctx)), 3)
    runner.release_cuda()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    args = ap.parse_args()
    t0 = time.time()
    print(f"fp8 dense bench: torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    bw, peak = gate.ceilings()
    res = {}
    for dense in (False, True):
        res[dense] = variant(args.config, dense, peak, bw)
        gate.fig(f"fp8{'_dense' if dense else ''}", res[dense])
    for k in res[False]:
        a, b = res[False][k], res[True][k]
        a, b = (a["ms"], b["ms"]) if isinstance(a, dict) else (a, b)
        gate.fig(f"fp8_dense_over_bf16_dense_{k}", round(b / a, 3), f"{b} against {a} ms")
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
