"""Async turnstile of one rank (SPEC 3.2, DESIGN 4): the P task and the D loop meet here.

The background P task holds an epoch (``async with turnstile.epoch(...) as ep``) and calls
``await ep.permit(b)`` before communicating beyond boundary ``b`` and ``ep.publish(b)``
when it reaches boundary ``b``. The foreground D loop brackets every D launch with
``rnd = await before_decode()`` (wait for P at its endpoint, rendezvous 1) and
``await after_decode(rnd)`` (rendezvous 2 = ACK that every rank's launch call returned,
then ``p <- p + K``).

Rounds per gated epoch are a function of rank-agreed facts only, so every rank runs the
same number of rendezvous: a round waits until P stands at the permit endpoint, or has
published its final boundary, or has left the epoch. A round is the epoch's *last* when
P had published its final boundary (``publish(b, final=True)``) and stood there, or when
P had left the epoch below the permit. A round that finds P gone but exactly at the permit
is an ordinary round: another rank may still see P there, so one more (tail) round
follows, with the permit advanced as if granted.

NOTE: every method must be called from the event loop thread (no locks; wake-ups are
``asyncio.Event`` swaps). NOTE: an epoch's begin and ``open_gate`` must be rank-agreed
decisions taken at the same D round on every rank (the rank-shared planner's job);
the rendezvous payloads detect when they were not.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from ..errors import MissingProducerError, RendezvousTimeout, StaleEpochError, TurnstileTimeout
from ..sched.span import SpanInputs, SpanPolicy, span_switch
from .controller import TurnstileController, check_span
from .rendezvous import Rendezvous, assert_agree

if TYPE_CHECKING:
    from ..metrics.recorder import Recorder

logger = logging.getLogger(__name__)


class _NullRecorder:
    """Stands in when no recorder is given: drops everything."""

    def sample(self, name: str, value: float) -> None: ...
    def count(self, name: str, value: float = 1.0) -> None: ...
    def event(self, name: str, **attrs) -> None: ...


@dataclass(frozen=True)
class Round:
    """One D round of a gated epoch, as agreed at rendezvous 1."""
    epoch: int
    boundary: int
    """The reached boundary ``r`` when the round began."""
    permit: int
    """The permit endpoint ``p`` when the round began."""
    last: bool
    """The epoch owes the D loop no further round after this one."""
    ended: bool
    """P had already left the epoch when the round began."""


@dataclass
class _Owed:
    """A gated epoch the D loop still owes rounds to; frozen state once P has left it."""
    epoch: int
    ended: bool = False
    reached: int = -1
    permit: int | float = 0
    final: int | None = None


class EpochHandle:
    """P's side of one epoch: ``permit`` before communicating, ``publish`` at boundaries."""

    def __init__(self, turnstile: "Turnstile", epoch_id: int) -> None:
        self._ts = turnstile
        self.epoch_id = epoch_id

    async def permit(self, boundary: int) -> None:
        """Wait until P may communicate beyond ``boundary``.

        Asking to pass ``boundary`` means P stands at it: a boundary not yet published is
        published first (so ``permit(0)`` publishes boundary 0, "about to enter the device").
        """
        ts, ctl = self._ts, self._ts.controller
        ts._check_current(self.epoch_id, "permit")
        if boundary > ctl.reached:
            self.publish(boundary)
        if ctl.may_pass(boundary):
            if ctl.gated:
                ts._rec.sample("p_wait_permit_s", 0.0)
            return
        t0 = time.perf_counter()
        permit_before = ctl.permit
        # Waits for the D loop's grant (p > boundary), an open gate, or the epoch to go away.
        await ts._wait_for(lambda: ctl.epoch != self.epoch_id or ctl.may_pass(boundary),
                           what="P wait for permit", epoch=self.epoch_id, boundary=boundary)
        waited = time.perf_counter() - t0
        ts._rec.sample("p_wait_permit_s", waited)
        ts._rec.event("permit_wait", epoch=self.epoch_id, boundary=boundary,
                      permit=_finite(permit_before), granted=_finite(ctl.permit), wait_s=waited)
        ts._check_current(self.epoch_id, "permit")

    def passes(self, boundary: int) -> bool:
        """Would :meth:`permit` for ``boundary`` (published) return without waiting, now? (Until
        P's coroutine yields nothing can change it: the D loop grants on the same event loop.)"""
        return self._ts.controller.may_pass(boundary)

    def publish(self, boundary: int, *, final: bool = False) -> None:
        """P reached ``boundary`` (``final``: it is the epoch's last); wakes the D loop."""
        ts, ctl = self._ts, self._ts.controller
        ctl.publish(self.epoch_id, boundary, final=final)
        ts._rec.event("publish", epoch=self.epoch_id, boundary=boundary,
                      permit=_finite(ctl.permit), final=final)
        ts._notify()


