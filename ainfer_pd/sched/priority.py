"""Trajectory-aware priority: which waiting prefill and which decode rows go first (pure policy).

The rollout's metric is the makespan of a fixed set of trajectories, so the work that decides it
is the chain of turns of the trajectories with the most work left (the critical path).
``critical-path`` orders work by the trajectory's *predicted remaining work*, learnt from the
trajectories already finished (per group, e.g. GRPO siblings of one prompt, else over all),
plus a *progressive priority*: every second a turn waits adds ``1 / aging_s`` of a typical
turn's work to its score, so nothing starves. First-token latency is protected by a bound on
the prefill tokens admitted ahead of a waiting turn (``ttft_bound_tokens``): past it, the turn
goes first whatever its score. A waiting turn with little left to prefill (``short_prefill_tokens``,
e.g. a tool observation on retained KV) can go ahead of the rest: it delays them by a little P
work and its own first token by none of theirs (a burst of first turns would otherwise hold back
every continuation that arrives while it is prefilled). ``fifo`` keeps the arrival order (the
behaviour before), except under KV pressure (:func:`short_first_under_pressure`).

Everything here is plain data in, an order out; the engine keeps the mechanism (admission
with the one KV rule, D-first planning).
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIORITIES = ("fifo", "critical-path")


@dataclass(frozen=True, slots=True)
class Work:
    """One unit of schedulable work (a waiting prefill or a decode row) and its trajectory."""

    key: str                  # request id
    group: str                # trajectory group (siblings share it); the trajectory id if none
    turns_done: int           # turns of its trajectory completed before this one
    tokens_done: int          # its trajectory's context tokens so far
    waited_s: float           # since this turn was submitted
    p_tokens_ahead: int = 0   # prefill tokens admitted since it was submitted (waiting prefill only)
    started: bool = False     # already admitted (a later chunk): keeps its place at the front
    prefill_tokens: int = 0   # prompt tokens it still has to prefill (its cached prefix not counted)


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    policy: str = "fifo"
    aging_s: float = 2.0
    """Seconds of waiting worth one typical turn of work in the score."""
    ttft_bound_tokens: int = 16384
    """Prefill tokens that may be admitted ahead of a waiting turn before it goes first."""
    short_prefill_tokens: int = 0
    """A waiting turn with at most this many tokens left to prefill goes ahead of the turns not
    started yet (0: off)."""


@dataclass
class History:
    """What finished trajectories did: turns and tokens, per group and over all (running means)."""

    turns: dict[str, list[int]] = field(default_factory=dict)     # group -> [sum turns, count]
    tokens: dict[str, list[int]] = field(default_factory=dict)    # group -> [sum tokens, count]

    def record(self, group: str, turns: int, tokens: int) -> None:
        for key in (group, "*"):
            t = self.turns.setdefault(key, [0, 0])
            t[0] += turns
            t[1] += 1
            k = self.tokens.setdefault(key, [0, 0])
            k[0] += tokens
            k[1] += 1

    def mean(self, table: dict[str, list[int]], group: str) -> float | None:
        for key in (group, "*"):
            s = table.get(key)
            if s and s[1]:
                return s[0] / s[1]
        return None


def remaining_work(w: Work, h: History, default_turns: float = 4.0, default_turn_tokens: float = 1024.0) -> float:
    """Predicted tokens the trajectory still has to process (prefill + decode of its later turns):
    its group's mean total tokens minus what it has done, at least one typical turn's worth."""
    total = h.mean(h.tokens, w.group)
    turns = h.mean(h.turns, w.group) or default_turns
    per_turn = (total / turns) if total else default_turn_tokens
    if total is None:
        total = turns * per_turn
    return max(per_turn, total - w.tokens_done)


def score(w: Work, h: History, cfg: PriorityConfig) -> float:
    """Higher first: predicted remaining work plus the aging credit of the wait."""
    turns = h.mean(h.turns, w.group) or 4.0
    total = h.mean(h.tokens, w.group)
    per_turn = total / turns if total else 1024.0
    return remaining_work(w, h) + per_turn * w.waited_s / cfg.aging_s


def order(items: list[Work], h: History, cfg: PriorityConfig) -> list[Work]:
    """``items`` (in arrival order) in the order they should be served.

    ``fifo``: unchanged. ``critical-path``: started work first (in arrival order), then the short
    turns (``short_prefill_tokens``, in arrival order), then every turn over the first-token bound
    (oldest first), then the rest by :func:`score`, ties by arrival. Stable and deterministic:
    same inputs, same order on every rank."""
    if cfg.policy == "fifo":
        return list(items)
    started = [w for w in items if w.started]
    waiting = [w for w in items if not w.started]
    short = [w for w in waiting if w.prefill_tokens <= cfg.short_prefill_tokens] if cfg.short_prefill_tokens else []
    if short:
        waiting = [w for w in waiting if w.prefill_tokens > cfg.short_prefill_tokens]
    over = [w for w in waiting if w.p_tokens_ahead >= cfg.ttft_bound_tokens]
    over.sort(key=lambda w: -w.waited_s)
    rest = [(i, w) for i, w in enumerate(waiting) if w.p_tokens_ahead < cfg.ttft_bound_tokens]
    rest.sort(key=lambda iw: (-score(iw[1], h, cfg), iw[0]))
    return started + short + over + [w for _, w in rest]


def short_first_under_pressure(pending: list, spare_blocks: int, short_tokens: int, head_overdue: bool) -> list:
    """``fifo`` under KV pressure: the planner's pending view (:class:`~.planner.PendingPrefill`, in
    arrival order) with the waiting turns that have at most ``short_tokens`` left to prefill (a
    continuation on retained KV) moved ahead of the other turns not admitted yet, when admitting
    the first of those needs more than ``spare_blocks`` (the blocks it could take without evicting
    a waiting turn's cached prefix): it would evict the waiting continuations' prefixes, which
    then prefill their whole context again. Turns admitted already keep their place; so does
    everything when ``short_tokens`` is 0, when nothing is short, or when the first turn is
    ``head_overdue`` (past the first-token bound)."""
    head = next((p for p in pending if not p.admitted), None)
    if short_tokens <= 0 or head is None or head_overdue or head.blocks_needed <= spare_blocks:
        return pending
    started = [p for p in pending if p.admitted]
    short = [p for p in pending if not p.admitted and p.remaining_tokens <= short_tokens]
    if not short or short[0] is head:
        return pending
    rest = [p for p in pending if not p.admitted and p.remaining_tokens > short_tokens]
    return started + short + rest
