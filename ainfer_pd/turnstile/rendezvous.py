"""The rendezvous interface of the turnstile, its agreement check and its world-size-1 rendezvous.

A rendezvous is an all-rank CPU meeting point: every rank arrives with a small tuple
of ints and gets back every rank's tuple (index = rank). The distributed
implementations (gloo, same-host shared memory) and the choice between them are in
``dist_rendezvous.py``; the row checks every implementation shares in ``rendezvous_base.py``.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ..errors import RendezvousMismatch
from .rendezvous_base import MAX_PAYLOAD, RendezvousBase

Payload = tuple[int, ...]


@runtime_checkable
class Rendezvous(Protocol):
    rank: int
    world_size: int

    async def arrive(self, tag: str, payload: Payload, *, epoch: int | None = None,
                     boundary: int | None = None) -> list[Payload]:
        """Meet every rank at ``tag``; return every rank's payload (index = rank).

        Raises :class:`~ainfer_pd.errors.RendezvousTimeout` naming the missing ranks,
        the epoch and the boundary when the peers do not arrive in time.
        """
        ...

    async def close(self) -> None:
        ...


class LocalRendezvous(RendezvousBase):
    """World size 1: every rendezvous completes at once, with the checks of the distributed ones
    (payload size and int64 range, closed / broken object), so a one-rank run refuses what a
    multi-rank run would. ``kind`` "single"; :attr:`arrivals` counts the rendezvous."""

    kind = "single"

    def __init__(self, timeout_s: float = 30.0, *, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__(0, 1, timeout_s, max_payload)

    @property
    def arrivals(self) -> int:
        return self.rounds

    async def arrive(self, tag: str, payload: Payload, *, epoch: int | None = None,
                     boundary: int | None = None) -> list[Payload]:
        seq, row, _ = self._next_round(tag, payload, epoch, boundary)
        out = self._decode([row], seq, tag, epoch, boundary)
        self.rounds += 1
        return out

    async def close(self) -> None:
        self._closed = True


def assert_agree(payloads: Sequence[Payload], tag: str, epoch: int | None,
                 boundary: int | float | None) -> Payload:
    """Return the common payload, or raise RendezvousMismatch naming the ranks that differ.

    The ranks are grouped by the payload they sent; the rank-0 group is the reference.
    """
    if not payloads:
        raise RendezvousMismatch(f"rendezvous {tag!r} at epoch {epoch} boundary {boundary}: no payloads")
    ref = tuple(payloads[0])
    groups: dict[Payload, list[int]] = {}
    for rank, p in enumerate(payloads):
        groups.setdefault(tuple(p), []).append(rank)
    if len(groups) == 1:
        return ref
    differing = sorted(r for p, ranks in groups.items() if p != ref for r in ranks)
    detail = "; ".join(f"ranks {ranks} sent {p}" for p, ranks in groups.items())
    exc = RendezvousMismatch(f"rendezvous {tag!r} at epoch {epoch} boundary {boundary}: ranks "
                             f"{differing} disagree with rank 0 ({detail})")
    exc.differing_ranks = tuple(differing)  # type: ignore[attr-defined]
    exc.payloads = [tuple(p) for p in payloads]  # type: ignore[attr-defined]
    raise exc
