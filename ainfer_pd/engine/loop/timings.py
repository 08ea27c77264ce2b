"""What the engine measures of its own loops: the D iteration and P boundary EMAs the span policy
reads, and where a D iteration's launch -> done went."""
from __future__ import annotations

from ...metrics.recorder import Recorder


def ema(old: float, new: float, a: float = 0.3) -> float:
    return new if old == 0.0 else (1 - a) * old + a * new


class EngineTimings:
    """The loops' timing state (the event loop's thread only)."""

    __slots__ = ("rec", "d_iter_ema", "p_boundary_ema")

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder
        self.d_iter_ema = 0.0          # seconds, launch -> completion (overlapped: the device interval)
        self.p_boundary_ema = 0.0      # seconds of P per safe boundary

    def p_boundary(self, seconds: float, boundaries: int) -> None:
        self.p_boundary_ema = ema(self.p_boundary_ema, seconds / boundaries)

    def d_read(self, w, t_launch: float, t_done: float, *, overlapped: bool, p_running: bool) -> None:
        """The timing samples of a D iteration read at ``t_done``. Overlapped, launch -> done
        includes the wait behind the iteration before it, so the D period the span policy and the
        bound's chain use is the device interval instead."""
        dur = t_done - t_launch
        self.rec.sample("d_iter_s", dur)
        period = dur
        if overlapped and w.interval is not None:
            period = w.interval[1] - w.interval[0]
        self.d_iter_ema = ema(self.d_iter_ema, period)
        self._split_d_iter(w, t_launch, t_done)
        if not p_running:
            self.rec.sample("d_iter_alone_s", period)       # no P epoch beside it

    def _split_d_iter(self, w, t_launch: float, t_done: float) -> None:
        """Where launch -> done went, in four parts that add up to it: ``d_pickup_s`` (submitted ->
        the launcher began), ``d_to_start_s`` (-> the device began; CUDA: the start event's time
        on the host clock, so it can read slightly negative), ``d_device_s`` (the device interval)
        and ``d_resume_s`` (device end -> this coroutine resumed: the waiter's wake-up and the
        event loop's lag). Also ``d_launch_call_s``, the host launch call itself."""
        if w.interval is None or w.t_started is None:
            return
        a, b = w.interval
        rec = self.rec
        rec.sample("d_pickup_s", w.t_started - t_launch)
        rec.sample("d_to_start_s", a - w.t_started)
        rec.sample("d_device_s", b - a)
        rec.sample("d_resume_s", t_done - b)
        rec.sample("d_launch_call_s", w.t_launched - w.t_started)
