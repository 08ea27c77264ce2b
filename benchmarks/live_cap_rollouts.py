"""Consecutive rollouts of one workload on one worker (an RL trainer's steps), under
``scheduler.max_live_trajectories`` values: the prompt tokens each rollout prefilled, its makespan
and the cap in force after it (``auto`` learns it from the trajectories finished so far).
Prints measured figures only.

    python benchmarks/live_cap_rollouts.py --caps 0,auto,8 [--rollouts 2] [--blocks 1200]
        [--conversations 32] [--max-turns 4] [--token-scale 0.5] [--config ainfer_pd/configs/tiny-cpu.yaml]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker  # noqa: E402
from ainfer_pd.tools.options import add_workload_args, build_trace, load_config  # noqa: E402
from ainfer_pd.tools.replay import replay  # noqa: E402


async def rollouts(a, cap: str) -> str:
    p = argparse.ArgumentParser()
    add_workload_args(p, preset="tiny")
    args = p.parse_args(["--config", a.config, "--conversations", str(a.conversations), "--max-turns",
                         str(a.max_turns), "--token-scale", str(a.token_scale)])
    cfg = load_config(a.config, [f"cache.num_blocks={a.blocks}", f"scheduler.max_live_trajectories={cap}",
                                 f"scheduler.short_prefill_tokens={a.short_prefill_tokens}"])
    trace = build_trace(args, cfg)
    out = []
    async with RolloutWorker(cfg) as w:
        book = w.engine.book
        for step in range(a.rollouts):
            before = w.metrics()["prefill_tokens"]
            r = await replay(w, trace, cell=a.cell, seed=step)
            cap_now = book.live.cap_now(book.history)
            out.append(f"rollout {step}: makespan {r.makespan_s:.2f} s, prefilled {int(w.metrics()['prefill_tokens'] - before)}"
                       f" prompt tokens, {r.failures} failures, cap after it {cap_now}")
    return f"max_live_trajectories={cap}: " + " | ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,auto,8")
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=1200)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--token-scale", type=float, default=0.5)
    ap.add_argument("--short-prefill-tokens", type=int, default=256)
    ap.add_argument("--cell", default="P1")
    ap.add_argument("--config", default="ainfer_pd/configs/tiny-cpu.yaml")
    a = ap.parse_args()
    for cap in a.caps.split(","):
        print(asyncio.run(rollouts(a, cap)), flush=True)


if __name__ == "__main__":
    main()
