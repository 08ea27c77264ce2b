"""The shape of a verify iteration on several ranks (issue 38), decided (pure).

D's collectives (the DP-attention all-gather / reduce-scatter, the expert exchange) gather every
replica's *positions*: a verify batch feeds each row's last token and its drafts, one decode
position each, so every replica must bring the same number at a drafting iteration. The step
decides whether the iteration drafts (:attr:`~ainfer_pd.sched.step.StepDecision.verify`: some
replica leader announced it would); then each leader plans its own drafts (K chosen locally, by
its own rows, acceptance and cost table: :meth:`~.speculator.Speculator.plan`), every rank
announces a :class:`VerifyShape` over the control rendezvous (tag ``verify``), and every rank pads
its batch to :func:`agreed_positions` (the max; TP followers announce nothing of their own: they
run their leader's batch). K is local then max-ed, not chosen collectively: a leader does not
see the other replicas' positions, so a leader with few or no drafts pays the padding of another's
verify. That cost is counted (:func:`verify_counts`), never silent.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["VerifyShape", "agreed_positions", "verify_counts"]


@dataclass(frozen=True, slots=True)
class VerifyShape:
    """What one rank announces before a drafting iteration (a rendezvous payload of ints, by field)."""

    positions: int
    """Decode positions of its verify batch: its rows plus their drafts (0 on a TP follower)."""
    rows: int
    """Its decode rows."""
    drafts: int
    """Drafts its rows verify (0: it decodes plainly, padded to the agreed positions)."""

    @classmethod
    def of(cls, drafts: list[list[int]]) -> "VerifyShape":
        """The shape of a batch whose row i verifies ``drafts[i]`` (empty: one position)."""
        n = sum(len(d) for d in drafts)
        return cls(positions=len(drafts) + n, rows=len(drafts), drafts=n)

    def to_payload(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, f.name)) for f in fields(self))

    @classmethod
    def from_payload(cls, payload) -> "VerifyShape":
        return cls(*(int(v) for _, v in zip(fields(cls), payload, strict=True)))


def agreed_positions(shapes: list[VerifyShape]) -> int:
    """Every replica's decode positions at this iteration: the most any rank announced (each pads
    to it, then to the graph bucket / ATP multiple: ``DistRanks.padded_rows``)."""
    return max((s.positions for s in shapes), default=0)


def verify_counts(mine: VerifyShape, shapes: list[VerifyShape], padded: int) -> dict[str, int]:
    """The recorder counters of one agreed verify shape, seen by a replica leader (``mine``) that
    runs ``padded`` positions: the round itself, whether it joined with no drafts of its own (it
    pays for another replica's), whether no rank had any drafts after all (the round gave nothing:
    the drafts the step announced did not come), and the scratch positions it ran past its own
    batch."""
    return {"spec_verify_rounds": 1,
            "spec_verify_joined": int(mine.drafts == 0),
            "spec_verify_empty": int(not any(s.drafts for s in shapes)),
            "spec_verify_pad_positions": padded - mine.positions}
