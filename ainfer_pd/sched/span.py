"""Span policy and activation of the multiplexed path (SPEC 3.6), pure functions over plain data.

A span policy maps the current load (:class:`SpanInputs`) to the turnstile span ``K``
(how many safe boundaries P may cross per D round). Smaller ``K`` gives D more entry
points but costs more rendezvous and P enqueue overhead; larger ``K`` makes D wait
longer. The paper's selector chose ``K = 2`` in all runs, so ``auto`` defaults to it.

Policy never changes a correctness contract: it only chooses among validated spans.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError

MIN_SPAN = 1
MAX_SPAN = 64
"""The spans the turnstile accepts (:func:`ainfer_pd.turnstile.controller.check_span`; this is
their one home). Its order holds for any span; the cap bounds how long D may wait for P's next
entry point. The ``measured`` policy may go up to it on deep models (48 layers: 96 boundaries)."""
FIXED_SPANS = (1, 2, 3, 4)
"""The spans the paper validated: the fixed and ``auto`` policies choose among these."""
DEFAULT_SPAN = 2


@dataclass(frozen=True)
class SpanInputs:
    num_d_rows: int = 0
    """Decode rows in the current D batch."""
    max_d_rows: int = 0
    """D batch capacity (0 = unknown)."""
    num_p_waiting_tokens: int = 0
    """New tokens of every P request waiting or running."""
    p_budget_tokens: int = 0
    """Token budget of one P epoch (0 = unknown)."""
    num_boundaries_left: int = 0
    """Safe boundaries the active P epoch has still to cross (informational)."""
    d_iter_s: float = 0.0
    """Recent D iteration time, launch to completion (0 = unknown)."""
    p_boundary_s: float = 0.0
    """Recent P time per safe boundary when P runs (0 = unknown)."""

    @property
    def d_occupancy(self) -> float:
        """Fraction of the D batch in use (0 when the capacity is unknown)."""
        return self.num_d_rows / self.max_d_rows if self.max_d_rows > 0 else 0.0

    @property
    def p_pressure(self) -> float:
        """Waiting P tokens in units of one epoch budget (0 when the budget is unknown)."""
        return self.num_p_waiting_tokens / self.p_budget_tokens if self.p_budget_tokens > 0 else 0.0


SpanPolicy = Callable[[SpanInputs], int]
"""A callable ``(SpanInputs) -> K`` with ``K`` a span the turnstile accepts (MIN_SPAN..MAX_SPAN)."""


def _validate_span(k: object, what: str) -> int:
    """``k`` if it is one of :data:`FIXED_SPANS` (a fixed or ``auto`` span), else :class:`ConfigError`."""
    if isinstance(k, bool) or not isinstance(k, int) or k not in FIXED_SPANS:
        raise ConfigError(f"{what}={k!r}: a span must be an integer in {FIXED_SPANS[0]}..{FIXED_SPANS[-1]}")
    return k


@dataclass(frozen=True)
class FixedSpan:
    k: int
    name: str = "fixed"

    def __call__(self, inputs: SpanInputs) -> int:
        return self.k


@dataclass(frozen=True)
class AutoSpan:
    """Load-selected span among validated spans; deterministic.

    Rules, first match wins (``occ`` = D occupancy, ``pres`` = P pressure):

    (``d_iter_s`` / ``p_boundary_s`` are logged with every switch but do not decide: a rule
    that matched K P-boundaries to one D iteration measured 9% worse than span 2 on the CPU
    sweep, see docs/history.md.)

    1. load unknown (``max_d_rows`` or ``p_budget_tokens`` is 0) -> the default span;
    2. ``occ >= high_occupancy`` and ``pres < low_pressure`` -> the smallest span
       (a full D batch with little P behind it: give D the most entry points);
    3. ``pres >= high_pressure`` and ``occ <= low_occupancy`` -> the largest span
       (a P backlog with few D rows: fewer rendezvous, less P enqueue overhead);
    4. otherwise the default span: the allowed span closest to 2 (ties -> the smaller).
    """
    spans: tuple[int, ...] = FIXED_SPANS
    high_occupancy: float = 0.75
    low_pressure: float = 0.5
    high_pressure: float = 1.0
    low_occupancy: float = 0.25
    name: str = "auto"

    @property
    def default(self) -> int:
        return min(self.spans, key=lambda k: (abs(k - DEFAULT_SPAN), k))

    def __call__(self, inputs: SpanInputs) -> int:
        if inputs.max_d_rows <= 0 or inputs.p_budget_tokens <= 0:
            return self.default
        occ, pres = inputs.d_occupancy, inputs.p_pressure
        if occ >= self.high_occupancy and pres < self.low_pressure:
            return min(self.spans)
        if pres >= self.high_pressure and occ <= self.low_occupancy:
            return max(self.spans)
        return self.default


class MeasuredSpan:
    """The span from what was measured, not assumed: P may cross as many boundaries per D round
    as its measured time per boundary fits into ``share`` of the measured D iteration time,
    ``K = clamp(floor(share * d_iter_s / p_boundary_s), 1, max_span)``, so deep models (96
    boundaries) are not throttled to a fixed handful a round. Hysteresis: the span moves only
    when the answer differs from the current one by more than ``hysteresis`` of it (EMA inputs
    jitter). Unknown times keep the current span (``start`` at first). Rank 0's answer is used
    on every rank (the turnstile's rule), so the local state never splits the ranks."""

    name = "measured"

    def __init__(self, share: float = 1.0, max_span: int = 32, hysteresis: float = 0.25, start: int = DEFAULT_SPAN):
        self.share, self.max_span, self.hysteresis = float(share), int(max_span), float(hysteresis)
        self.current = max(MIN_SPAN, min(start, self.max_span))

    def target(self, inputs: SpanInputs) -> int | None:
        d, p = inputs.d_iter_s, inputs.p_boundary_s
        if d <= 0 or p <= 0:
            return None
        return max(MIN_SPAN, min(self.max_span, int(self.share * d / p)))

    def __call__(self, inputs: SpanInputs) -> int:
        k = self.target(inputs)
        if k is not None and abs(k - self.current) > self.hysteresis * self.current:
            self.current = k
        return self.current


def fixed_span(k: int) -> FixedSpan:
    """The span policy that always answers ``k`` (validated: 1..4)."""
    return FixedSpan(_validate_span(k, "span"))


def auto_span(spans: tuple[int, ...] = FIXED_SPANS) -> AutoSpan:
    """The load-selected span policy choosing among ``spans`` (each validated: 1..4)."""
    spans = tuple(spans)
    if not spans:
        raise ConfigError("auto_spans must name at least one span")
    for k in spans:
        _validate_span(k, "auto_spans")
    return AutoSpan(tuple(sorted(set(spans))))


def make_span_policy(mux_cfg) -> FixedSpan | AutoSpan | MeasuredSpan:
    """The span policy of a :class:`~ainfer_pd.config.MuxConfig` (``span``: "1".."4", "auto" or "measured")."""
    span = str(mux_cfg.span)
    if span == "auto":
        return auto_span(tuple(mux_cfg.auto_spans))
    if span == "measured":
        return MeasuredSpan(mux_cfg.measured_share, mux_cfg.max_span)
    try:
        k = int(span)
    except ValueError:
        raise ConfigError(f"mux.span={mux_cfg.span!r}: expected 1..4 or auto") from None
    return fixed_span(k)


@dataclass(frozen=True)
class SpanSwitch:
    """One change of the span, logged with the load that caused it."""
    epoch: int | None
    previous: int
    chosen: int
    permit: int | float
    num_p_waiting_tokens: int
    num_d_rows: int
    max_d_rows: int

    def as_event(self) -> dict:
        """Fields for ``recorder.event("span_switch", ...)`` (an open gate's permit as None)."""
        return {"epoch": self.epoch, "previous": self.previous, "chosen": self.chosen,
                "permit": None if math.isinf(self.permit) else self.permit,
                "p_queue_tokens": self.num_p_waiting_tokens, "d_rows": self.num_d_rows,
                "d_capacity": self.max_d_rows}


def span_switch(previous: int, chosen: int, inputs: SpanInputs, *, epoch: int | None,
                permit: int | float) -> SpanSwitch | None:
    """The :class:`SpanSwitch` record when ``chosen`` differs from ``previous``, else None."""
    if chosen == previous:
        return None
    return SpanSwitch(epoch=epoch, previous=previous, chosen=chosen, permit=permit,
                      num_p_waiting_tokens=inputs.num_p_waiting_tokens,
                      num_d_rows=inputs.num_d_rows, max_d_rows=inputs.max_d_rows)


class Activation:
    """Switches the multiplexed P/D path on only while concurrent P exists.

    On when ``num_p_waiting >= threshold`` and ``num_d_rows > 0``; once on, it stays on
    until the condition has been false for ``cooldown_s``. ``switches`` counts every
    on/off transition. ``now`` is any monotonic clock in seconds.
    """

    def __init__(self, threshold: int = 1, cooldown_s: float = 0.05) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ConfigError(f"activation threshold must be an integer >= 1, got {threshold!r}")
        if not cooldown_s >= 0:
            raise ConfigError(f"activation cooldown must be >= 0 s, got {cooldown_s!r}")
        self.threshold = threshold
        self.cooldown_s = float(cooldown_s)
        self.on = False
        self.switches = 0
        self._last_true: float | None = None

    def update(self, now: float, num_p_waiting: int, num_d_rows: int) -> bool:
        """Feed the current load; returns whether the multiplexed path is on."""
        cond = num_p_waiting >= self.threshold and num_d_rows > 0
        if cond:
            self._last_true = now
            new = True
        elif self.on:
            # NOTE: stays on while now - last_true < cooldown_s (a cooldown of 0 turns off at once).
            new = self._last_true is not None and now - self._last_true < self.cooldown_s
        else:
            new = False
        if new != self.on:
            self.switches += 1
            self.on = new
        return self.on


def make_activation(mux_cfg) -> Activation:
    """The :class:`Activation` of a :class:`~ainfer_pd.config.MuxConfig`."""
    return Activation(mux_cfg.activation_threshold, mux_cfg.activation_cooldown_s)


# ---------------------------------------------------------------- the cost of gating one epoch
ACTIVATION_COSTS = ("none", "measured")
"""``mux.activation_cost``: ``none`` gates every epoch the activation lets through; ``measured``
gates one only while :func:`multiplexing_pays` at P's measured slowdown. (``none``, not ``off``:
YAML reads a bare ``off`` as false.)"""


def multiplexing_pays(num_d_rows: int, num_turns: int, slowdown: float) -> bool:
    """Whether a P epoch should run gated beside D rather than exclusively (as under normal).

    An epoch of length E run exclusively holds every decode row for E; run gated, D goes on
    but the epoch takes ``slowdown`` x E, so each turn waiting for P (this epoch's and those
    queued behind it) gets its first token (slowdown - 1) x E later. Gating pays when the rows
    it frees outnumber the turns it delays by that factor:
    ``num_d_rows > num_turns * (slowdown - 1)``. A burst of first turns beside a few rows runs
    exclusively; a few continuations beside a full batch run gated.
    """
    return num_d_rows > num_turns * max(0.0, slowdown - 1.0)


def drains_exclusively(backlog_tokens: int, cap_tokens: int) -> bool:
    """Whether a P epoch should run exclusively because the prefill backlog is large: more than
    ``cap_tokens`` (0: never) prompt tokens left to prefill in the waiting turns (the epoch's own
    included). A burst (the first turns of a rollout) then drains at P's full speed, as under
    normal, and only its tail is multiplexed:
    gated beside D, every epoch of the burst would add P's slowdown to the first token of every
    turn queued behind it, and the last of them are the p99 of first-token latency."""
    return cap_tokens > 0 and backlog_tokens > cap_tokens


def guards_first_token(oldest_wait_s: float, cap_s: float) -> bool:
    """Whether a P epoch should run exclusively because a waiting turn's first token is late: the
    longest-waiting turn (the epoch's own included) has waited more than ``cap_s`` (0: never)
    since it was submitted. Gated, the epoch would stretch that first token by P's slowdown
    beside D; exclusive, it comes out as fast as under normal. Where no turn is late, the rule
    does nothing, so it costs D only where first-token latency is already at stake."""
    return cap_s > 0 and oldest_wait_s > cap_s


class SlowdownMeter:
    """P's measured slowdown beside D: the EMA of a gated epoch's time per token over the EMA of
    an exclusive one's (>= 1). ``initial`` until both kinds have been seen."""

    def __init__(self, initial: float = 2.0, alpha: float = 0.3) -> None:
        if not initial >= 1.0 or not 0.0 < alpha <= 1.0:
            raise ConfigError(f"slowdown meter: initial must be >= 1 and alpha in (0, 1], got {initial}, {alpha}")
        self.initial = float(initial)
        self.alpha = float(alpha)
        self._per_token = {True: 0.0, False: 0.0}      # gated -> EMA of seconds per token

    def observe(self, gated: bool, seconds: float, tokens: int) -> None:
        if tokens <= 0 or not seconds > 0.0:
            return
        x = seconds / tokens
        old = self._per_token[gated]
        self._per_token[gated] = x if old == 0.0 else (1 - self.alpha) * old + self.alpha * x

    @property
    def value(self) -> float:
        g, e = self._per_token[True], self._per_token[False]
        return max(1.0, g / e) if g > 0.0 and e > 0.0 else self.initial
