"""The shape of a verify iteration on several ranks (issue 38): its K, chosen for the world (pure).

D's collectives (the DP-attention all-gather / reduce-scatter, the expert exchange) gather every
replica's *positions*: a verify batch feeds each row's last token and its drafts, one decode
position each, so every replica must bring the same number at a drafting iteration, and the pass
costs every replica what the largest batch costs. The step decides whether the iteration drafts
(:attr:`~ainfer_pd.sched.step.StepDecision.verify`: some replica leader announced it would); then
each leader drafts its rows up to their caps (no K yet) and announces a :class:`DraftOffer` over
the control rendezvous (tag ``verify``): its rows, its host time, and for every K = 0 .. k_max the
positions its batch would have and the tokens its rows would emit on average (their acceptance;
a TP follower and a leader without drafts offer plain rows). Every rank then computes the same
K from the same offers (:func:`world_k`): the K that maximises the *world's* expected tokens per
unit of time, every replica's rows counted, at the world's batch size in the world's verify cost
table (``DistRanks.agree_costs``: the same on every rank), against plain decoding; each leader
verifies min(K, its draft) per row, and every rank pads to :func:`positions_at` K (the most any
rank has there). A replica without drafts is in the denominator: its rows pay the verify's width
too, so a K that pays for one leader's rows alone is not taken for the world.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecInputError
from .adaptive import MIN_GAIN, VerifyCosts, expected_tokens, relative_costs

__all__ = ["DraftOffer", "world_k", "positions_at", "verify_counts"]

SCALE = 1000
"""Expected tokens travel as integers of 1 / SCALE token (the rendezvous carries int64s)."""


@dataclass(frozen=True, slots=True)
class DraftOffer:
    """What one rank announces before a drafting iteration (a rendezvous payload of ints)."""

    rows: int
    """Its decode rows (0 on a TP follower: it runs its leader's batch)."""
    host_us: int
    """The host time its drafting puts before the launch (µs; the speculator's estimate)."""
    positions: tuple[int, ...]
    """At K = 0 .. k_max: its rows plus min(K, draft) per row."""
    milli_tokens: tuple[int, ...]
    """At K = 0 .. k_max: the tokens its rows emit on average, in 1 / SCALE token."""

    @classmethod
    def of(cls, rates: list[float], available: list[int], k_max: int, host_s: float = 0.0) -> "DraftOffer":
        """The offer of rows whose drafts are ``available[i]`` long, accepted at ``rates[i]``."""
        if len(rates) != len(available):
            raise SpecInputError(f"{len(rates)} acceptance rates but {len(available)} draft counts")
        ks = range(k_max + 1)
        pos = tuple(len(available) + sum(min(k, n) for n in available) for k in ks)
        toks = tuple(round(SCALE * sum(expected_tokens(a, min(k, n)) for a, n in zip(rates, available))) for k in ks)
        return cls(len(available), round(1e6 * host_s), pos, toks)

    @classmethod
    def plain(cls, rows: int, k_max: int) -> "DraftOffer":
        """``rows`` without drafts (0: a TP follower)."""
        return cls.of([0.0] * rows, [0] * rows, k_max)

    def to_payload(self) -> tuple[int, ...]:
        return (self.rows, self.host_us, *self.positions, *self.milli_tokens)

    @classmethod
    def from_payload(cls, payload, k_max: int) -> "DraftOffer":
        v = [int(x) for x in payload]
        if len(v) != 2 * (k_max + 2):
            raise SpecInputError(f"a draft offer of {len(v)} ints, expected {2 * (k_max + 2)} (k_max {k_max}): "
                                 f"the ranks' spec.num_draft_tokens differ")
        n = k_max + 1
        return cls(v[0], v[1], tuple(v[2:2 + n]), tuple(v[2 + n:]))


def world_k(costs: VerifyCosts | None, offers: list[DraftOffer], *, adaptive: bool,
            min_gain: float = MIN_GAIN) -> int:
    """The K of the iteration, the same on every rank given the same offers and table.

    Not ``adaptive``: the longest draft any rank offers (every row verifies its whole draft).
    Else the K maximising sum(tokens at K) / (world rows * cost ratio), the ratio read at the
    world's batch size (the most rows any replica runs) and width K + 1 plus the slowest leader's
    host time over one plain iteration; 0 unless it gains ``min_gain`` over plain decoding (no
    table: 0)."""
    k_max = len(offers[0].positions) - 1 if offers else 0
    longest = max((k for o in offers for k in range(1, k_max + 1) if o.positions[k] > o.positions[k - 1]), default=0)
    rows = sum(o.rows for o in offers)
    if longest == 0 or rows == 0:
        return 0
    if not adaptive:
        return longest
    if costs is None:
        return 0
    best, best_gain = 0, 1.0
    host_s = max(o.host_us for o in offers) / 1e6
    for k, cost in relative_costs(costs, max(o.rows for o in offers), longest, host_s):
        gain = sum(o.milli_tokens[k] for o in offers) / (SCALE * rows * cost)
        if gain >= min_gain and gain > best_gain:
            best, best_gain = k, gain
    return best


def positions_at(offers: list[DraftOffer], k: int) -> int:
    """Every replica's decode positions at K = ``k``: the most any rank has (each pads to it,
    then to the graph bucket / ATP multiple: ``DistRanks.padded_rows``)."""
    return max((o.positions[k] for o in offers), default=0)


def verify_counts(mine: DraftOffer, offers: list[DraftOffer], k: int, padded: int) -> dict[str, int]:
    """The recorder counters of one agreed verify, seen by a replica leader (``mine``) that runs
    ``padded`` positions: the round itself, whether it joined with no drafts of its own at K (it
    pays for another replica's), whether the world verifies nothing (K = 0: the drafts the step
    announced did not pay or did not come), the scratch positions it ran past its own batch, and K."""
    return {"spec_verify_rounds": 1,
            "spec_verify_joined": int(mine.positions[k] == mine.rows),
            "spec_verify_empty": int(not any(o.positions[k] > o.rows for o in offers)),
            "spec_verify_pad_positions": padded - mine.positions[k],
            "spec_verify_k": k}
