"""The rendezvous interface of the turnstile and its single-process implementation.

A rendezvous is an all-rank CPU meeting point: every rank arrives with a small tuple
of ints and gets back every rank's tuple (index = rank). The distributed
implementations (gloo, same-host shared memory) live in ``dist_rendezvous.py``.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ..errors import DistributedError, RendezvousMismatch

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


class LocalRendezvous:
    """World size 1: returns ``[payload]`` at once (it still counts as a rendezvous)."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.arrivals = 0
        self._closed = False

    async def arrive(self, tag: str, payload: Payload, *, epoch: int | None = None,
                     boundary: int | None = None) -> list[Payload]:
        if self._closed:
            raise DistributedError(f"rendezvous {tag!r} at epoch {epoch} boundary {boundary}: "
                                   "the rendezvous is closed")
        self.arrivals += 1
        return [tuple(payload)]

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
