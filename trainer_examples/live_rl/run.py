"""Live RL on CPU: GRPO on the tiny MoE against one running RolloutWorker.

    python -m trainer_examples.live_rl.run --steps 32 --policy both --out runs/live_rl

Every step: B prompts x G episodes run concurrently (asyncio.TaskGroup) against the worker
(generate -> simulated tool wait -> continue_ with only the observation tokens -> ...), then a
GRPO update of a trainable copy of the policy, then ``worker.update_weights`` with its
parameters. With ``--policy both`` the same seeds run once under ``normal`` and once under
``fine-grained``; the cumulative rollout times, their ratio, a JSON and a PNG are written.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig

from .env import EnvConfig, Episode, ToolEnv, run_episode
from .grpo import GRPOConfig, grpo_update
from .train_forward import make_trainable

ROOT = Path(__file__).resolve().parents[2]


def _seed(*parts: int) -> int:
    s = 0x9E3779B1
    for p in parts:
        s = (s * 1_000_003 + int(p)) & 0x7FFFFFFF
    return s


class PolicyRun:
    """One policy's live-RL loop: its own RolloutWorker, trainable copy and optimizer."""

    def __init__(self, policy: str, args: argparse.Namespace) -> None:
        self.policy, self.args = policy, args
        self.cfg = WorkerConfig.from_yaml(args.config).replace(**{"scheduler.policy": policy})
        self.env = ToolEnv(EnvConfig(vocab_size=self.cfg.model.vocab_size, tool_latency_ms=tuple(args.tool_latency_ms),
                                     min_turns=args.min_turns, max_turns=args.max_turns,
                                     prompt_filler=tuple(args.prompt_filler), obs_filler=tuple(args.obs_filler)))
        self.gcfg = GRPOConfig(lr=args.lr, clip_eps=args.clip, updates_per_step=args.updates_per_step)
        self.steps: list[dict] = []

    async def __aenter__(self) -> "PolicyRun":
        self.worker = RolloutWorker(self.cfg)
        await self.worker.__aenter__()
        self.trainable = make_trainable(self.worker.model)
        self.opt = torch.optim.Adam(self.trainable.parameters(), lr=self.gcfg.lr)
        return self

    async def __aexit__(self, et, exc, tb):
        return await self.worker.__aexit__(et, exc, tb)

    def _params(self, step: int, b: int, g: int):
        a = self.args
        return lambda turn: SamplingParams(max_new_tokens=a.action_tokens, temperature=1.0,
                                           seed=_seed(a.seed, step, b, g, turn))

    async def rollout(self, step: int) -> tuple[list[Episode], float]:
        """B prompts x G episodes, all concurrent against the running worker."""
        a, env = self.args, self.env
        rng = random.Random(_seed(a.seed, step))
        tasks = [env.sample_task(rng, b) for b in range(a.prompts)]
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(run_episode(self.worker, env, task, self._params(step, b, g),
                                               random.Random(_seed(a.seed, step, b, g, 99))))
                    for b, task in enumerate(tasks) for g in range(a.group)]
        return [j.result() for j in jobs], time.perf_counter() - t0

    async def step(self, step: int) -> dict:
        eps, rollout_s = await self.rollout(step)
        t1 = time.perf_counter()
        st = grpo_update(self.trainable, self.opt, eps, self.args.group, self.gcfg)
        t2 = time.perf_counter()
        self.worker.update_weights(self.trainable.named_parameters())     # weight sync, every step
        t3 = time.perf_counter()
        ttfts = [x for e in eps for x in e.ttft_s]
        rec = {
            "step": step, "rollout_s": rollout_s, "train_s": t2 - t1, "sync_s": t3 - t2,
            "reward_mean": statistics.fmean(e.reward for e in eps),
            "format_mean": statistics.fmean(e.format_score for e in eps),
            "hit_mean": statistics.fmean(e.hit_score for e in eps),
            "episodes": len(eps), "turns": sum(len(e.actions) for e in eps),
            "tokens_generated": sum(len(x) for e in eps for x in e.actions),
            "prompt_tokens": sum(e.prompt_tokens for e in eps),
            "cached_tokens": sum(e.cached_tokens for e in eps),
            "tool_wait_s_sum": sum(e.tool_wait_s for e in eps),
            "ttft_mean_s": statistics.fmean(ttfts), "ttft_max_s": max(ttfts),
            "loss": st["loss"], "losses": st["losses"], "clip_frac": st["clip_frac"],
            "grad_norm": st["grad_norm"], "logprob_mismatch_max": st["logprob_mismatch_max"],
        }
        self.steps.append(rec)
        return rec

    def result(self) -> dict:
        m = self.worker.metrics()
        return {
            "policy": self.policy, "steps": self.steps,
            "cum_rollout_s": sum(s["rollout_s"] for s in self.steps),
            "worker": {k: m.get(k) for k in ("finished", "aborted", "failures", "num_epochs", "p_work_s_sum",
                                              "d_work_s_sum", "kv_evictions")},
            "kv_leak_free": self.worker.kv_leak_free(),
        }


