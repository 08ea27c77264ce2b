"""FP8 over bf16 decode tokens/s at large batches, on a card that cannot hold the bf16 model's KV for them
(GPU host): issue 37's "FP8 tokens/s / BF16 tokens/s at B = 64 / 128".

An 80 GB H100 holds the Qwen3-30B-A3B shape's bf16 weights (57 GiB) and a KV pool for B 40 x 2K, not B 64
or 128 (the gate leaves those batches out). Every layer of the shape is the same, so a decode iteration's
time is linear in the layer count: t(L) = t0 + L * t_layer, with t0 the embedding, the final norm, the
head and the sampler-free logits. This bench builds each variant (bf16; FP8 experts; FP8 experts and the
FP8 KV cache) at two layer counts that fit, times the captured decode graph of B rows at ``--ctx`` keys
(median of back-to-back replays), and prints per (variant, B):

* the measured graph ms at each layer count, and the fitted ms a layer;
* ``ms_at_<L>``: t(L) at the shape's own layer count from the two points (a projection: labelled so);
* ``over_bf16``: bf16's time over the variant's, measured at the larger layer count (tokens/s ratio of
  those models) and projected to the whole model. The head reads the same bf16 bytes in every variant,
  so the ratio grows with the layers: the larger-count figure is the conservative one.

    python benchmarks/fp8_speed_bench.py [--layers 16,32] [--batches 64,128] [--ctx 2048] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_gate import bench_ms, decode_fb  # noqa: E402

from ainfer_pd.engine.kv.kv_cache import KVCacheManager  # noqa: E402
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402
from ainfer_pd.tools.options import load_config  # noqa: E402

VARIANTS = {
    "bf16": [],
    "fp8": ["model.quantization=fp8"],
    "fp8_kvfp8": ["model.quantization=fp8", "cache.kv_dtype=fp8_e4m3"],
}


def time_variant(config: str, sets: list[str], layers: int, batches: list[int], ctx: int, reps_ms: int) -> dict:
    """{B: graph ms} of one build: ``layers`` layers, a pool for the largest batch at ``ctx``."""
    cfg = load_config(config, sets + [f"model.num_layers={layers}"])
    cfg = cfg.replace(**{"cache.num_blocks": max(batches) * -(-ctx // 16) + 1024, "device.device": "cuda",
                         "device.graph_batch_sizes": batches, "device.graph_max_context": ctx})
    runner = ModelRunner(RunnerSections.from_config(cfg), torch.device("cuda"),
                         KVCacheManager(cfg.cache.num_blocks, 16))
    for i in range(layers):          # random keys (no float8 normal_: N(0, 1) cast a layer at a time)
        runner.kv_cache[i].copy_(torch.randn(runner.kv_cache[i].shape, device="cuda", dtype=torch.bfloat16))
    out = {}
    try:
        with torch.inference_mode():
            runner.capture_decode_graphs(PhaseContext(Phase.DECODE, None))
            for B in batches:
                fb = decode_fb(runner, B, ctx, seed=B)
                before = runner.graphs.num_replays
                runner.graphs.try_run(fb)
                if runner.graphs.num_replays != before + 1:
                    raise RuntimeError(f"B {B} x {ctx}: no graph replayed")
                g = runner.graphs.graphs[runner.graphs.bucket(B, ctx)][0]
                out[B] = round(bench_ms(g.replay, reps_ms), 4)
    finally:
        runner.release_cuda()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    return out


def fit_rows(t: dict, L1: int, L2: int, full: int) -> dict:
    """{variant_bB: figures} from ``t[variant][layers][B]`` graph ms at layer counts L1 < L2: the
    measured times, the fitted ms a layer, the time projected to ``full`` layers, and (every variant
    but bf16) bf16's time over its own, measured at L2 and projected."""
    rows = {}
    for v, by_layers in t.items():
        for B in by_layers[L2]:
            per_layer = (by_layers[L2][B] - by_layers[L1][B]) / (L2 - L1)
            rows[f"{v}_b{B}"] = {f"ms_{L1}_layers": by_layers[L1][B], f"ms_{L2}_layers": by_layers[L2][B],
                                 "ms_a_layer": round(per_layer, 4),
                                 f"projected_ms_at_{full}": round(by_layers[L2][B] + (full - L2) * per_layer, 3)}
    for v, by_layers in t.items():
        for B in by_layers[L2]:
            if v == "bf16":
                continue
            r, b = rows[f"{v}_b{B}"], rows[f"bf16_b{B}"]
            r[f"over_bf16_measured_{L2}_layers"] = round(b[f"ms_{L2}_layers"] / r[f"ms_{L2}_layers"], 3)
            r[f"over_bf16_projected_{full}_layers"] = round(b[f"projected_ms_at_{full}"]
                                                            / r[f"projected_ms_at_{full}"], 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--layers", default="16,32", help="two layer counts that fit the card with every variant")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    L1, L2 = (int(x) for x in a.layers.split(","))
    assert L2 > L1 > 0, "--layers L1,L2 with L2 > L1"
    batches = [int(b) for b in a.batches.split(",")]
    variants = a.variants.split(",")
    if "bf16" not in variants:
        raise SystemExit("--variants must include bf16 (every ratio is over it)")
    full = load_config(a.config, []).model.num_layers
    print(f"== {torch.cuda.get_device_name()}: {a.config}, layers {L1} and {L2} (the shape has {full}), "
          f"B {batches} x {a.ctx} keys", flush=True)
    t = {}
    for v in variants:
        t[v] = {L: time_variant(a.config, VARIANTS[v], L, batches, a.ctx, a.rep_ms) for L in (L1, L2)}
        print(f"{v}: {json.dumps(t[v])}", flush=True)
    rows = fit_rows(t, L1, L2, full)
    for k, r in rows.items():
        print(f"{k}: {json.dumps(r)}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "layers": [L1, L2],
                                           "ctx": a.ctx, "timings": t, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
