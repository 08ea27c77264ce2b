"""Pure turnstile state machine for one rank (SPEC 3.2): no asyncio, no clock.

Per P epoch ``e`` it tracks the boundaries P has published (``0, 1, ...``, strictly
increasing, skipping only upward), the largest reached boundary ``r``, the permit
endpoint ``p`` and the span ``K``. P may issue communication beyond boundary ``b`` iff
``b < p``; when P reaches ``b == p`` it stops and the D loop may run one round, after
which the ranks grant ``p <- p + K``.

Boundary 0 means "P is about to enter the device". Start rule: ``p = 0`` (a ready D is
ordered before P enters the device), ``p = K`` when D is already enqueued, ``p = inf``
when the epoch is not gated (no D to order against).

Every rejected transition raises a typed :class:`~ainfer_pd.errors.TurnstileError`
and leaves the state unchanged (all checks run before any mutation).
"""
from __future__ import annotations

import enum
import math

from ..errors import (EndpointNotReachedError, EpochActiveError, InvalidSpanError,
                      MissingProducerError, NonMonotonicBoundaryError, PermitExceededError,
                      StaleEpochError, TurnstileError)
from ..sched.span import MAX_SPAN, MIN_SPAN  # the span bounds' one home (the paper's 1..4: FIXED_SPANS)


class TaskState(enum.Enum):
    IDLE = "idle"                # no epoch begun yet
    RUNNING = "running"          # P may still make progress towards the permit
    AT_ENDPOINT = "at_endpoint"  # P reached the permit endpoint and stopped communicating
    DONE = "done"                # the last epoch ended normally
    CANCELLED = "cancelled"      # the last epoch was cancelled


def check_span(k: object) -> int:
    """Return ``k`` if it is a valid span (an int in MIN_SPAN..MAX_SPAN), else raise InvalidSpanError."""
    if isinstance(k, bool) or not isinstance(k, int) or not MIN_SPAN <= k <= MAX_SPAN:
        raise InvalidSpanError(f"span {k!r} is not a validated span ({MIN_SPAN}..{MAX_SPAN})")
    return k


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TurnstileError(f"{name} must be an int, got {value!r}")
    return value


class TurnstileController:
    """Turnstile state of one rank; one P epoch at a time."""

    def __init__(self, span: int = 2) -> None:
        self.span: int = check_span(span)
        self.epoch: int | None = None
        self.last_epoch: int = -1
        self.reached: int = -1
        self.permit: int | float = 0
        self.final: int | None = None
        """The final boundary of the active epoch, once P declared it (``publish(final=True)``)."""
        self.gated: bool = False
        self.state: TaskState = TaskState.IDLE

    # ----------------------------------------------------------------- epochs
    def begin_epoch(self, epoch: int, *, d_enqueued: bool, gated: bool = True) -> None:
        """Start P epoch ``epoch`` (strictly larger than every epoch begun before)."""
        _check_int("epoch", epoch)
        if epoch <= self.last_epoch:
            kind = "duplicate" if epoch == self.last_epoch else "stale"
            raise StaleEpochError(f"{kind} epoch {epoch}: epoch {self.last_epoch} was already begun")
        if self.epoch is not None:
            raise EpochActiveError(f"cannot begin epoch {epoch}: epoch {self.epoch} is still active")
        self.epoch = epoch
        self.last_epoch = epoch
        self.reached = -1
        self.final = None
        self.gated = bool(gated)
        if not gated:
            self.permit = math.inf
        else:
            self.permit = self.span if d_enqueued else 0
        self.state = TaskState.RUNNING

    def end_epoch(self, epoch: int) -> None:
        """P finished epoch ``epoch`` normally."""
        self._check_active(epoch, "end")
        self.epoch = None
        self.state = TaskState.DONE

    def cancel_epoch(self, epoch: int) -> None:
        """P epoch ``epoch`` was cancelled (abort, error, task cancellation)."""
        self._check_active(epoch, "cancel")
        self.epoch = None
        self.state = TaskState.CANCELLED

    # -------------------------------------------------------------- P side
    def may_pass(self, boundary: int) -> bool:
        """P may issue communication beyond ``boundary`` iff an epoch is active and ``boundary < p``."""
        return self.epoch is not None and boundary < self.permit

    def publish(self, epoch: int, boundary: int, *, final: bool = False) -> None:
        """P reached ``boundary`` (``final``: the last boundary of this epoch)."""
        self._check_active(epoch, "publish")
        _check_int("boundary", boundary)
        if self.final is not None:
            raise NonMonotonicBoundaryError(
                f"epoch {epoch}: boundary {boundary} after the final boundary {self.final}")
        if boundary <= self.reached:
            raise NonMonotonicBoundaryError(
                f"epoch {epoch}: boundary {boundary} is not after reached boundary {self.reached}")
        if boundary > self.permit:
            raise PermitExceededError(
                f"epoch {epoch}: endpoint {boundary} is beyond permit {self.permit}")
        self.reached = boundary
        if final:
            self.final = boundary
        # NOTE: reached <= permit holds after every accepted publish.
        self.state = TaskState.AT_ENDPOINT if boundary == self.permit else TaskState.RUNNING

    def at_endpoint(self) -> bool:
        """P stands at the permit endpoint (``r == p``)."""
        return self.epoch is not None and self.reached == self.permit

    # -------------------------------------------------------------- D side
    def grant(self, epoch: int) -> int | float:
        """D's enqueue phase is done: ``p <- p + K``; returns the new permit."""
        self._check_active(epoch, "grant")
        if self.reached != self.permit:
            raise EndpointNotReachedError(
                f"grant at epoch {epoch}: P reached boundary {self.reached}, not the permit "
                f"endpoint {self.permit} (D must wait for the boundary first)")
        # NOTE: the permit only grows within an epoch.
        self.permit = self.permit + self.span
        self.state = TaskState.RUNNING
        return self.permit

    def open_gate(self, epoch: int) -> None:
        """No D to order against any more: P runs free until the epoch ends (``p = inf``)."""
        self._check_active(epoch, "open the gate of")
        self.permit = math.inf
        self.state = TaskState.RUNNING

    def set_span(self, k: int) -> None:
        """The span used by the next grant (and by the next ``d_enqueued`` start)."""
        self.span = check_span(k)

    # ------------------------------------------------------------- helpers
    def snapshot(self) -> dict:
        """Plain copy of the state (``permit`` is ``math.inf`` when the gate is open)."""
        return {"epoch": self.epoch, "last_epoch": self.last_epoch, "reached": self.reached,
                "permit": self.permit, "final": self.final, "span": self.span,
                "gated": self.gated, "state": self.state.value}

    def _check_active(self, epoch: int, what: str) -> None:
        if self.epoch is None:
            raise MissingProducerError(f"cannot {what} epoch {epoch}: no P epoch is active")
        if epoch != self.epoch:
            raise StaleEpochError(f"cannot {what} epoch {epoch}: the active epoch is {self.epoch}")
