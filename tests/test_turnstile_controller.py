"""Property tests of the pure turnstile controller (SPEC 3.2)."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ainfer_pd.errors import (EndpointNotReachedError, EpochActiveError, InvalidSpanError,
                              MissingProducerError, NonMonotonicBoundaryError, PermitExceededError,
                              StaleEpochError, TurnstileError)
from ainfer_pd.turnstile.controller import TaskState, TurnstileController


# --------------------------------------------------------------- examples
def test_a_fresh_controller_is_idle_with_no_epoch():
    ctl = TurnstileController()
    assert (ctl.epoch, ctl.last_epoch, ctl.reached, ctl.span, ctl.state) == (None, -1, -1, 2, TaskState.IDLE)
    assert not ctl.may_pass(0) and not ctl.at_endpoint()


def test_a_ready_d_is_ordered_before_p_enters_the_device():
    ctl = TurnstileController(span=2)
    ctl.begin_epoch(0, d_enqueued=False)
    assert ctl.permit == 0 and not ctl.may_pass(0)
    ctl.publish(0, 0)
    assert ctl.at_endpoint() and ctl.state is TaskState.AT_ENDPOINT
    assert ctl.grant(0) == 2
    assert ctl.may_pass(0) and ctl.may_pass(1) and not ctl.may_pass(2)


def test_an_already_enqueued_d_lets_p_start_with_one_span():
    ctl = TurnstileController(span=3)
    ctl.begin_epoch(5, d_enqueued=True)
    assert ctl.permit == 3
    ctl.publish(5, 0)
    ctl.publish(5, 3)  # one span may cover several backend boundaries
    assert ctl.at_endpoint()


def test_an_ungated_epoch_runs_free():
    ctl = TurnstileController()
    ctl.begin_epoch(0, d_enqueued=False, gated=False)
    assert ctl.permit == math.inf and ctl.may_pass(10**9)


def test_stale_and_duplicate_epochs_are_rejected():
    ctl = TurnstileController()
    ctl.begin_epoch(3, d_enqueued=False)
    ctl.end_epoch(3)
    with pytest.raises(StaleEpochError, match="duplicate"):
        ctl.begin_epoch(3, d_enqueued=False)
    with pytest.raises(StaleEpochError, match="stale"):
        ctl.begin_epoch(2, d_enqueued=False)


def test_a_grant_before_the_endpoint_is_rejected():
    ctl = TurnstileController()
    ctl.begin_epoch(0, d_enqueued=True)
    ctl.publish(0, 1)
    with pytest.raises(EndpointNotReachedError):
        ctl.grant(0)


def test_nothing_may_follow_the_final_boundary():
    ctl = TurnstileController(span=4)
    ctl.begin_epoch(0, d_enqueued=True)
    ctl.publish(0, 2, final=True)
    assert ctl.final == 2
    with pytest.raises(NonMonotonicBoundaryError, match="final"):
        ctl.publish(0, 3)


# ------------------------------------------------------ reference model
class Model:
    """The rules of SPEC 3.2 written as plainly as possible."""

    def __init__(self, span: int) -> None:
        self.epoch = None
        self.last_epoch = -1
        self.reached = -1
        self.permit: float = 0
        self.final = None
        self.span = span
        self.gated = False
        self.state = "idle"

    def snapshot(self) -> dict:
        return {"epoch": self.epoch, "last_epoch": self.last_epoch, "reached": self.reached,
                "permit": self.permit, "final": self.final, "span": self.span,
                "gated": self.gated, "state": self.state}

    def active_error(self, epoch):
        if self.epoch is None:
            return MissingProducerError
        if epoch != self.epoch:
            return StaleEpochError
        return None


EPOCHS = st.integers(-2, 12)


class ControllerMachine(RuleBasedStateMachine):
    """Random begin/publish/grant/open/end/cancel/set_span events, valid and invalid."""

    @initialize(span=st.integers(1, 4))
    def start(self, span):
        self.ctl = TurnstileController(span=span)
        self.model = Model(span)
        self.begun: list[int] = []
        self.permits: list[float] = []

    def _epoch_arg(self, data, base):
        """Mostly the interesting epoch (active / next), sometimes a neighbour or any int."""
        pick = data.draw(st.sampled_from(["base", "base", "base", "next", "prev", "any"]))
        if pick == "any":
            return data.draw(EPOCHS)
        return base + {"base": 0, "next": 1, "prev": -1}[pick]

    def _model_begin(self, epoch: int, gated: bool, d_enqueued: bool) -> None:
        """The reference model's side of a valid begin_epoch (start rule of SPEC 3.2)."""
        m = self.model
        m.epoch = m.last_epoch = epoch
        m.reached, m.final, m.gated, m.state = -1, None, gated, "running"
        m.permit = math.inf if not gated else (m.span if d_enqueued else 0)
        self.begun.append(epoch)
        self.permits = [m.permit]

    def _attempt(self, op, error, apply):
        before = self.ctl.snapshot()
        if error is not None:
            with pytest.raises(TurnstileError) as info:
                op()
            assert type(info.value) is error, f"expected {error.__name__}, got {info.value!r}"
            assert self.ctl.snapshot() == before, "a rejected transition changed the state"
            return
        result = op()
        apply()
        assert self.ctl.snapshot() == self.model.snapshot()
        return result

    @rule(data=st.data(), d_enqueued=st.booleans(), gated=st.booleans())
    def begin(self, data, d_enqueued, gated):
        m = self.model
        epoch = self._epoch_arg(data, m.last_epoch + 1)
        error = StaleEpochError if epoch <= m.last_epoch else EpochActiveError if m.epoch is not None else None

        self._attempt(lambda: self.ctl.begin_epoch(epoch, d_enqueued=d_enqueued, gated=gated), error,
                      lambda: self._model_begin(epoch, gated, d_enqueued))

    @rule(data=st.data(), final=st.booleans())
    def publish(self, data, final):
        m = self.model
        epoch = self._epoch_arg(data, m.epoch if m.epoch is not None else m.last_epoch)
        upper = m.permit if m.permit != math.inf else m.reached + 5
        near = st.integers(max(m.reached, -1), int(upper) + 1)  # around the valid range and just beyond
        boundary = data.draw(st.one_of(near, near, st.integers(-2, 14)))
        error = m.active_error(epoch)
        if error is None:
            if m.final is not None or boundary <= m.reached:
                error = NonMonotonicBoundaryError
            elif boundary > m.permit:
                error = PermitExceededError

        def apply():
            m.reached = boundary
            if final:
                m.final = boundary
            m.state = "at_endpoint" if boundary == m.permit else "running"
        self._attempt(lambda: self.ctl.publish(epoch, boundary, final=final), error, apply)

    @rule(data=st.data())
    def grant(self, data):
        m = self.model
        epoch = self._epoch_arg(data, m.epoch if m.epoch is not None else m.last_epoch)
        error = m.active_error(epoch) or (EndpointNotReachedError if m.reached != m.permit else None)

        def apply():
            m.permit = m.permit + m.span
            m.state = "running"
            self.permits.append(m.permit)
        new = self._attempt(lambda: self.ctl.grant(epoch), error, apply)
        if error is None:
            assert new == m.permit

    @rule(data=st.data(), often=st.integers(0, 4))
    def open_gate(self, data, often):
        if often:  # an open gate ends all ordering in the epoch: keep it rare
            return
        m = self.model
        epoch = self._epoch_arg(data, m.epoch if m.epoch is not None else m.last_epoch)

        def apply():
            m.permit, m.state = math.inf, "running"
            self.permits.append(m.permit)
        self._attempt(lambda: self.ctl.open_gate(epoch), m.active_error(epoch), apply)

    @rule(k=st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 64, 65]))
    def set_span(self, k):
        def apply():
            self.model.span = k
        self._attempt(lambda: self.ctl.set_span(k), None if 1 <= k <= 64 else InvalidSpanError, apply)

    @rule(data=st.data(), cancel=st.booleans())
    def finish(self, data, cancel):
        m = self.model
        epoch = self._epoch_arg(data, m.epoch if m.epoch is not None else m.last_epoch)

        def apply():
            m.epoch, m.state = None, ("cancelled" if cancel else "done")
        op = (lambda: self.ctl.cancel_epoch(epoch)) if cancel else (lambda: self.ctl.end_epoch(epoch))
        self._attempt(op, m.active_error(epoch), apply)

    # Valid moves, so that long legal runs (and grants at endpoints) are common.
    @precondition(lambda self: self.model.epoch is None)
    @rule(step=st.integers(1, 3), d_enqueued=st.booleans(), gated=st.booleans())
    def begin_the_next_epoch(self, step, d_enqueued, gated):
        m = self.model
        epoch = m.last_epoch + step

        self._attempt(lambda: self.ctl.begin_epoch(epoch, d_enqueued=d_enqueued, gated=gated), None,
                      lambda: self._model_begin(epoch, gated, d_enqueued))

    @precondition(lambda self: self.model.epoch is not None and self.model.final is None
                  and self.model.reached < self.model.permit)
    @rule(step=st.integers(1, 3), final=st.integers(0, 9))
    def p_reaches_a_later_boundary(self, step, final):
        m = self.model
        boundary = int(min(m.reached + step, m.permit))
        is_final = final == 0

        def apply():
            m.reached = boundary
            if is_final:
                m.final = boundary
            m.state = "at_endpoint" if boundary == m.permit else "running"
        self._attempt(lambda: self.ctl.publish(m.epoch, boundary, final=is_final), None, apply)

    @precondition(lambda self: self.model.epoch is not None and self.model.reached == self.model.permit)
    @rule()
    def d_grants_at_the_endpoint(self):
        m = self.model
        assert self.ctl.at_endpoint()

        def apply():
            m.permit = m.permit + m.span
            m.state = "running"
            self.permits.append(m.permit)
        assert self._attempt(lambda: self.ctl.grant(m.epoch), None, apply) == m.permit

    @precondition(lambda self: self.model.epoch is not None)
    @rule(boundary=st.integers(-2, 14))
    def may_pass_matches_the_permit(self, boundary):
        assert self.ctl.may_pass(boundary) == (boundary < self.model.permit)

    @invariant()
    def reached_never_exceeds_the_permit(self):
        if hasattr(self, "ctl") and self.ctl.epoch is not None:
            assert self.ctl.reached <= self.ctl.permit

    @invariant()
    def the_permit_only_grows_within_an_epoch(self):
        if hasattr(self, "permits"):
            assert self.permits == sorted(self.permits)

    @invariant()
    def epochs_strictly_increase(self):
        if hasattr(self, "begun"):
            assert all(a < b for a, b in zip(self.begun, self.begun[1:]))


ControllerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
test_random_event_sequences_keep_the_invariants_and_reject_every_invalid_transition = ControllerMachine.TestCase


# ------------------------------------------------------- valid schedules
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_valid_schedules_are_never_rejected_and_every_d_round_happens_at_an_endpoint(data):
    """Random spans, random D presence, random boundary counts and skips: a correct P and D never err."""
    ctl = TurnstileController(span=data.draw(st.integers(1, 4)))
    epoch = data.draw(st.integers(0, 3))
    for _ in range(data.draw(st.integers(1, 4))):
        epoch += data.draw(st.integers(1, 3))
        last = data.draw(st.integers(0, 12), label="final boundary")
        gated = data.draw(st.booleans())
        ctl.begin_epoch(epoch, d_enqueued=data.draw(st.booleans()), gated=gated)
        cancel_at = data.draw(st.one_of(st.none(), st.integers(0, 12)), label="cancel at boundary")
        endpoints, rounds = set(), 0
        while ctl.reached < last:
            if cancel_at is not None and ctl.reached >= cancel_at:
                break
            if ctl.at_endpoint():
                # D's turn: a round (optionally with a new span), or no D left to order against.
                endpoints.add(ctl.reached)
                if data.draw(st.integers(0, 9)) == 0:
                    ctl.open_gate(epoch)
                else:
                    if data.draw(st.booleans()):
                        ctl.set_span(data.draw(st.integers(1, 4)))
                    assert ctl.at_endpoint()
                    ctl.grant(epoch)
                    rounds += 1
                continue
            assert ctl.reached == -1 or ctl.may_pass(ctl.reached)
            step = 1 if ctl.reached < 0 else data.draw(st.integers(1, 3))
            boundary = int(min(ctl.reached + step, ctl.permit, last))
            ctl.publish(epoch, boundary, final=boundary == last and data.draw(st.booleans()))
            assert ctl.reached <= ctl.permit
        if ctl.at_endpoint() and data.draw(st.booleans()):
            ctl.grant(epoch)  # a D round at the final endpoint is valid too
            rounds += 1
        assert rounds <= len(endpoints) + 1
        if cancel_at is not None and ctl.reached < last:
            ctl.cancel_epoch(epoch)
            assert ctl.state is TaskState.CANCELLED
        else:
            ctl.end_epoch(epoch)
            assert ctl.state is TaskState.DONE
        assert ctl.epoch is None and ctl.last_epoch == epoch