def _print_step(policy: str, r: dict) -> None:
    print(f"[{policy:>12}] step {r['step']:3d}  rollout {r['rollout_s']:6.2f}s  train {r['train_s']:5.2f}s  "
          f"reward {r['reward_mean']:.3f} (fmt {r['format_mean']:.3f} hit {r['hit_mean']:.3f})  "
          f"tokens {r['tokens_generated']:5d}  loss {r['loss']:+.4f}  |dlogp| {r['logprob_mismatch_max']:.1e}",
          flush=True)


def summarize(results: dict[str, dict], window: int) -> dict:
    out: dict = {}
    for pol, res in results.items():
        st = res["steps"]
        w = max(1, min(window, len(st) // 2 or 1))
        out[pol] = {
            "cum_rollout_s": res["cum_rollout_s"],
            "reward_first": statistics.fmean(s["reward_mean"] for s in st[:w]),
            "reward_last": statistics.fmean(s["reward_mean"] for s in st[-w:]),
            "format_first": statistics.fmean(s["format_mean"] for s in st[:w]),
            "format_last": statistics.fmean(s["format_mean"] for s in st[-w:]),
            "hit_first": statistics.fmean(s["hit_mean"] for s in st[:w]),
            "hit_last": statistics.fmean(s["hit_mean"] for s in st[-w:]),
            "window": w,
            "tokens_generated": sum(s["tokens_generated"] for s in st),
            "logprob_mismatch_max": max(s["logprob_mismatch_max"] for s in st),
        }
    if "normal" in results and "fine-grained" in results:
        n, f = results["normal"]["cum_rollout_s"], results["fine-grained"]["cum_rollout_s"]
        out["fine_over_normal"] = f / n
        out["rollout_change_pct"] = 100.0 * (f - n) / n
        rn = [s["reward_mean"] for s in results["normal"]["steps"]]
        rf = [s["reward_mean"] for s in results["fine-grained"]["steps"]]
        out["same_rewards_both_policies"] = rn == rf
        out["first_divergent_step"] = next((i for i, (a, b) in enumerate(zip(rn, rf)) if a != b), None)
        pn = [s["rollout_s"] for s in results["normal"]["steps"]]
        pf = [s["rollout_s"] for s in results["fine-grained"]["steps"]]
        out["per_step_ratio_median"] = statistics.median(b / a for a, b in zip(pn, pf))
        out["per_step_rollout_median_s"] = {"normal": statistics.median(pn), "fine-grained": statistics.median(pf)}
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for pol, res in results.items():
        st = res["steps"]
        x = [s["step"] for s in st]
        ax[0].plot(x, [s["reward_mean"] for s in st], marker=".", label=pol)
        ax[1].plot(x, [s["rollout_s"] for s in st], marker=".", label=pol)
        cum, acc = [], 0.0
        for s in st:
            acc += s["rollout_s"]
            cum.append(acc)
        ax[2].plot(x, cum, label=f"{pol} ({acc:.1f} s)")
    ax[0].set(title="reward mean per step", xlabel="step", ylabel="reward")
    ax[1].set(title="rollout time per step", xlabel="step", ylabel="s")
    ax[2].set(title="cumulative rollout time", xlabel="step", ylabel="s")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_G = GRPOConfig()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--policy", choices=("normal", "fine-grained", "both"), default="both")
    p.add_argument("--out", type=Path, default=Path("runs/live_rl"))
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml")
    p.add_argument("--prompts", type=int, default=4, help="B prompts per step")
    p.add_argument("--group", type=int, default=8, help="G episodes per prompt (GRPO group)")
    p.add_argument("--action-tokens", type=int, default=6, help="max_new_tokens of an action")
    p.add_argument("--min-turns", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--prompt-filler", type=int, nargs=2, default=(8, 48))
    p.add_argument("--obs-filler", type=int, nargs=2, default=(2, 16))
    p.add_argument("--tool-latency-ms", type=float, nargs=2, default=(10.0, 60.0))
    p.add_argument("--lr", type=float, default=_G.lr)
    p.add_argument("--clip", type=float, default=_G.clip_eps)
    p.add_argument("--updates-per-step", type=int, default=_G.updates_per_step)
    p.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                   help="with --policy both: alternate the two runs step by step, or run one after the other")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=5, help="steps averaged for first/last reward")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict:
    """Sequential: all steps of ``normal``, then all of ``fine-grained``. Interleaved (default
    for ``both``): both runs live side by side and alternate step by step (the order flips every
    step), so a drift in machine load hits both policies alike; each rollout still runs alone."""
    policies = ("normal", "fine-grained") if args.policy == "both" else (args.policy,)
    show = None if args.quiet else _print_step
    results: dict[str, dict] = {}
    if args.schedule == "sequential" or len(policies) == 1:
        for pol in policies:
            async with PolicyRun(pol, args) as run:
                for step in range(args.steps):
                    rec = await run.step(step)
                    show and show(pol, rec)
                results[pol] = run.result()
        return results
    async with contextlib.AsyncExitStack() as stack:
        runs = [await stack.enter_async_context(PolicyRun(pol, args)) for pol in policies]
        for step in range(args.steps):
            for run in (runs if step % 2 == 0 else runs[::-1]):
                rec = await run.step(step)
                show and show(run.policy, rec)
        for run in runs:
            results[run.policy] = run.result()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    t0, load0 = time.perf_counter(), os.getloadavg()
    results = asyncio.run(amain(args))
    summ = summarize(results, args.window)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python -m trainer_examples.live_rl.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": asdict(EnvConfig()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "loadavg_at_start": load0,
                    "loadavg_at_end": os.getloadavg()},
        "wall_s": time.perf_counter() - t0,
        "summary": summ, "results": results,
    }
    (args.out / "live_rl.json").write_text(json.dumps(doc, indent=1))
    if not args.no_plot:
        plot(results, args.out / "live_rl.png")
    for pol in results:
        s = summ[pol]
        print(f"{pol:>12}: cumulative rollout {s['cum_rollout_s']:.2f} s over {len(results[pol]['steps'])} steps; "
              f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (first/last {s['window']} steps; "
              f"format {s['format_first']:.3f} -> {s['format_last']:.3f}, hit {s['hit_first']:.3f} -> {s['hit_last']:.3f})")
    if "fine_over_normal" in summ:
        print(f"fine-grained / normal cumulative rollout time: {summ['fine_over_normal']:.3f} "
              f"({summ['rollout_change_pct']:+.1f}%); identical rewards under both policies: "
              f"{summ['same_rewards_both_policies']} (first divergent step: {summ['first_divergent_step']}); "
              f"median per-step ratio {summ['per_step_ratio_median']:.3f}")
    print(f"wrote {args.out / 'live_rl.json'}" + ("" if args.no_plot else f" and {args.out / 'live_rl.png'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
