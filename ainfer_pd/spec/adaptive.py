"""How many drafts to verify: the batch's speculation length from the measured verify cost at its
size and each row's recent acceptance, never slower than no speculation under those costs (issue 38;
FastGRPO: at high concurrency naive speculation is slower than none).

One verify pass scores every row at the same width K + 1 (one graph per (batch bucket, K)), so its
cost is the batch's, ``cost(B, K + 1)``; :class:`VerifyCosts` holds the measured times, and their
ratio to one token per row. A drafter that runs on the device (the MTP layer's chain of K steps
over the batch) adds ``draft(B, K)`` before the verify; a model-free drafter (suffix) adds none.
The host time a speculating iteration spends before its launch (reading the overlapped iteration
it gives up, drafting: the speculator's measured ``host_s``) counts too, over ``cost(B, 1)``'s
seconds. A row whose drafts are accepted independently with probability a
emits E(a, n) = 1 + a + ... + a^n tokens from n drafts (Leviathan et al.), n = min(K, its draft's
length). :func:`choose` takes the K that maximises the batch's expected tokens per unit of time,
sum_r E(a_r, n_r) / (B * (cost(B, K + 1) + draft(B, K) + host_s) / cost(B, 1)), against 1 for K = 0 (one token per row per
iteration), and keeps K = 0 unless the best gains at least ``min_gain``. Each row then verifies
min(K, its draft's length) drafts (padding costs the batch nothing more: it pays K + 1 anyway).

A row's acceptance a is :class:`Acceptance`: discounted sums of drafts accepted and drafts tried
(the maximum-likelihood rate of the geometric run: a verify that accepts j of n drafts tried j + 1
of them if it rejected one, else n), from a prior of ``PRIOR_RATE`` over ``PRIOR_TRIALS`` tries,
so a new row is tried and a row that stops matching fades out within a few iterations.
A batch size above the table's largest measured one never speculates (no cost, no promise).

On several ranks a D iteration is one lockstep pass of every replica, padded to the same
positions: its time is set by the largest replica's batch, not this leader's. ``choose`` then
reads the table at ``world_rows`` (the most decode rows any rank announced at the step, which
every rank sees: the most knowable before the verify shape is agreed) while the tokens it counts
stay this batch's: a leader of 1 row beside a replica of 64 pays (B = 64)'s ratio for its drafts,
and what padding to another replica's drafts costs stays unknowable here (counted instead:
``spec_verify_pad_positions``).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import SpecInputError

DECAY = 0.7
"""Weight of the past in a row's acceptance sums, per verify."""
PRIOR_RATE = 0.5
PRIOR_TRIALS = 2.0
"""A new row's acceptance: PRIOR_RATE over PRIOR_TRIALS draft tokens tried."""
MIN_GAIN = 1.05
"""Speculate only when the expected tokens per unit of time beat no speculation by this factor
(a margin for the timing noise in the cost table and the drafting's host time)."""
K_MAX = 8


@dataclass(frozen=True, slots=True)
class Acceptance:
    """A row's recent acceptance: discounted sums of drafts accepted and drafts tried."""

    accepted: float = PRIOR_RATE * PRIOR_TRIALS
    tried: float = PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0


