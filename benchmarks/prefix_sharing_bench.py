"""Prefix sharing (issue 15): prompt tokens P computes, tokens served from shared KV blocks and the
makespan, with ``cache.prefix_sharing`` on and off, on two workloads:

* ``grpo``: a paper-shaped multi-turn trace made GRPO-shaped (``samples_per_prompt`` members per
  first prompt, each sampled with its own seed), replayed closed-loop (``ainfer_pd.tools.replay``);
  the tokens of every turn must be equal on and off.
* ``live-rl``: the live-RL example (``trainer_examples/live_rl``: B prompts x G episodes of tool
  turns, a GRPO update and a weight sync per step), rollout time summed over the steps.

Runs alternate on / off per repeat (a drift in machine load hits both alike) and each prints one line;
then the medians. ``--json`` prints them as JSON too.

    python benchmarks/prefix_sharing_bench.py grpo --conversations 4 --samples-per-prompt 8 --repeats 3
    python benchmarks/prefix_sharing_bench.py live-rl --steps 4 --repeats 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd.tools.bench import run_one  # noqa: E402
from ainfer_pd.config import WorkerConfig  # noqa: E402
from ainfer_pd.tools.trace import make_trace  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except OSError:
        return "?"


def _overrides(args) -> dict:
    import yaml
    out = {}
    for item in args.set:
        k, _, v = item.partition("=")
        out[k] = yaml.safe_load(v)
    return out


async def grpo_run(args, sharing: bool) -> dict:
    cfg = WorkerConfig.from_yaml(args.config).replace(**{**_overrides(args), "cache.prefix_sharing": sharing,
                                                         "scheduler.policy": args.policy})
    trace = make_trace(args.conversations, args.max_turns, token_scale=args.token_scale,
                       max_context=cfg.model.max_context_len, seed=args.seed).with_samples_per_prompt(args.samples_per_prompt)
    res = await run_one(cfg, trace, cell=args.cell, seed=args.seed, time_scale=args.time_scale, raise_errors=True)
    m = res.metrics
    return {"makespan_s": res.makespan_s, "prompt_tokens": m["prefix_prompt_tokens"],
            "prefill_tokens": m["prefill_tokens"], "reused_tokens": m["prefix_reused_tokens"],
            "requests": res.num_requests, "outputs": res.outputs, "kv_evictions": m["kv_evictions"]}


async def live_rl_run(args, sharing: bool) -> dict:
    from trainer_examples.live_rl.run import PolicyRun, parse_args
    sets = [x for kv in args.set for x in ("--set", kv)]
    la = parse_args(["--steps", str(args.steps), "--policy", args.policy, "--seed", str(args.seed),
                     "--config", str(args.config), "--set", f"cache.prefix_sharing={str(sharing).lower()}",
                     *sets, "--quiet", "--no-plot"])
    async with PolicyRun(args.policy, la) as run:
        m0 = run.worker.metrics()                        # after the untimed warm-up rollout
        for step in range(args.steps):
            await run.step(step)
        m = run.worker.metrics()
        leak_free = run.worker.kv_leak_free()
    d = {k: m[k] - m0[k] for k in ("prefix_prompt_tokens", "prefill_tokens", "prefix_reused_tokens")}
    return {"makespan_s": sum(s["rollout_s"] for s in run.steps), "prompt_tokens": d["prefix_prompt_tokens"],
            "prefill_tokens": d["prefill_tokens"], "reused_tokens": d["prefix_reused_tokens"],
            "requests": sum(s["turns"] for s in run.steps), "kv_leak_free": leak_free,
            "reward_mean": statistics.fmean(s["reward_mean"] for s in run.steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=("grpo", "live-rl"))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml")
    ap.add_argument("--policy", default="fine-grained")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=4, help="grpo: prompts (groups)")
    ap.add_argument("--samples-per-prompt", type=int, default=8, help="grpo: n")
    ap.add_argument("--max-turns", type=int, default=3, help="grpo: turns per conversation at most")
    ap.add_argument("--token-scale", type=float, default=0.1, help="grpo: multiply the trace's token counts")
    ap.add_argument("--cell", default="P1", help="grpo: wait-pressure cell")
    ap.add_argument("--time-scale", type=float, default=0.0, help="grpo: multiply the tool waits")
    ap.add_argument("--steps", type=int, default=3, help="live-rl: steps per run")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both runs, e.g. cache.prefix_wait_min_tokens=64")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    fn = grpo_run if args.workload == "grpo" else live_rl_run
    runs: dict[bool, list[dict]] = {True: [], False: []}
    t0 = time.perf_counter()
    for r in range(args.repeats):
        for sharing in ((True, False) if r % 2 == 0 else (False, True)):
            res = asyncio.run(fn(args, sharing))
            runs[sharing].append(res)
            print(f"repeat {r} sharing={'on ' if sharing else 'off'}: makespan {res['makespan_s']:.3f} s, "
                  f"{res['requests']} turns, prompt tokens {res['prompt_tokens']}, prefill tokens "
                  f"{res['prefill_tokens']}, reused {res['reused_tokens']}", flush=True)
    on, off = runs[True], runs[False]
    med = lambda rs, k: statistics.median(x[k] for x in rs)        # noqa: E731
    summary = {
        "workload": args.workload, "policy": args.policy, "set": args.set, "repeats": args.repeats, "commit": _commit(),
        "machine": f"{os.cpu_count()} CPUs, loadavg {os.getloadavg()[0]:.1f}",
        "prompt_tokens": med(on, "prompt_tokens"),
        "prefill_tokens_on": med(on, "prefill_tokens"), "prefill_tokens_off": med(off, "prefill_tokens"),
        "reused_tokens_on": med(on, "reused_tokens"),
        "makespan_on_s": med(on, "makespan_s"), "makespan_off_s": med(off, "makespan_s"),
        "wall_s": time.perf_counter() - t0,
    }
    summary["prefill_saved"] = 1 - summary["prefill_tokens_on"] / summary["prefill_tokens_off"]
    summary["makespan_change"] = summary["makespan_on_s"] / summary["makespan_off_s"] - 1
    if args.workload == "grpo":
        summary["outputs_equal"] = all(a["outputs"] == b["outputs"] for a, b in zip(on, off))
    else:
        summary["kv_leak_free"] = all(x["kv_leak_free"] for x in on + off)
    print(f"{args.workload} ({args.policy}, median of {args.repeats}): prefill tokens {summary['prefill_tokens_on']:.0f} "
          f"on vs {summary['prefill_tokens_off']:.0f} off ({100 * summary['prefill_saved']:.1f}% saved; "
          f"{summary['reused_tokens_on']:.0f} of {summary['prompt_tokens']:.0f} prompt tokens served from shared "
          f"blocks); makespan {summary['makespan_on_s']:.3f} s on vs {summary['makespan_off_s']:.3f} s off "
          f"({100 * summary['makespan_change']:+.1f}%)"
          + (f"; outputs equal: {summary['outputs_equal']}" if "outputs_equal" in summary else "")
          + f"; commit {summary['commit']}, {summary['machine']}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary.get("outputs_equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
