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


@dataclass(frozen=True)
class _SoakShape:
    """What every soak trajectory draws from (the arguments of :func:`soak`)."""
    turns: int
    seed: int
    cancel_p: float
    abort_p: float
    max_wait_s: float
    vocab_size: int
    prompt_range: tuple[int, int]
    gen_range: tuple[int, int]


async def soak(worker: Any, *, num_trajectories: int, turns: int = 3, seed: int = 0, cancel_p: float = 0.1,
               abort_p: float = 0.1, max_wait_s: float = 0.02, vocab_size: int = 512,
               prompt_range: tuple[int, int] = (16, 200), gen_range: tuple[int, int] = (2, 24)) -> SoakResult:
    """``num_trajectories`` concurrent trajectories of ``turns`` turns each (seeded): random waits,
    prompts, observations and lengths; each turn cancelled with ``cancel_p``, its trajectory aborted
    with ``abort_p``. Returns the client's counts (see the module docstring)."""
    res = SoakResult()
    shape = _SoakShape(turns, seed, cancel_p, abort_p, max_wait_s, vocab_size, prompt_range, gen_range)
    async with asyncio.TaskGroup() as tg:
        for i in range(num_trajectories):
            tg.create_task(_trajectory(worker, shape, i, res))
    for tid in [t for t in list(worker.trajectories) if t.startswith(f"soak-{seed}-")]:
        await worker.release(tid)
    return res


async def _trajectory(worker: Any, shape: _SoakShape, i: int, res: SoakResult) -> None:
    """Soak trajectory ``i``: its turns until one ends it (a failure, or a first turn that did not
    complete), then its release."""
    r = random.Random(shape.seed * 100003 + i)
    tid = f"soak-{shape.seed}-{i}"
    started = False
    for _ in range(shape.turns):
        outcome = await _turn(worker, shape, r, tid, started, res)
        if outcome == "end":
            return
        started = started or outcome == "completed"
    if tid in worker.trajectories:
        await worker.release(tid)


async def _turn(worker: Any, shape: _SoakShape, r: random.Random, tid: str, started: bool, res: SoakResult) -> str:
    """One turn of trajectory ``tid``, counted in ``res``: ``completed``, ``next`` (cancelled or
    aborted after the first turn completed) or ``end`` (the trajectory stops)."""
    await asyncio.sleep(r.random() * shape.max_wait_s)
    sp = SamplingParams(max_new_tokens=r.randrange(*shape.gen_range), temperature=0.0, ignore_eos=True)
    if not started:
        prompt = [r.randrange(2, shape.vocab_size) for _ in range(r.randrange(*shape.prompt_range))]
        call = worker.generate(prompt, sp, trajectory_id=tid)
    else:
        obs = [r.randrange(2, shape.vocab_size) for _ in range(r.randrange(1, shape.prompt_range[1] // 2))]
        call = worker.continue_(tid, obs, sp)
    res.requests += 1
    task = asyncio.ensure_future(call)
    await _disturb(worker, shape, r, tid, task)
    try:
        out = await task
    except asyncio.CancelledError:
        res.cancelled += 1
        return "next" if started else "end"
    except AInferPDError as exc:
        res.failed += 1
        res.errors.append(f"{type(exc).__name__}: {exc}")
        return "end"
    if out.finish_reason == "abort":
        res.aborted += 1
        return "next" if started else "end"
    res.completed += 1
    prompt_ids = worker.trajectories[tid].tokens[:out.num_prompt_tokens]
    res.outputs.append((prompt_ids, list(out.token_ids), sp.max_new_tokens))
    return "completed"


async def _disturb(worker: Any, shape: _SoakShape, r: random.Random, tid: str, task: asyncio.Future) -> None:
    """With ``cancel_p`` cancel the turn's task, with ``abort_p`` abort its trajectory (after a
    random few ms); else nothing."""
    action = r.random()
    if action < shape.cancel_p:
        await asyncio.sleep(r.random() * 0.03)
        task.cancel()
    elif action < shape.cancel_p + shape.abort_p:
        await asyncio.sleep(r.random() * 0.03)
        if tid in worker.trajectories:
            await worker.abort(tid)


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
