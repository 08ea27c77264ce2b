"""How the ranks agree on a step: every rank's :class:`~ainfer_pd.sched.step.StepInputs`, in rank order.

* :class:`LocalCoordinator`: one rank; its own inputs at once. A step with nothing to do waits
  for the next change the engine notifies (no polling).
* :class:`RankCoordinator`: several ranks (or one under ``torch.distributed``); a rendezvous of
  every rank's inputs on the control group. A step with nothing to do sleeps briefly and steps
  again: a peer's change is seen only at a step. At every step a replica leader also announces
  the MTP stashes it forgot, and its TP followers drop them right after the rendezvous
  (:class:`~.mtp_replica.MtpReplica`): every step, the last one included.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Awaitable, Callable

Changed = Callable[..., Awaitable[None]]
"""``changed(timeout_s, seen)``: wait for a change notified after ``seen`` was taken, at most
``timeout_s`` (None: no limit)."""

from ...metrics.recorder import Recorder
from ...sched.step import StepInputs

IDLE_BACKOFF_S = 0.002
"""Longest a multi-rank step waits while no rank has work."""
STEP_POLL_S = 0.0005
"""Longest a multi-rank step waits for a local change while an epoch runs elsewhere or exclusively."""


class LocalCoordinator:
    ranks = 1

    def __init__(self, changed: Changed) -> None:
        self._changed = changed

    async def exchange(self, inputs: StepInputs, *, epoch: int) -> list[StepInputs]:
        return [inputs]

    async def idle(self, seen: asyncio.Event) -> None:
        """Nothing to do at this step: wait for a change since the step began (a submission, an
        epoch's end, an abort, KV freed)."""
        await self._changed(None, seen)

    async def wait_epoch(self, seen: asyncio.Event) -> None:
        """An epoch runs and D may not (or has no rows): its end notifies."""
        await self._changed(None, seen)


class RankCoordinator:
    """``mtp``: the rank's :class:`~.mtp_replica.MtpReplica` (the stash drops of the module
    docstring; None: none)."""

    def __init__(self, rendezvous, recorder: Recorder, ranks: int, changed: Changed, mtp=None) -> None:
        self.rdv = rendezvous
        self.rec = recorder
        self.ranks = ranks
        self._changed = changed
        self.mtp = mtp

    async def exchange(self, inputs: StepInputs, *, epoch: int) -> list[StepInputs]:
        if self.mtp is not None:
            inputs = dataclasses.replace(inputs, stash_drops=self.mtp.stash_drops())
        t0 = self.rec.now()
        states = await self.rdv.arrive("step", inputs.to_payload(), epoch=epoch)
        self.rec.sample("step_sync_s", self.rec.now() - t0)
        states = [StepInputs.from_payload(s) for s in states]
        if self.mtp is not None:
            await self.mtp.drop_stashes(states)
        return states

    async def idle(self, seen: asyncio.Event) -> None:
        await asyncio.sleep(IDLE_BACKOFF_S)

    async def wait_epoch(self, seen: asyncio.Event) -> None:
        # NOTE: never a bare sleep(0): at world size 1 the step rendezvous is immediate, and a
        # spinning loop holds the GIL against the stream threads that launch the epoch's kernels.
        await self._changed(STEP_POLL_S, seen)
