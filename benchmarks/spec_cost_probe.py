"""Where speculation's cost comes from while it does not draft (issue 38: on the H100 a spec-on
rollout of the trained small model ran 1-5% slower than off with 0-4 verifies a run, and its D
iterations' device time was 1.5-7% longer for the same rows).

``spec_bench.py makespan``'s workload, one shape and policy, run under variants interleaved in a
rotating order (each rep starts one variant later, so a drift of the machine falls on every
variant alike):

* ``off``: no speculation;
* ``off-wide``: no speculation, the decode graphs captured for a verify's rows (``max_decode_batch``
  x (1 + K), the graph sizes speculation adds), everything else off's;
* ``on``: suffix drafts, the verify cost table measured at start (as ``spec_bench`` runs it);
* ``on-narrow``: ``on`` with the decode graphs of ``off`` (rows past them decode eagerly);
* ``on-table``: ``on`` with a given cost table under which no batch pays (no measurement at start,
  the speculator asked every iteration and never drafting).

Per variant: the median makespan, its ratio to the first variant's (and the geometric mean of the
per-rep ratios with its 95% interval), and the medians of the D iteration's device time and
launch->done. Prints measured figures only.

    python benchmarks/spec_cost_probe.py [--shape p1] [--policy normal] [--reps 6] [--variants off,off-wide,on,on-narrow,on-table]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ainfer_pd import WorkerConfig  # noqa: E402
from ainfer_pd.engine.runtime import cuda_graphs  # noqa: E402
from ainfer_pd.tools.report import breakdown  # noqa: E402
from benchmarks._ratio_ci import ratio_ci_text  # noqa: E402

VARIANTS = ("off", "off-wide", "on", "on-narrow", "on-table")
_GRAPH_ROWS = {"scale": 1.0}     # the decode graphs' row cap, over the config's (variants patch it)
_buckets = cuda_graphs.graph_buckets


def _scaled_buckets(batch_sizes, max_decode_batch, *rest):
    return _buckets(batch_sizes, max(1, int(max_decode_batch * _GRAPH_ROWS["scale"])), *rest)


def _config(a, variant: str) -> tuple[WorkerConfig, float]:
    """The variant's config and its graph-row scale."""
    over = {"model": {"dtype": a.dtype}, "device": {"device": a.device},
            "cache": {"block_size": 16, "num_blocks": a.kv_blocks},
            "scheduler": {"max_decode_batch": a.max_decode_batch, "policy": a.policy}}
    width = 1 + a.k
    if variant.startswith("on"):
        over["spec"] = {"method": "suffix", "num_draft_tokens": a.k}
    if variant == "on-table":      # every width 10x a plain pass: no batch can pay
        over["spec"]["verify_costs"] = {B: {w: 1e-3 * (1 if w == 1 else 10 * w) for w in (1, 2, 3, width)}
                                        for B in (1, 4, 16, 64, a.max_decode_batch)}
    scale = {"off-wide": float(width), "on-narrow": 1.0 / width}.get(variant, 1.0)
    return WorkerConfig.from_pretrained(str(a.model), over), scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "small_qwen3_moe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shape", default="p1", choices=("p1", "trace"))
    ap.add_argument("--policy", default="normal")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-decode-batch", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=8192)
    a = ap.parse_args()
    import torch
    from transformers import AutoTokenizer
    import spec_bench
    torch.set_num_threads(2)
    variants = a.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; known: {', '.join(VARIANTS)}")
    tok = AutoTokenizer.from_pretrained(str(a.model))
    w = argparse.Namespace(prompts=12, siblings=8, turns=3, max_new_tokens=96, temperature=1.0, k=a.k, seed=0,
                           arrival_s=1.0, tool_wait_s=0.3)
    cuda_graphs.graph_buckets = _scaled_buckets
    print(f"spec cost probe, model {a.model.name}, shape {a.shape}, policy {a.policy}, device {a.device} {a.dtype}, "
          f"commit {spec_bench.commit()}, {a.reps} reps of {', '.join(variants)} (rotating order)")
    runs: dict[str, list[tuple[float, float, float, int]]] = {v: [] for v in variants}
    for r in range(a.reps):
        for i in range(len(variants)):
            v = variants[(r + i) % len(variants)]
            cfg, _GRAPH_ROWS["scale"] = _config(a, v)
            span, outs, m, spec = asyncio.run(spec_bench._rollout(w, tok, cfg, a.shape))
            dev, it = 1e3 * m.get("d_device_s_mean", 0.0), 1e3 * m.get("d_iter_s_mean", 0.0)
            runs[v].append((span, dev, it, spec.get("spec_verifies", 0)))
            print(f"FIG spec_cost_run variant={v} rep={r} makespan_s={span:.3f} d_device_ms={dev:.3f} "
                  f"d_iter_ms={it:.3f} verifies={spec.get('spec_verifies', 0)} "
                  f"tokens={sum(len(t) for traj in outs for t in traj)}")
            print(f"    {breakdown(m)}")
    base = statistics.median(x[0] for x in runs[variants[0]])
    for v in variants:
        span = statistics.median(x[0] for x in runs[v])
        # paired by rep: each rep runs every variant once, in a rotated order
        paired = "" if v == variants[0] else " " + ratio_ci_text(
            [a[0] / b[0] for a, b in zip(runs[v], runs[variants[0]])])
        print(f"FIG spec_cost variant={v} makespan_median_s={span:.3f} over_{variants[0]}={span / base:.3f}{paired} "
              f"d_device_ms_median={statistics.median(x[1] for x in runs[v]):.3f} "
              f"d_iter_ms_median={statistics.median(x[2] for x in runs[v]):.3f} "
              f"verifies={sum(x[3] for x in runs[v])}")


if __name__ == "__main__":
    main()
