"""Live RL: GRPO on the ainfer-pd MoE against one running RolloutWorker, on CPU or one CUDA GPU.

    python -m trainer_examples.live_rl.run --steps 32 --policy both --out runs/live_rl
    python -m trainer_examples.live_rl.run --config configs/live-rl-h200.yaml --steps 32 --policy both \
        --prompts 8 --group 8 --out runs/live_rl_h200

Every step: B prompts x G episodes run concurrently (asyncio.TaskGroup) against the worker
(generate -> simulated tool wait -> continue_ with only the observation tokens -> ...), then a
GRPO update of the policy as transformers' ``Qwen3MoeForCausalLM`` (float32 master weights on the
worker's device, forward in the worker's dtype by default), then ``worker.update_weights`` with
its ``named_parameters()`` (transformers' names and packed experts) in the worker's dtype (copied in place: captured CUDA graphs keep reading the same storage). The
update and the weight conversion run in a thread, off the event loop; on CUDA every timed
interval ends with a device synchronize. With ``--policy both`` the same seeds run once under
``normal`` and once under ``fine-grained``; the cumulative rollout times, their ratio, a JSON
and a PNG are written.
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
from typing import Self

import torch

from ainfer_pd import RolloutWorker, SamplingParams

from .env import EnvConfig, Episode, ToolEnv, run_episode
from .grpo import GRPOConfig, grpo_update, make_optimizer
from .placement import (
    DEVICES,
    MASTER_DTYPE,
    TRAIN_COMPUTE,
    compute_dtype,
    describe,
    parse_overrides,
    synchronize,
    worker_config,
    worker_weights,
)
from .report import plot, print_step, print_summary, summarize
from .train_forward import make_trainable

ROOT = Path(__file__).resolve().parents[2]


def _seed(*parts: int) -> int:
    s = 0x9E3779B1
    for p in parts:
        s = (s * 1_000_003 + int(p)) & 0x7FFFFFFF
    return s


class PolicyRun:
    """One policy's live-RL loop: its own RolloutWorker, trainable copy and optimizer, on one device."""

    def __init__(self, policy: str, args: argparse.Namespace) -> None:
        self.policy, self.args = policy, args
        self.cfg = worker_config(args.config, policy, args.device, parse_overrides(args.set))
        self.env = ToolEnv(EnvConfig(vocab_size=self.cfg.model.vocab_size, tool_latency_ms=tuple(args.tool_latency_ms),
                                     min_turns=args.min_turns, max_turns=args.max_turns,
                                     prompt_filler=tuple(args.prompt_filler), obs_filler=tuple(args.obs_filler)))
        self.gcfg = GRPOConfig(lr=args.lr, clip_eps=args.clip, updates_per_step=args.updates_per_step)
        self.steps: list[dict] = []

    async def __aenter__(self) -> Self:
        t0 = time.perf_counter()
        self.worker = RolloutWorker(self.cfg)
        await self.worker.__aenter__()
        try:
            self.device = self.worker.model.embed.device
            self.worker_dtype = self.worker.model.embed.dtype
            self.compute_dtype = compute_dtype(self.args.train_compute, self.worker_dtype)
            self.trainable = make_trainable(self.worker.model, device=self.device, dtype=MASTER_DTYPE)
            self.opt = make_optimizer(self.trainable, self.gcfg.lr)
            for i in range(self.args.warmup_rollouts):     # untimed: lazy inits, first kernels
                await self.rollout(-1 - i)
        except BaseException as exc:
            await self.worker.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    async def __aexit__(self, et, exc, tb):
        return await self.worker.__aexit__(et, exc, tb)

    def _params(self, step: int, b: int, g: int):
        a = self.args
        return lambda turn: SamplingParams(max_new_tokens=a.action_tokens, temperature=1.0,
                                           seed=_seed(a.seed, step, b, g, turn))

    async def _synchronize(self) -> None:
        """All device work done (CUDA: every stream), waited for off the event loop."""
        if self.device.type == "cuda":
            await asyncio.to_thread(synchronize, self.device)

    async def rollout(self, step: int) -> tuple[list[Episode], float]:
        """B prompts x G episodes, all concurrent against the running worker; the time runs from
        an idle device to the last episode's end with the device idle again."""
        a, env = self.args, self.env
        rng = random.Random(_seed(a.seed, step))
        tasks = [env.sample_task(rng, b) for b in range(a.prompts)]
        await self._synchronize()
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(run_episode(self.worker, env, task, self._params(step, b, g),
                                               random.Random(_seed(a.seed, step, b, g, 99))))
                    for b, task in enumerate(tasks) for g in range(a.group)]
        await self._synchronize()
        return [j.result() for j in jobs], time.perf_counter() - t0

    def _train(self, eps: list[Episode]) -> dict:
        st = grpo_update(self.trainable, self.opt, eps, self.args.group, self.gcfg, self.compute_dtype)
        synchronize(self.device)
        return st

    async def step(self, step: int) -> dict:
        eps, rollout_s = await self.rollout(step)
        t1 = time.perf_counter()
        st = await asyncio.to_thread(self._train, eps)                   # off the event loop
        t2 = time.perf_counter()
        named = await asyncio.to_thread(worker_weights, self.trainable, self.worker_dtype, self.device)
        await self.worker.update_weights(named)  # weight sync, every step: in place, off the loop, waits for the device
        t3 = time.perf_counter()
        ttfts = [x for e in eps for x in e.ttft_s]
        rec = {
            "step": step, "rollout_s": rollout_s, "train_s": t2 - t1, "sync_s": t3 - t2,
            "cum_rollout_s": sum(s["rollout_s"] for s in self.steps) + rollout_s,
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
            "logprob_mismatch_mean": st["logprob_mismatch_mean"],
        }
        self.steps.append(rec)
        return rec

    def result(self) -> dict:
        m = self.worker.metrics()
        graphs = getattr(self.worker.engine.runner, "graphs", None)      # CUDA decode graphs, if captured
        return {
            "policy": self.policy, "steps": self.steps,
            "cum_rollout_s": sum(s["rollout_s"] for s in self.steps),
            "startup_s": self.startup_s, "device": str(self.device), "worker_dtype": str(self.worker_dtype),
            "master_dtype": str(MASTER_DTYPE), "train_compute_dtype": str(self.compute_dtype),
            "env": asdict(self.env.cfg),
            "worker": {k: m.get(k) for k in ("finished", "aborted", "failures", "num_epochs", "p_work_s_sum",
                                              "d_work_s_sum", "kv_evictions", "activation_switches",
                                              "activation_declined", "p_gated_slowdown")},
            "decode_graphs": None if graphs is None else {"captured": len(graphs.graphs), "replays": graphs.num_replays},
            "kv_leak_free": self.worker.kv_leak_free(),
        }