class Turnstile:
    """Rank-aligned turnstile of one rank: controller + rendezvous + wake-ups + metrics."""

    def __init__(self, *, rendezvous: Rendezvous, span: SpanPolicy, recorder: "Recorder | None" = None,
                 rank: int = 0, timeout_s: float = 30.0,
                 load: Callable[[], SpanInputs] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._rdv = rendezvous
        self._span_policy = span
        self._rec = recorder if recorder is not None else _NullRecorder()
        self._load = load
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.controller = TurnstileController(span=check_span(span(SpanInputs())))
        self._owed: collections.deque[_Owed] = collections.deque()
        self._changed = asyncio.Event()
        self.rounds = 0
        """D rounds completed (after_decode returned)."""

    # ------------------------------------------------------------------- P side
    @contextlib.asynccontextmanager
    async def epoch(self, epoch_id: int, *, gated: bool, d_enqueued: bool) -> AsyncIterator[EpochHandle]:
        """Hold P epoch ``epoch_id``; ends it on exit, cancels it on exception or cancellation."""
        ctl = self.controller
        k, inputs = self._local_span()
        previous = ctl.span
        ctl.set_span(k)  # the start rule p = K uses the span chosen now
        try:
            ctl.begin_epoch(epoch_id, d_enqueued=d_enqueued, gated=gated)
        except BaseException:
            ctl.set_span(previous)  # a rejected begin leaves the state unchanged
            raise
        self._log_switch(previous, k, inputs, epoch=epoch_id, permit=ctl.permit)
        owed = _Owed(epoch_id) if gated else None
        if owed is not None:
            self._owed.append(owed)
        self._rec.event("epoch_begin", epoch=epoch_id, gated=gated, d_enqueued=d_enqueued,
                        boundary=ctl.reached, permit=_finite(ctl.permit), span=ctl.span)
        self._notify()
        try:
            yield EpochHandle(self, epoch_id)
        except BaseException:
            self._leave(epoch_id, owed, cancelled=True)
            raise
        self._leave(epoch_id, owed, cancelled=False)

    def _leave(self, epoch_id: int, owed: _Owed | None, *, cancelled: bool) -> None:
        ctl = self.controller
        if owed is not None:
            # NOTE: freeze what the D loop still needs for this epoch's remaining rounds.
            owed.reached, owed.permit, owed.final, owed.ended = ctl.reached, ctl.permit, ctl.final, True
        if ctl.epoch == epoch_id:
            (ctl.cancel_epoch if cancelled else ctl.end_epoch)(epoch_id)
        self._rec.event("epoch_end", epoch=epoch_id, boundary=ctl.reached,
                        permit=_finite(ctl.permit), state=ctl.state.value)
        self._notify()

    def open_gate(self) -> None:
        """D has no rows: let the active epoch run free (a no-op without an epoch).

        The defined behaviour when D empties mid-epoch (its last row finished, was aborted,
        cancelled or released): the permit becomes inf, so a P waiting for a permit passes at
        once, and D owes the epoch no further round (``before_decode`` returns None). The
        single-rank engine calls it whenever D has no live rows; the lockstep engine at the
        first step where no rank has any (the same step everywhere)."""
        ctl = self.controller
        if ctl.epoch is not None and not math.isinf(ctl.permit):
            ctl.open_gate(ctl.epoch)
            self._rec.event("open_gate", epoch=ctl.epoch, boundary=ctl.reached)
        self._owed.clear()
        self._notify()

    @property
    def gated_epoch_active(self) -> bool:
        """The D loop must order its launches against a P epoch (it owes that epoch rounds)."""
        return bool(self._owed)

    # ------------------------------------------------------------------- D side
    async def before_decode(self) -> Round | None:
        """Wait for P at its endpoint, then rendezvous 1; None when no gated epoch is active."""
        t0 = time.perf_counter()
        async with self._deadline("D boundary wait", self._owed[0] if self._owed else None):
            # Waits until the first owed epoch is ready for a round, serving epochs in order;
            # returns None as soon as nothing is owed any more (gate opened).
            while True:
                if not self._owed:
                    return None
                owed = self._owed[0]
                await self._until(lambda: not self._owed or self._owed[0] is not owed or self._ready(owed))
                if self._owed and self._owed[0] is owed:
                    break
        reached, permit, final = self._view(owed)
        self._rec.sample("d_boundary_wait_s", time.perf_counter() - t0)
        last = (final is not None and reached == final) or (owed.ended and reached < permit)
        rnd = Round(owed.epoch, reached, int(permit), last, owed.ended)
        payloads = await self._arrive("rdv1", (rnd.epoch, rnd.boundary, rnd.permit),
                                      epoch=rnd.epoch, boundary=rnd.boundary)
        assert_agree(payloads, "rdv1", rnd.epoch, rnd.boundary)
        return rnd

    async def after_decode(self, rnd: Round) -> None:
        """Rendezvous 2 (ACK: every rank's D launch call returned), then grant ``p <- p + K``."""
        k_local, inputs = self._local_span()
        payloads = await self._arrive("rdv2", (rnd.epoch, rnd.boundary, rnd.permit, k_local),
                                      epoch=rnd.epoch, boundary=rnd.boundary)
        assert_agree([p[:3] for p in payloads], "rdv2", rnd.epoch, rnd.boundary)
        # NOTE: rank 0's span wins, so every rank grants the same permit.
        k = check_span(payloads[0][3])
        self.rounds += 1
        owed = self._owed[0] if self._owed and self._owed[0].epoch == rnd.epoch else None
        if owed is None:
            return  # the gate was opened meanwhile: nothing left to grant
        if rnd.last:
            self._owed.popleft()
            self._rec.event("d_epoch_done", epoch=rnd.epoch, boundary=rnd.boundary, permit=rnd.permit)
            self._notify()
            return
        ctl = self.controller
        self._log_switch(ctl.span, k, inputs, epoch=rnd.epoch, permit=rnd.permit)
        ctl.set_span(k)
        if not owed.ended:
            new_permit = ctl.grant(rnd.epoch)
        else:
            # NOTE: P left meanwhile; advance the frozen permit exactly as a grant would.
            owed.permit += k
            new_permit = owed.permit
        self._rec.event("grant", epoch=rnd.epoch, boundary=rnd.boundary, permit=new_permit, span=k,
                        tail=owed.ended)
        self._notify()

    # ---------------------------------------------------------------- helpers
    def snapshot(self) -> dict:
        return {**self.controller.snapshot(), "owed": [o.epoch for o in self._owed], "rounds": self.rounds}

    def _view(self, owed: _Owed) -> tuple[int, int | float, int | None]:
        if owed.ended:
            return owed.reached, owed.permit, owed.final
        # NOTE: an owed epoch that has not ended is the controller's active epoch.
        ctl = self.controller
        return ctl.reached, ctl.permit, ctl.final

    def _ready(self, owed: _Owed) -> bool:
        reached, permit, final = self._view(owed)
        return owed.ended or reached == permit or (final is not None and reached == final)

    def _check_current(self, epoch_id: int, what: str) -> None:
        ctl = self.controller
        if ctl.epoch is None:
            raise MissingProducerError(f"{what} at epoch {epoch_id}: no P epoch is active")
        if ctl.epoch != epoch_id:
            raise StaleEpochError(f"{what} at epoch {epoch_id}: the active epoch is {ctl.epoch}")

    def _local_span(self) -> tuple[int, SpanInputs]:
        inputs = self._load() if self._load is not None else SpanInputs()
        return check_span(self._span_policy(inputs)), inputs

    def _log_switch(self, previous: int, chosen: int, inputs: SpanInputs, *, epoch: int | None,
                    permit: int | float) -> None:
        sw = span_switch(previous, chosen, inputs, epoch=epoch, permit=permit)
        if sw is not None:
            logger.info("rank %d span switch %d -> %d at epoch %s permit %s (P queue %d tokens, D rows %d/%d)",
                        self.rank, sw.previous, sw.chosen, sw.epoch, sw.permit,
                        sw.num_p_waiting_tokens, sw.num_d_rows, sw.max_d_rows)
            self._rec.event("span_switch", **sw.as_event())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, pred: Callable[[], bool]) -> None:
        """Wait (without a deadline of its own) until ``pred()`` holds; re-checked at every state change."""
        while True:
            changed = self._changed
            if pred():
                return
            await changed.wait()

    async def _wait_for(self, pred: Callable[[], bool], *, what: str, epoch: int, boundary: int) -> None:
        """Wait until ``pred()`` holds, at most ``timeout_s``; TurnstileTimeout names epoch and boundary."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._until(pred)
        except TimeoutError:
            raise TurnstileTimeout(f"rank {self.rank}: {what} timed out after {self.timeout_s:g} s at "
                                   f"epoch {epoch} boundary {boundary} (permit {self.controller.permit})",
                                   epoch=epoch, boundary=boundary) from None

    @contextlib.asynccontextmanager
    async def _deadline(self, what: str, owed: _Owed | None) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                yield
        except TimeoutError:
            epoch = owed.epoch if owed is not None else None
            reached, permit, _ = self._view(owed) if owed is not None else (None, None, None)
            raise TurnstileTimeout(f"rank {self.rank}: {what} timed out after {self.timeout_s:g} s at "
                                   f"epoch {epoch} boundary {permit} (the permit endpoint; P reached {reached})",
                                   epoch=epoch, boundary=permit) from None

    async def _arrive(self, tag: str, payload: tuple[int, ...], *, epoch: int, boundary: int) -> list[tuple[int, ...]]:
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                payloads = await self._rdv.arrive(tag, payload, epoch=epoch, boundary=boundary)
        except RendezvousTimeout:
            raise
        except TimeoutError:
            raise RendezvousTimeout(f"rank {self.rank}: rendezvous {tag!r} timed out after "
                                    f"{self.timeout_s:g} s at epoch {epoch} boundary {boundary}",
                                    epoch=epoch, boundary=boundary) from None
        dt = time.perf_counter() - t0
        self._rec.count("rendezvous")
        self._rec.sample("rendezvous_s", dt)
        self._rec.event(tag, epoch=epoch, boundary=boundary, permit=payload[2], rdv_s=dt)
        return payloads


def _finite(p: int | float) -> int | None:
    """A permit for the trace: None for an open gate (inf)."""
    return None if isinstance(p, float) and math.isinf(p) else p