def observe(acc: Acceptance, drafted: int, accepted: int, *, decay: float = DECAY) -> Acceptance:
    """``acc`` after a verify that accepted ``accepted`` of ``drafted`` drafts (none: unchanged)."""
    if not 0 <= accepted <= drafted:
        raise SpecInputError(f"accepted {accepted} of {drafted} drafts")
    if drafted == 0:
        return acc
    tried = accepted + (1 if accepted < drafted else 0)
    return Acceptance(decay * acc.accepted + accepted, decay * acc.tried + tried)


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens one row emits on average from ``drafts`` drafts each accepted with ``rate``:
    1 + rate + ... + rate**drafts (the accepted run, then the corrected or bonus token)."""
    if rate >= 1.0:
        return drafts + 1.0
    return (1.0 - rate ** (drafts + 1)) / (1.0 - rate)


@dataclass(frozen=True, slots=True)
class VerifyCosts:
    """Measured verify times: ``times[B][w]`` = seconds of one pass over B rows of w tokens each
    (w = K + 1; w = 1 is plain decoding), and for a drafter that runs on the device ``drafts[B][k]``
    = seconds of drafting k tokens for B rows. Build it with :meth:`from_times`."""

    batches: tuple[int, ...]                       # the measured batch sizes, ascending
    ratios: tuple[Mapping[int, float], ...]        # per batch size: width -> time(w) / time(1)
    drafting: tuple[Mapping[int, float], ...] | None = None
    """Per batch size: k -> drafting time(k) / time(1); None: drafting costs the device nothing."""
    base: tuple[float, ...] = ()
    """Per batch size: time(1), seconds of one plain iteration (host time is counted against it)."""

    @classmethod
    def from_times(cls, times: Mapping[int, Mapping[int, float]],
                   drafts: Mapping[int, Mapping[int, float]] | None = None) -> "VerifyCosts":
        """``drafts`` (the device drafter's times, ``{B: {k: s}}``) must cover every batch size of
        ``times``; a k it lacks at a size is a K the batch does not take there."""
        if not times:
            raise SpecInputError("the verify cost table is empty")
        batches, ratios = [], []
        for B in sorted(times):
            row = times[B]
            if isinstance(B, bool) or not isinstance(B, int) or B < 1:
                raise SpecInputError(f"batch sizes must be positive integers, got {B!r}")
            for w, t in row.items():
                if isinstance(w, bool) or not isinstance(w, int) or w < 1 or not (math.isfinite(t) and t > 0):
                    raise SpecInputError(f"batch {B}: width {w!r} has time {t!r} (need an int >= 1, a time > 0)")
            if 1 not in row:
                raise SpecInputError(f"batch {B}: no time for width 1 (plain decoding), nothing to compare with")
            batches.append(B)
            ratios.append({w: t / row[1] for w, t in row.items()})
        base = tuple(times[B][1] for B in batches)
        if drafts is None:
            return cls(tuple(batches), tuple(ratios), None, base)
        drafting = []
        for B in batches:
            row = drafts.get(B)
            if row is None:
                raise SpecInputError(f"the drafting cost table has no batch size {B} (the verify table has)")
            for k, t in row.items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 1 or not (math.isfinite(t) and t >= 0):
                    raise SpecInputError(f"drafting, batch {B}: {k!r} drafts take {t!r} s (need an int >= 1, a time >= 0)")
            drafting.append({k: t / times[B][1] for k, t in row.items()})
        return cls(tuple(batches), tuple(ratios), tuple(drafting), base)

    def at(self, batch: int) -> Mapping[int, float]:
        """Width -> relative cost at ``batch`` rows: the smallest measured size >= ``batch`` (the
        bucket its graph runs at); {} above the largest measured size."""
        i = bisect_left(self.batches, batch)
        return self.ratios[i] if i < len(self.batches) else {}

    def base_at(self, batch: int) -> float | None:
        """Seconds of one plain iteration at ``batch`` rows (its bucket's); None above the table."""
        i = bisect_left(self.batches, batch)
        return self.base[i] if i < len(self.base) else None

    def draft_at(self, batch: int) -> Mapping[int, float] | None:
        """k -> relative drafting cost at ``batch`` rows (the bucket :meth:`at` takes); None: the
        drafter costs the device nothing."""
        if self.drafting is None:
            return None
        i = bisect_left(self.batches, batch)
        return self.drafting[i] if i < len(self.batches) else {}


@dataclass(frozen=True, slots=True)
class SpecPlan:
    """The batch's choice: ``k`` drafts wide (0 = no speculation), ``per_row`` drafts each row
    verifies, ``gain`` = expected tokens per unit of time over no speculation (1.0 for k = 0)."""

    k: int
    per_row: tuple[int, ...]
    gain: float


def choose(costs: VerifyCosts, rates: list[float], available: list[int], *, k_max: int = K_MAX,
           min_gain: float = MIN_GAIN, host_s: float = 0.0, world_rows: int = 0, plain_rows: int = 0) -> SpecPlan:
    """The speculation length for a batch: ``rates`` each row's acceptance rate, ``available``
    the drafts each row has (its drafter's output, up to ``k_max``), ``host_s`` the host seconds
    speculating adds before the launch. ``world_rows`` (several ranks): the most rows any replica
    runs in this lockstep iteration, which sets its cost: the table is read at
    max(``world_rows``, the batch's rows) (module docstring), the tokens counted are this batch's.
    ``plain_rows``: more rows of the batch with no draft (each one token, whatever K), left out of
    ``rates`` / ``available`` and of ``per_row``, so a caller need not list them."""
    if len(rates) != len(available):
        raise SpecInputError(f"{len(rates)} acceptance rates but {len(available)} draft counts")
    if any(n < 0 for n in available) or any(not 0.0 <= a <= 1.0 for a in rates):
        raise SpecInputError("draft counts must be >= 0 and acceptance rates in [0, 1]")
    if not (math.isfinite(host_s) and host_s >= 0):
        raise SpecInputError(f"host_s must be a time >= 0, got {host_s!r}")
    if not min_gain >= 1.0:
        raise SpecInputError(f"min_gain must be >= 1 (below, speculation may be slower than none), got {min_gain}")
    if plain_rows < 0:
        raise SpecInputError(f"plain_rows must be >= 0, got {plain_rows}")
    B = len(rates) + plain_rows
    best = SpecPlan(0, (0,) * len(rates), 1.0)
    if not rates:
        return best
    at = max(B, world_rows)                  # the iteration's size: its cost, for every replica alike
    longest = min(k_max, max(available))
    runs = [_partial_sums(a, min(n, longest)) for a, n in zip(rates, available)]   # E(a, 0..n) per row
    for k, cost in relative_costs(costs, at, longest, host_s):
        gain = (plain_rows + sum(run[min(k, len(run) - 1)] for run in runs)) / (B * cost)
        if gain >= min_gain and gain > best.gain:
            best = SpecPlan(k, tuple(min(k, n) for n in available), gain)
    return best


def could_pay(costs: VerifyCosts, rate: float, rows: int, *, k_max: int = K_MAX, min_gain: float = MIN_GAIN,
              host_s: float = 0.0, world_rows: int = 0) -> bool:
    """Could :func:`choose` take K > 0 for some batch of ``rows`` rows whose acceptance rates are at
    most ``rate``? An upper bound of every such batch's gain (every row a whole draft of ``k_max``
    at ``rate``; E grows with the rate and the drafts), in O(K): False means choose keeps K = 0
    whatever the rows bring, so nothing needs to be known of them (not their drafts: nothing is
    drafted)."""
    if rows == 0:
        return False
    at = max(rows, world_rows)
    slack = 1.0 - 1e-9                       # choose sums the rows' terms: a rounding, not a gain
    return any(expected_tokens(rate, k) / cost >= min_gain * slack
               for k, cost in relative_costs(costs, at, k_max, host_s))


def relative_costs(costs: VerifyCosts, at: int, longest: int, host_s: float) -> list[tuple[int, float]]:
    """(K, the cost of an iteration verifying K drafts a row over a plain one) for every K in
    [1, ``longest``] the table has at ``at`` rows: the verify's ratio, the device drafter's chain
    (when it has K) and ``host_s`` over one plain iteration."""
    drafting, base = costs.draft_at(at), costs.base_at(at)
    host = host_s / base if base else 0.0
    out = []
    for w, ratio in sorted(costs.at(at).items()):
        k = w - 1
        if 1 <= k <= longest and (drafting is None or k in drafting):
            out.append((k, ratio + (drafting[k] if drafting is not None else 0.0) + host))
    return out


def _partial_sums(rate: float, n: int) -> list[float]:
    """[E(rate, 0), ..., E(rate, n)]."""
    out, term = [1.0], 1.0
    for _ in range(n):
        term *= rate
        out.append(out[-1] + term)
    return out
