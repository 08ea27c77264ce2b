"""``scheduler.max_live_trajectories``: how many trajectories are in progress, and which waiting first
turns the cap holds back (the mechanism; the rule is :func:`~ainfer_pd.sched.planner.within_live_cap`).

A trajectory is in progress with a turn decoding, prefilling or waiting after an earlier one, and
between turns (admitted once, not released: its next turn comes back to its retained context),
except when no trajectory has had a turn for :data:`LIVE_IDLE_S`: then the first turns go ahead up
to the cap, so a caller that runs every trajectory's first turn before any second one is served in
waves and never held for good (the engine is notified when the wait is up).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

from ...sched.planner import auto_live_cap, within_live_cap
from .state import Turn

LIVE_IDLE_S = 0.2
"""Seconds with no trajectory's turn in progress after which the trajectories between turns stop
counting: the gap between a turn's end and its continuation is the caller's few milliseconds; a
caller that runs every first turn before any second one waits this long once a wave."""


class LiveCap:
    """The trajectories in progress on one rank's turn book, under ``cap`` (0: no limit; ``auto``:
    :func:`~ainfer_pd.sched.planner.auto_live_cap` from the trajectories finished so far)."""

    def __init__(self, cap: int | str, kv, recorder, notify: Callable[[], None]) -> None:
        self.cap = cap
        self.kv = kv                      # the pool ``auto`` sizes the cap against
        self.rec = recorder
        self.notify = notify
        self.live: set[str] = set()       # admitted once, not released
        self.idle_s = LIVE_IDLE_S
        self._idle_since: float | None = None

    def cap_now(self, history) -> int:
        """The cap in force (``auto``: from ``history``, the turn book's finished trajectories, and
        the pool's tokens)."""
        if self.cap != "auto":
            return self.cap
        return auto_live_cap(self.kv.alloc.num_blocks * self.kv.block_size, history.mean(history.tokens, "*"),
                             history.tokens.get("*", (0, 0))[1])

    def admitted(self, tid: str) -> None:
        self.live.add(tid)

    def released(self, tid: str) -> None:
        """The trajectory was released: it no longer counts."""
        self.live.discard(tid)

    def capped(self, turns: list[Turn], decoding: Iterable[Turn], waiting: Iterable[Turn], cap: int) -> list[Turn]:
        """``turns`` (waiting, in the order served) less the first turns ``cap`` (:meth:`cap_now`)
        holds back; a first turn is one of a trajectory with no turn before it and no KV reserved yet."""
        running = {t.tid for t in decoding} | {t.tid for t in waiting if not _first_turn(t)}
        now = self.rec.now()
        if running:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
            with contextlib.suppress(RuntimeError):     # no running loop (a synchronous caller)
                asyncio.get_running_loop().call_later(self.idle_s, self.notify)
        idle = not running and now - self._idle_since >= self.idle_s
        active = 0 if idle else len(running | self.live)
        keep = within_live_cap([_first_turn(t) for t in turns], active, cap)
        return [t for t, k in zip(turns, keep) if k]


def _first_turn(turn: Turn) -> bool:
    """A trajectory's first turn: no turn before it, no KV reserved yet, never preempted."""
    return turn.traj.num_turns == 1 and not turn.lifetime and not turn.preemptions
