"""Host cost of the layer walk (issue 14, item 4): the P epoch walk and the plain forward with
every segment's device work replaced by a no-op, so what is timed is the walk itself (the
segment loop, stream submission, boundaries) - what a host-launch-bound P epoch pays on top of
its kernel launches. An ungated epoch, P host pacing "epoch" (no receive-count waits), an empty
batch, the real CPU streams.

    python benchmarks/p_walk_host_bench.py --layers 48 --epochs 300 [--per-layer]

``--per-layer``: the walk publishes and passes a boundary at every expert notification point and
layer end, as a fine-grained epoch beside D does, every permit granted at once (the gate open):
what the per-layer walk costs over the one-item body when P never waits.

Prints the host enqueue time of one epoch (``p_enqueue_s``), of one whole epoch (``p_epoch_s``:
enqueue + the no-op items running on the P stream's thread) and of one plain forward walk
(``MoETransformer.forward_batch``): the minimum over the repeats (a loaded host only adds time)
and the median.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import WorkerConfig  # noqa: E402
from ainfer_pd.engine.engine import Engine  # noqa: E402
from ainfer_pd.metrics.recorder import Recorder  # noqa: E402
from ainfer_pd.sched.epoch_mode import EpochMode, epoch_mode  # noqa: E402


def _no_device_work(runner) -> None:
    """Every segment of the runner and the model does nothing (the walk stays as it is)."""
    runner.embed = lambda plan: None
    runner.attn_route = lambda layer, st, plan: None
    runner.notify = lambda ctx, st: None
    runner.experts = lambda layer, st, ctx, notified=None: None
    runner.head = lambda st, plan: None
    m = runner.model
    m.embed_tokens = lambda fb: None
    m.attn_route = lambda i, st, fb, kv, attn_reduce=None: None
    m.experts = lambda i, st, expert_fn=None: None
    m.head = lambda st, rows: None


async def _epochs(eng: Engine, n: int, per_layer: bool = False) -> None:
    plan = eng.runner.build([], [])
    mode = epoch_mode("normal", False, False)
    if per_layer:           # every boundary published and passed, none waited at (not gated: the gate open)
        mode = EpochMode(gated=False, exclusive=True, per_layer=True, final=None)
    for i in range(n):
        eng.p.epoch += 1
        await eng.p.run_epoch(eng.p.epoch, [], mode, d_enqueued=False, plan=plan)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--forwards", type=int, default=3000)
    ap.add_argument("--per-layer", action="store_true", help="a boundary at every notification point and layer end")
    args = ap.parse_args()
    cfg = WorkerConfig.from_yaml(args.config).replace(**{
        "model.num_layers": args.layers, "scheduler.policy": "normal", "mux.p_host_pacing": "epoch",
        "cache.num_blocks": 64, "device.device": "cpu"})
    rec = Recorder(keep_intervals=False)
    eng = Engine(cfg, rec)
    _no_device_work(eng.runner)
    try:
        asyncio.run(_epochs(eng, 20, args.per_layer))     # warm-up
        rec.samples.clear()
        asyncio.run(_epochs(eng, args.epochs, args.per_layer))
        fb = eng.runner.build([], []).fb
        fwd = []
        for _ in range(args.forwards):
            t0 = time.perf_counter()
            eng.runner.model.forward_batch(fb, eng.runner.kv_cache)
            fwd.append(time.perf_counter() - t0)
    finally:
        eng.shutdown()
    segs = 2 * args.layers + 2
    # NOTE: the minimum of many repeats (a loaded host only ever adds time), the median beside it
    enq, enq_med = min(rec.samples["p_enqueue_s"]), statistics.median(rec.samples["p_enqueue_s"])
    ep, ep_med = min(rec.samples["p_epoch_s"]), statistics.median(rec.samples["p_epoch_s"])
    fw, fw_med = min(fwd), statistics.median(fwd)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit or "?", "layers": args.layers, "segments": segs, "epochs": args.epochs,
                      "per_layer": args.per_layer,
                      "p_enqueue_us_min": round(enq * 1e6, 1), "p_enqueue_us_median": round(enq_med * 1e6, 1),
                      "p_enqueue_us_per_segment_min": round(enq * 1e6 / segs, 2),
                      "p_epoch_us_min": round(ep * 1e6, 1), "p_epoch_us_median": round(ep_med * 1e6, 1),
                      "forward_walk_us_min": round(fw * 1e6, 1), "forward_walk_us_median": round(fw_med * 1e6, 1),
                      "forward_walk_us_per_segment_min": round(fw * 1e6 / segs, 3)}))


if __name__ == "__main__":
    main()
