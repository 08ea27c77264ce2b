"""The CPU stand-in of a GPU's residency for spinning collective kernels (SPEC 7.1, "the device model").

On a GPU a collective kernel (NCCL, or a DeepEP-style cooperative launch) spins on its SMs from the
moment it is resident until every peer has joined. Two collectives on separate communicators can
both be resident and both progress, so a rank that launched them in the other order than a peer is
harmless, **unless they cannot be resident together**: then the later one waits for the earlier one
to leave, and the earlier one waits for a peer that is itself held by the same conflict. That is
the device-progress cycle of SPEC 2 (the paper's Table 4: limiting per-SM residency avoids it).

:class:`CollectiveResidency` is that residency as a mechanism: the device has ``capacity`` units for
resident collectives; a collective of communicator family ``comm`` occupies ``footprint(comm)`` of
them from the moment it is admitted until it returned (every peer joined), and waits for admission
while the others it would not fit beside are resident. Collectives never leave early: a spinning
kernel keeps its SMs. The CUDA device has no such object (the hardware decides residency).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping

from ...errors import ConfigError, DistributedError

__all__ = ["CollectiveResidency"]


class CollectiveResidency:
    """``capacity`` units of resident collectives on one device; ``footprints``: units a collective
    of each communicator family occupies (a family not named: 1). ``capacity`` 0: no limit."""

    def __init__(self, capacity: int, footprints: Mapping[str, int] | None = None, *,
                 wait_s: float | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"collective residency capacity must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self.footprints = dict(footprints or {})
        for comm, n in self.footprints.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (capacity and n > capacity):
                raise ConfigError(f"collective footprint of {comm} must be an integer in [1, {capacity or 'inf'}], "
                                  f"got {n!r}: it could never be resident")
        self.wait_s = wait_s
        """Longest wait for admission (None: as long as the resident ones stay): then
        :class:`DistributedError` naming what stayed resident."""
        self._cv = threading.Condition()
        self._used = 0
        self.resident: dict[int, str] = {}
        """Thread id -> communicator family of each collective resident now."""

    @property
    def limited(self) -> bool:
        return self.capacity > 0

    def footprint(self, comm: str | None) -> int:
        return self.footprints.get(comm, 1) if comm is not None else 1

    def fits(self, *comms: str) -> bool:
        """Collectives of these families can all be resident at once (so launched in any order on
        two ranks they cannot close a cycle between themselves)."""
        return not self.limited or sum(self.footprint(c) for c in comms) <= self.capacity

    @contextlib.contextmanager
    def hold(self, comm: str | None) -> Iterator[None]:
        """Resident for the body: admitted once ``footprint(comm)`` units are free (the resident
        ones leave when their peers joined, or fail at their communicator's timeout; the watchdog
        reports a stall first), released after it. :class:`DistributedError` after ``wait_s``."""
        if not self.limited:
            yield
            return
        need, me = self.footprint(comm), threading.get_ident()
        with self._cv:
            if not self._cv.wait_for(lambda: self._used + need <= self.capacity, timeout=self.wait_s):
                held = ", ".join(sorted(self.resident.values()))
                raise DistributedError(f"a {comm} collective was not admitted for {self.wait_s:g} s: {self._used} of "
                                       f"{self.capacity} collective units stay held by resident {held} (their peers "
                                       f"have not joined)")
            self._used += need
            self.resident[me] = comm or "?"
        try:
            yield
        finally:
            with self._cv:
                self._used -= need
                self.resident.pop(me, None)
                self._cv.notify_all()

    def describe(self) -> str:
        if not self.limited:
            return "collective residency: unlimited"
        fp = ", ".join(f"{c} {n}" for c, n in sorted(self.footprints.items()))
        return f"collective residency: {self.capacity} units ({fp or 'every collective 1'})"