_G = GRPOConfig()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--policy", choices=("normal", "fine-grained", "both"), default="both")
    p.add_argument("--out", type=Path, default=Path("runs/live_rl"))
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="worker and trainer device (default: the config's device.device; auto = cuda if available)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="worker config override, repeatable, e.g. --set model.dtype=bfloat16 --set cache.num_blocks=4096")
    p.add_argument("--train-compute", choices=TRAIN_COMPUTE, default="worker",
                   help="dtype of the trainer's forward/backward over its float32 master weights: the worker's "
                        "dtype (bf16 on the GPU config; matches the rollout logprobs) or float32")
    p.add_argument("--warmup-rollouts", type=int, default=1,
                   help="untimed rollouts per worker before step 0 (no update; CUDA lazy init, first kernels)")
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
    show = None if args.quiet else print_step
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
    first = next(iter(results.values()))
    doc = {
        "command": "python -m trainer_examples.live_rl.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": first["env"],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "loadavg_at_start": load0,
                    "loadavg_at_end": os.getloadavg(), "device": describe(torch.device(first["device"]))},
        "wall_s": time.perf_counter() - t0,
        "summary": summ, "results": results,
    }
    (args.out / "live_rl.json").write_text(json.dumps(doc, indent=1))
    png = None if args.no_plot else args.out / "live_rl.png"
    if png is not None:
        try:
            plot(results, png)
        except ImportError as exc:             # the JSON is written; a host without matplotlib loses the PNG only
            print(f"no plot: {exc}")
            png = None
    print_summary(results, summ)
    print(f"wall {doc['wall_s']:.1f} s; wrote {args.out / 'live_rl.json'}" + ("" if png is None else f" and {png}"))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
