"""One engine step, decided (pure): what every rank announces, and what they all do with it.

Each step the ranks exchange a :class:`StepInputs` (one rank: its own, at once; several: over the
control rendezvous) and each takes the same :class:`StepDecision` from the same list with
:func:`decide_step`. This is the one home of the step's gating, exclusivity and their reason:

* nothing starts while any rank cannot run the model (asleep): every epoch and D iteration needs
  every rank;
* a P epoch starts on every rank when any rank has admissible prefill and none runs an epoch; its
  :class:`~.epoch_mode.EpochMode` comes from the policy's traits, whether decode rows exist, the
  multiplexing activation and, for an activated epoch, whether gating it pays (a large backlog, a
  late first token or, measured, too few rows for the slowdown run it exclusively);
* a D iteration runs on every rank when any rank has decode rows and no exclusive epoch runs; it
  is a verify iteration (speculative decoding, its shape agreed next) when any rank would draft;
* the loop ends on every rank at the same step, once every rank is closing and idle.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum

from .epoch_mode import EpochMode, PolicyTraits, mode_of
from .span import drains_exclusively, guards_first_token, multiplexing_pays

__all__ = ["StepInputs", "StepDecision", "Exclusive", "decide_step"]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What one rank announces at a step (a rendezvous payload of ints, by field)."""

    d_rows: int
    """Decode rows this rank would run now (at most ``scheduler.max_decode_batch``)."""
    p_tokens: int
    """Prefill tokens this rank would admit now (0 while its epoch runs, or on a TP follower)."""
    p_running: bool
    """This rank still runs the last epoch."""
    clock_ms: int
    """This rank's clock (rank 0's drives the activation on every rank)."""
    closing: bool
    """This rank's client is done: the loop ends once every rank is closing and idle."""
    waiting_turns: int
    """Turns queued for prefill (their first token not out)."""
    slowdown_milli: int
    """P's measured slowdown beside D, x1000 (rank 0's is used)."""
    backlog_tokens: int
    """Prompt tokens left to prefill in the waiting turns."""
    oldest_wait_ms: int
    """How long the longest-waiting turn has waited."""
    device_ready: bool
    """The KV pool and the weights are on the device and the rank is not going to sleep."""
    d_drafting: bool = False
    """This rank's speculator would draft for its rows now (``spec.method``, a replica leader of
    several ranks: :meth:`~ainfer_pd.spec.speculator.Speculator.worth_drafting`)."""
    stash_drops: int = 0
    """MTP stashes this replica leader forgot since it last announced them, which its TP followers
    drop at this step (``spec.method: mtp`` under attention TP: ``MtpReplica.drop_stashes``)."""

    def to_payload(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_payload(cls, payload) -> "StepInputs":
        return cls(*(bool(v) if f.type == "bool" else int(v) for f, v in zip(fields(cls), payload, strict=True)))


class Exclusive(StrEnum):
    """Why an epoch is not gated (with decode rows, D waits for it): the trace's ``p_epoch`` event."""

    NO_D = "no-d"            # no decode rows
    POLICY = "policy"        # the policy has no turnstile
    INACTIVE = "inactive"    # the multiplexing activation is off
    BACKLOG = "backlog"      # mux.exclusive_backlog_tokens
    WAIT = "wait"            # mux.exclusive_wait_s
    COST = "cost"            # mux.activation_cost measured: gating does not pay


COUNTERS = {Exclusive.BACKLOG: "backlog_exclusive", Exclusive.WAIT: "wait_exclusive",
            Exclusive.COST: "activation_declined"}
"""The recorder counter of each declined-gating reason."""


@dataclass(frozen=True, slots=True)
class StepDecision:
    stop: bool = False
    """Every rank is closing and idle: the loop ends (the same step everywhere)."""
    asleep: tuple[int, ...] = ()
    """Ranks that cannot run the model: nothing starts anywhere."""
    not_closing: tuple[int, ...] = ()
    """Ranks whose client is still serving."""
    epoch: EpochMode | None = None
    """Start a P epoch of this mode on every rank."""
    why: Exclusive | None = None
    """Why the epoch started is not gated (None: gated, or no epoch starts)."""
    run_d: bool = False
    """Run one D iteration on every rank."""
    d_rows: int = 0
    """The largest D batch any rank announced (each rank pads its batch to the agreed size)."""
    p_running: bool = False
    """An epoch runs (or starts) on some rank."""
    open_gate: bool = False
    """No rank has decode rows: no D round is owed to a gated epoch, whose gate opens."""
    verify: bool = False
    """The D iteration may verify drafts (some rank would draft): every rank agrees its shape
    first (:mod:`ainfer_pd.spec.verify_shape`), a rank without drafts included."""


def _gating_declined(states: list[StepInputs], d_rows: int, mux) -> Exclusive | None:
    """Why an activated epoch runs exclusively after all (None: gated). Every rank passes the same
    agreed inputs: the sums, the longest wait, rank 0's slowdown."""
    if drains_exclusively(sum(s.backlog_tokens for s in states), mux.exclusive_backlog_tokens):
        return Exclusive.BACKLOG
    if guards_first_token(max(s.oldest_wait_ms for s in states) / 1000.0, mux.exclusive_wait_s):
        return Exclusive.WAIT
    if mux.activation_cost == "none":
        return None
    if not multiplexing_pays(d_rows, sum(s.waiting_turns for s in states), states[0].slowdown_milli / 1000.0):
        return Exclusive.COST
    return None


def decide_step(states: list[StepInputs], traits: PolicyTraits, mux, *, activation_on: bool,
                exclusive_running: bool) -> StepDecision:
    """The decision of one step from every rank's inputs (rank order). ``mux``: the ``mux``
    config section; ``activation_on``: the multiplexing activation, updated from the agreed totals
    and rank 0's clock; ``exclusive_running``: the epoch still running was started exclusive."""
    not_closing = tuple(r for r, s in enumerate(states) if not s.closing)
    running = any(s.p_running for s in states)
    d_rows = max(s.d_rows for s in states)
    total_p = sum(s.p_tokens for s in states)
    idle = not (d_rows or total_p or running)
    asleep = tuple(r for r, s in enumerate(states) if not s.device_ready)
    if asleep:
        return StepDecision(stop=not not_closing and idle, asleep=asleep, not_closing=not_closing,
                            p_running=running, open_gate=True)
    if not not_closing and idle:
        return StepDecision(stop=True)
    epoch, why = None, None
    exclusive = exclusive_running and running
    if total_p and not running:
        gated = traits.turnstile and d_rows > 0 and activation_on
        why = (Exclusive.NO_D if not d_rows else Exclusive.POLICY if not traits.turnstile
               else None if activation_on else Exclusive.INACTIVE)
        if gated:
            why = _gating_declined(states, sum(s.d_rows for s in states), mux)
            gated = why is None
        epoch = mode_of(traits, d_rows > 0, gated)
        exclusive, running = epoch.exclusive, True
    run_d = d_rows > 0 and not exclusive
    return StepDecision(not_closing=not_closing, epoch=epoch, why=why if epoch is not None and not epoch.gated else None,
                        run_d=run_d, d_rows=d_rows, p_running=running, open_gate=d_rows == 0,
                        verify=run_d and any(s.d_drafting for s in states))
