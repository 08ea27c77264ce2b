"""The rank-shared planner: pure functions over plain data (SPEC 3.1).

Every engine iteration first commits the ready decode rows (D-first), then admits
prefill with the remaining token budget and KV capacity.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    request_id: str
    remaining_tokens: int      # prompt tokens still to prefill
    admitted: bool             # KV already reserved (a later chunk of a long prompt)
    blocks_needed: int         # blocks its admission takes out of the pool (KVCacheManager.admission_demand)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    request_id: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    decode: tuple[str, ...]
    prefill: tuple[PrefillChunk, ...]
    admitted: tuple[str, ...]    # requests whose KV must be reserved now

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill)


def fits(demand_blocks: int, pool_blocks: int) -> bool:
    """THE admission rule (issue 13, case 1): a turn may be admitted when the blocks its
    reservation takes out of the pool (``KVCacheManager.admission_demand``: its whole turn,
    its own idle blocks included) are at most the pool (free + every idle trajectory's blocks,
    ``KVCacheManager.pool_blocks``). The planner and the engine's admission both call it, so
    a planned admission always succeeds."""
    return demand_blocks <= pool_blocks


def within_live_cap(first: list[bool], active: int, cap: int) -> list[bool]:
    """Which of the waiting turns (in the order served) may be admitted under
    ``scheduler.max_live_trajectories`` = ``cap``: every continuation (``first[i]`` False), and
    first turns of new trajectories only while the ``active`` trajectories (in progress:
    ``engine.loop.live_cap.LiveCap.capped``) plus the first turns kept before them stay under ``cap`` (0: no
    limit). A pool too small for every trajectory's context at once otherwise holds
    them all and evicts their contexts in turn, each continuation prefilling its whole context
    again; held back, a trajectory starts once another is done or between turns."""
    if cap <= 0:
        return [True] * len(first)
    room = cap - active
    keep = []
    for f in first:
        keep.append(not f or room > 0)
        room -= 1 if f else 0
    return keep


AUTO_LIVE_MIN_FINISHED = 4
"""Finished trajectories ``max_live_trajectories: auto`` needs before it caps anything."""


def auto_live_cap(pool_tokens: int, mean_final_tokens: float | None, finished: int) -> int:
    """``scheduler.max_live_trajectories: auto``: as many trajectories as the KV pool holds at the
    mean final context of the trajectories finished so far on this worker (an RL trainer's rollouts
    reuse one worker: from its second rollout on, the first one's lengths), at least 1; 0 (no cap)
    before :data:`AUTO_LIVE_MIN_FINISHED` have finished. The whole context is what a trajectory
    holds at its end, so the cap keeps every admitted one's context resident to the end."""
    if finished < AUTO_LIVE_MIN_FINISHED or not mean_final_tokens or mean_final_tokens <= 0:
        return 0
    return max(1, int(pool_tokens // mean_final_tokens))


def plan_decode(running: list[str], max_rows: int) -> tuple[str, ...]:
    """D-first: every ready decode row, oldest first, up to the batch limit."""
    return tuple(running[:max_rows])


def plan_prefill(pending: list[PendingPrefill], budget_tokens: int, available_blocks: int) -> tuple[tuple[PrefillChunk, ...], tuple[str, ...]]:
    """FIFO admission under a token budget and the KV pool (free + evictable blocks; see :func:`fits`).

    A request is admitted only when its whole turn fits in KV (no decode-time
    preemption). Admission is head-of-line: a request that does not fit blocks the
    *admissions* behind it, so a long prompt cannot be starved by short ones. It never blocks
    the next chunk of a turn admitted already (issue 34, item 10): that turn holds its blocks
    until its prompt is prefilled and its turn ends, so stopping it at a head waiting for
    those very blocks would stop everything.
    """
    chunks: list[PrefillChunk] = []
    admitted: list[str] = []
    budget = budget_tokens
    blocks = available_blocks
    blocked = False                 # a head that does not fit: no admission behind it
    for p in pending:
        if budget <= 0:
            break
        if not p.admitted:
            if blocked or not fits(p.blocks_needed, blocks):
                blocked = True
                continue
            blocks -= p.blocks_needed
            admitted.append(p.request_id)
        n = min(p.remaining_tokens, budget)
        if n <= 0:
            continue
        chunks.append(PrefillChunk(p.request_id, n))
        budget -= n
    return tuple(chunks), tuple(admitted)


def plan_step(running: list[str], pending: list[PendingPrefill], *, max_decode_rows: int,
              prefill_budget: int, available_blocks: int, mixed: bool = False) -> StepPlan:
    """One step: decode rows first; prefill gets what is left (mixed batches subtract
    the decode rows from the shared token budget)."""
    decode = plan_decode(running, max_decode_rows)
    budget = prefill_budget - len(decode) if mixed else prefill_budget
    chunks, admitted = plan_prefill(pending, budget, available_blocks)
    return StepPlan(decode, chunks, admitted)
