"""The single-rank device-progress watchdog and a rank's progress frontier (for stall reports).

A device that stops (a hang: kernels that never finish) would leave every waiter of a single-rank
engine waiting forever; several ranks have the ranks' :class:`~ainfer_pd.comm.watchdog.Watchdog`
(``DistRanks.attach``). Here the same class watches one rank's device (world size 1, no store):
progress is the count of stream items seen complete (:meth:`Device.num_completed`), busy is some
stream, not parked on purpose, with an item unfinished (:meth:`Device.has_unfinished_work`).
"""
from __future__ import annotations

from ...comm.watchdog import Watchdog
from ...errors import DeviceStallError

__all__ = ["device_watchdog", "frontier"]


def device_watchdog(eng) -> Watchdog:
    """``eng``'s device watchdog: while some stream has an item not complete, a stream item must
    complete every ``parallel.stall_timeout_s``, else :class:`~ainfer_pd.errors.DeviceStallError`
    naming each stream's oldest unfinished item. Idle is never a stall; it polls every 0.1 s, off
    the launch path."""
    dev = eng.device
    return Watchdog(rank=eng.rank, world_size=1, stall_s=eng.cfg.parallel.stall_timeout_s,
                    progress=dev.num_completed, probe=lambda: frontier(eng), busy=dev.has_unfinished_work,
                    poll_s=0.1, peer_wait_s=0.0, error=DeviceStallError)


def frontier(eng) -> dict:
    """``eng``'s progress for a stall report: D iterations, P segments, completed requests, the P
    epoch, each stream's pending count and oldest unfinished item."""
    st = eng.device.streams
    return {"d_done": eng.d.num_iters, "p_done": st["P"].num_done if "P" in st else 0,
            "requests_done": eng.book.num_finished, "epoch": eng.p.epoch,
            "pending": {n: s.num_pending for n, s in st.items()}, "unfinished": eng.device.unfinished_report()}
