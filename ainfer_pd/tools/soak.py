"""Soak driver: many trajectories with random tool waits, cancellations and aborts.

Every turn ends one of four ways, counted on the client: ``completed`` (its tokens and the
exact prompt it saw are kept so a fault-free run can re-check them), ``aborted`` (the
trajectory was aborted while the turn was in flight: finish_reason "abort"), ``cancelled``
(the awaiting task was cancelled) or ``failed`` (a typed library error). The totals
reconcile: requests in = completed + aborted + cancelled + failed.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from ..errors import AInferPDError
from ..request import SamplingParams


@dataclass
class SoakResult:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    cancelled: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    outputs: list[tuple[list[int], list[int], int]] = field(default_factory=list)
    """(prompt ids, generated ids, max_new_tokens) of every completed turn."""

    @property
    def reconciles(self) -> bool:
        return self.requests == self.completed + self.aborted + self.cancelled + self.failed


async def soak(worker: Any, *, num_trajectories: int, turns: int = 3, seed: int = 0, cancel_p: float = 0.1,
               abort_p: float = 0.1, max_wait_s: float = 0.02, vocab_size: int = 512,
               prompt_range: tuple[int, int] = (16, 200), gen_range: tuple[int, int] = (2, 24)) -> SoakResult:
    res = SoakResult()

    async def trajectory(i: int) -> None:
        r = random.Random(seed * 100003 + i)
        tid = f"soak-{seed}-{i}"
        started = False
        for turn in range(turns):
            await asyncio.sleep(r.random() * max_wait_s)
            sp = SamplingParams(max_new_tokens=r.randrange(*gen_range), temperature=0.0, ignore_eos=True)
            if not started:
                prompt = [r.randrange(2, vocab_size) for _ in range(r.randrange(*prompt_range))]
                call = worker.generate(prompt, sp, trajectory_id=tid)
            else:
                obs = [r.randrange(2, vocab_size) for _ in range(r.randrange(1, prompt_range[1] // 2))]
                call = worker.continue_(tid, obs, sp)
            res.requests += 1
            task = asyncio.ensure_future(call)
            action = r.random()
            if action < cancel_p:
                await asyncio.sleep(r.random() * 0.03)
                task.cancel()
            elif action < cancel_p + abort_p:
                await asyncio.sleep(r.random() * 0.03)
                if tid in worker.trajectories:
                    await worker.abort(tid)
            try:
                out = await task
            except asyncio.CancelledError:
                res.cancelled += 1
                if not started:
                    return
                continue
            except AInferPDError as exc:
                res.failed += 1
                res.errors.append(f"{type(exc).__name__}: {exc}")
                return
            if out.finish_reason == "abort":
                res.aborted += 1
                if not started:
                    return
                continue
            started = True
            res.completed += 1
            prompt_ids = worker.trajectories[tid].tokens[:out.num_prompt_tokens]
            res.outputs.append((prompt_ids, list(out.token_ids), sp.max_new_tokens))
        if tid in worker.trajectories:
            await worker.release(tid)

    async with asyncio.TaskGroup() as tg:
        for i in range(num_trajectories):
            tg.create_task(trajectory(i))
    for tid in [t for t in list(worker.trajectories) if t.startswith(f"soak-{seed}-")]:
        await worker.release(tid)
    return res


async def verify_against_fresh(cfg: Any, outputs: list[tuple[list[int], list[int], int]]) -> int:
    """Re-run every completed turn on a fresh worker (no retained KV, no faults); returns the
    number of turns whose greedy tokens differ."""
    from .. import RolloutWorker
    bad = 0
    async with RolloutWorker(cfg) as ref:
        async def one(prompt, tokens, n):
            nonlocal bad
            out = await ref.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            await ref.release(out.trajectory_id)
            bad += out.token_ids != tokens
        for k in range(0, len(outputs), 64):
            await asyncio.gather(*(one(*o) for o in outputs[k:k + 64]))
    return bad
