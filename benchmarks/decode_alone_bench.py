"""Decode alone at small batch (GPU host): where a D iteration's wall time goes when no P runs.

The trace cell's makespan ends on one or two long generations decoding alone at 5-7K context.
This bench runs B greedy requests of ``--ctx`` prompt tokens and ``--tokens`` new tokens through a
real worker (policy normal, CUDA graphs), and prints per B:

* ``tok_ms``: the decode wall time per generated token of a request (its latency minus its first
  token, over its tokens after the first), median over the B requests (their prompts were
  prefilled before: see :func:`one`);
* the engine's own split of a D iteration: ``iter`` (launch to completion, as the host sees it),
  ``build`` (the batch on the host), ``post`` (sampling and bookkeeping), ``wait`` (ready to launch);
* ``graph_ms``: the replay of the bucket's captured graph alone, back to back (device time);
* ``host_share``: 1 - graph_ms / tok_ms, the part of a token the device does not spend in the graph.

* ``wall_dev``: ``tok_ms / graph_ms``, a D iteration's wall time over its device time.

``--ctxs 2048,8192,16000`` runs every batch at each context; ``--shared-prefix`` gives the B rows
one prompt (GRPO siblings: one copy of its KV, so B x context need not fit the pool).

    python benchmarks/decode_alone_bench.py [--config configs/qwen3-30b-a3b-shape.yaml] [--batches 1,4,16,64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cuda_timing import cuda_time_s  # noqa: E402

from ainfer_pd import RolloutWorker, SamplingParams  # noqa: E402
from ainfer_pd.tools.options import load_config  # noqa: E402


def _mean_ms(m: dict, m0: dict, key: str) -> float:
    """Mean of ``key`` samples recorded between the metrics snapshots ``m0`` and ``m``, in ms."""
    n = m.get(f"{key}_count", 0) - m0.get(f"{key}_count", 0)
    return 1e3 * (m.get(f"{key}_sum", 0.0) - m0.get(f"{key}_sum", 0.0)) / n if n else float("nan")


def graph_ms(runner, B: int, L: int, reps: int = 50) -> float:
    """Device ms of one replay of the graph bucket that fits (B, L), back to back; NaN if none."""
    graphs = runner.graphs
    key = None if graphs is None else graphs.bucket(B, L)
    if key is None or key not in graphs.graphs:
        return float("nan")
    return cuda_time_s(graphs.graphs[key][0].replay, reps) * 1e3


async def one(w: RolloutWorker, B: int, ctx: int, tokens: int, shared: bool = False) -> dict:
    """B trajectories of ``ctx`` random prompt tokens are prefilled first (one token each, not
    measured); then all B continue with one observation token and decode ``tokens`` each,
    submitted at once: the measured D iterations have a single small P epoch (B tokens) beside
    them, not the B long prompts."""
    rng = random.Random(B)
    V = w.cfg.model.vocab_size
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    runner = w.engine.runner
    prompt = [rng.randrange(2, V) for _ in range(ctx)]
    pre = await asyncio.gather(*(w.generate(prompt if shared else [rng.randrange(2, V) for _ in range(ctx)], first)
                                 for _ in range(B)))
    m0 = w.metrics()
    replays0 = runner.graphs.num_replays if runner.graphs is not None else 0
    outs = await asyncio.gather(*(w.continue_(o.trajectory_id, [rng.randrange(2, V)], sp) for o in pre))
    m = w.metrics()
    replays = (runner.graphs.num_replays if runner.graphs is not None else 0) - replays0
    for o in outs:
        await w.release(o.trajectory_id)
    tok_ms = statistics.median((o.latency_s - o.ttft_s) / max(1, len(o.token_ids) - 1) * 1e3 for o in outs)
    g_ms = graph_ms(runner, B, ctx + 2 + tokens)
    split = {k: round(_mean_ms(m, m0, f"d_{k}_s"), 3) for k in ("iter", "build", "post", "wait")}
    return {"B": B, "ctx": ctx, "tokens": tokens, "tok_ms": round(tok_ms, 3), **{f"{k}_ms": v for k, v in split.items()},
            "graph_ms": round(g_ms, 3), "host_share": round(1 - g_ms / tok_ms, 3), "wall_dev": round(tok_ms / g_ms, 3),
            "paths": dict(runner.decode_paths),
            "d_iters": m.get("d_iter_s_count", 0) - m0.get("d_iter_s_count", 0), "graph_replays": replays}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ctx", type=int, default=5000)
    ap.add_argument("--ctxs", default="", help="comma-separated contexts (overrides --ctx)")
    ap.add_argument("--shared-prefix", action="store_true", help="the B rows share one prompt")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cfg = load_config(a.config, ["scheduler.policy=normal", *a.set])
    ctxs = [int(c) for c in a.ctxs.split(",")] if a.ctxs else [a.ctx]
    rows = []
    print(f"{'B':>4} {'ctx':>6} {'tok_ms':>8} {'iter':>7} {'build':>6} {'post':>6} {'wait':>6} {'graph_ms':>8} "
          f"{'host':>6} {'w/dev':>6} {'iters':>6} {'replays':>7}", flush=True)
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([2 + i for i in range(64)], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        await w.release(warm.trajectory_id)
        for ctx in ctxs:
            for B in (int(b) for b in a.batches.split(",")):
                r = await one(w, B, ctx, a.tokens, a.shared_prefix)
                rows.append(r)
                print(f"{r['B']:>4} {r['ctx']:>6} {r['tok_ms']:>8.3f} {r['iter_ms']:>7.3f} {r['build_ms']:>6.3f} "
                      f"{r['post_ms']:>6.3f} {r['wait_ms']:>6.3f} {r['graph_ms']:>8.3f} {r['host_share']:>6.3f} "
                      f"{r['wall_dev']:>6.3f} {r['d_iters']:>6} {r['graph_replays']:>7}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"config": a.config, "rows": rows, "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
