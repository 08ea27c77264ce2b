"""What a drafting D iteration costs besides its verify pass (issue 38; pure state, the
:class:`~.speculator.Speculator` holds one): two estimates in seconds, each an EMA over the
drafting iterations, added to every K's cost in :func:`~.adaptive.choose` and
:func:`~.adaptive.could_pay`.

* ``host_s``: the host time before the launch (the drafts, the verify's build);
* ``lost_s``: the device idle drafting causes. Overlapped, a drafting iteration gives the overlap
  up: a stale hit reads the iteration in flight early, and the verify is read before the next
  launch is built; each time the next launch waits for the host. The D driver measures that idle
  from the device intervals and reports it here.

Both fade at every iteration the estimates kept from drafting (:meth:`DraftOverhead.fade`), so a
batch they stopped is tried again after a few dozen iterations.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.loop.timings import ema

ALPHA = 0.3
"""Weight of a new observation in each estimate (the past keeps 0.7), per drafting iteration."""
FORGET = 0.98
"""Each estimate's factor at an iteration it kept from drafting (it halves in ~35)."""


@dataclass(slots=True)
class DraftOverhead:
    host_s: float = 0.0
    lost_s: float = 0.0

    def observe_host(self, seconds: float) -> None:
        """A drafting iteration spent ``seconds`` on the host before its launch."""
        self.host_s = ema(self.host_s, seconds, ALPHA)

    def observe_lost(self, seconds: float) -> None:
        """Drafting left the device idle ``seconds`` once (a launch that waited for the host)."""
        self.lost_s = ema(self.lost_s, seconds, ALPHA)

    def fade(self) -> None:
        """An iteration the estimates kept from drafting."""
        self.host_s *= FORGET
        self.lost_s *= FORGET

    @property
    def total_s(self) -> float:
        """The cost added to a drafting iteration's verify pass."""
        return self.host_s + self.lost_s
