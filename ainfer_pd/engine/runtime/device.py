"""Devices and streams: enqueue returns at once, completion comes later.

* :class:`CudaDevice` - real CUDA streams. Each stream has one launcher thread that
  enqueues kernels under ``torch.cuda.stream(s)`` (so launches never block the event
  loop) and records CUDA events; completion is awaited on a waiter thread blocked in the
  event's synchronize, which wakes the loop at once (before: polling ``event.query()`` every
  0.2 ms, which the loop's millisecond timers made ~1 ms: a D iteration of one row at 5K
  context took 6.3 ms from launch to completion for 5.0 ms of graph). A stream's items may name
  a *lane*: the device maps (stream, lane) to a stream of a CUDA green context of fewer SMs
  (``device.p_stream_sms``: P's gated epochs, so D beside them always finds SMs free); a lane
  switch waits for the stream's previous item, so the stream stays FIFO.
* :class:`CpuDevice` - a **CPU stand-in** for a GPU, named as such. Each stream is a
  FIFO executor thread; ``submit`` only enqueues. A device-wide *residency* semaphore
  of N slots is held by every running item, the way kernels hold SMs; an attention collective
  is also resident in the device's collective residency
  (:class:`~.collective_residency.CollectiveResidency`: ``collective_slots`` units, D's
  DP-attention gather / scatter taking ``dp_collective_slots`` of them) until every peer has
  joined, as spinning NCCL / DeepEP kernels are. torch releases the GIL inside ops, so the P and
  D streams really run at once on two cores.

Both devices take per-item ``deps`` (items of other streams this one must wait for, like
``cudaStreamWaitEvent``: a waiting stream holds no residency slot and no SMs) and ``attrs``
(explicit phase identity of the item, e.g. a P collective routed onto the D stream, for the
cross-rank trace's ``work`` intervals). :meth:`Device.comm_budget` runs expert exchanges outside
the residency slots: DeepEP-style kernels have their own communication-SM budget (SPEC 3.4).
Work items, streams and the :class:`Device` base: :mod:`.streams` (importable from here too).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable

import torch

from ...comm.topology import ATTN_DP_D
from ...metrics.recorder import Recorder
from .collective_residency import CollectiveResidency
from .stream_leases import cuda_stream_key, give_back, green_stream_key, take
from .streams import Device, Stream, StreamHold, Work  # noqa: F401 - importable from here
from .waiters import BlockingWaiters

log = logging.getLogger(__name__)


class CpuDevice(Device):
    """CPU stand-in for a GPU (see module docstring)."""

    kind = "cpu"

    def __init__(self, recorder: Recorder, *, residency_slots: int = 2, threads_per_stream: int = 1,
                 collective_slots: int = 0, dp_collective_slots: int = 1, collective_wait_s: float | None = None) -> None:
        super().__init__(recorder)
        self.residency = threading.BoundedSemaphore(residency_slots)
        self.residency_slots = residency_slots
        self.threads_per_stream = threads_per_stream
        self.collectives = CollectiveResidency(collective_slots, {ATTN_DP_D: dp_collective_slots} if collective_slots
                                               else None, wait_s=collective_wait_s)
        self._holding = threading.local()

    @contextlib.contextmanager
    def collective_slot(self, comm: str | None = None):
        """A collective of family ``comm`` is resident in :attr:`collectives` until it returned
        (every peer joined); waiting for admission, its item keeps its residency slot (SMs stay
        occupied)."""
        with self.collectives.hold(comm):
            yield

    def coresident(self, *comms: str) -> bool:
        return self.collectives.fits(*comms)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        # NOTE: dependencies and injected delays are waited for before the slot is taken: a
        # stream that waits for another stream's event occupies nothing (cudaStreamWaitEvent).
        for d in work.deps:
            d.enqueued().result()                 # re-raises a failed dependency
        if work.delay_s > 0:
            time.sleep(work.delay_s)
        with self.residency:
            self._holding.slot = True
            t0 = work.t_started = self.recorder.now()
            try:
                with torch.inference_mode():
                    return fn(*args)
            finally:
                self._holding.slot = False
                work.t_launched = t1 = self.recorder.now()
                self._record(work, stream, t0, t1)

    @contextlib.contextmanager
    def comm_budget(self):
        """Give this stream thread's residency slot back while an expert exchange waits for its
        peers (DeepEP-style kernels run on their own communication SMs), take it again after."""
        if not getattr(self._holding, "slot", False):
            yield
            return
        self.residency.release()
        self._holding.slot = False
        try:
            yield
        finally:
            self.residency.acquire()
            self._holding.slot = True


class CudaDevice(Device):
    """Real CUDA streams; completion through CUDA events."""

    kind = "cuda"
    items_run_in_launch = False

    def __init__(self, recorder: Recorder, index: int = 0, high_priority_stream: str = "none",
                 lane_sms: dict[tuple[str, str], int] | None = None) -> None:
        super().__init__(recorder)
        self.index = index
        self.high_priority_stream = high_priority_stream
        # (stream, lane) -> SMs of the green context that lane's items run in
        self.lane_sms = {k: v for k, v in (lane_sms or {}).items() if v}
        torch.cuda.set_device(index)
        self._cuda_streams: dict[tuple[str, str | None], torch.cuda.Stream] = {}
        self._green: dict[tuple[str, str], Any] = {}     # the green contexts, kept alive with their streams
        # (stream, lane) -> (lease key, what was leased): given back at shutdown (:mod:`.stream_leases`)
        self._leases: dict[tuple[str, str | None], tuple[tuple, Any]] = {}
        # stream -> (CUDA stream, end event) of its item launched last: a lane switch waits for it
        self._last_launch: dict[str, tuple[torch.cuda.Stream, Any]] = {}
        self._unnoted: dict[str, list[Work]] = {}      # launched items whose interval is not recorded yet
        self._lock = threading.Lock()
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record()
        torch.cuda.synchronize()
        self._ref_host = recorder.now()
        # one waiter per item in flight (P and D each have at most a few); synchronize releases the GIL.
        # Daemon threads: on a stalled device their synchronize never returns (:mod:`.waiters`)
        self._waiters = BlockingWaiters(8, "ainfer-cuda-wait")
        for name, lane in self.lane_sms:              # at start: a partition that cannot be had fails here
            self.cuda_stream(name, lane)

    async def wait_event(self, event) -> None:
        """Until ``event`` has completed, without blocking the loop (a waiter thread blocks)."""
        await self._waiters.run(event.synchronize)

    def shutdown(self) -> None:
        super().shutdown()
        stuck = self._waiters.shutdown(wait=self.stalled is None)
        if stuck:
            log.warning("device stalled: %d waiter thread(s) left blocked in a CUDA synchronize (daemons: the "
                        "process can still exit)", len(stuck))
        if self.stalled is None:                      # a stalled device's streams may never drain: kept
            for lease, leased in self._leases.values():
                give_back(lease, leased)
            self._leases.clear()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def cuda_stream(self, name: str, lane: str | None = None) -> torch.cuda.Stream:
        """The CUDA stream behind stream ``name``'s ``lane`` (an unmapped lane: the stream's own)."""
        key = (name, lane if (name, lane) in self.lane_sms else None)
        if key not in self._cuda_streams:
            if key[1] is not None:
                self._cuda_streams[key] = self._green_stream(key, self.lane_sms[key])
            else:
                # lower number = higher priority; priority_range() is (lowest, highest)
                prio = torch.cuda.Stream.priority_range()[1] if name == self.high_priority_stream else 0
                lease = cuda_stream_key(self.index, prio)
                s = take(lease, lambda: torch.cuda.Stream(device=self.index, priority=prio))
                self._cuda_streams[key], self._leases[key] = s, (lease, s)
        return self._cuda_streams[key]

    def _green_stream(self, key: tuple[str, str], sms: int) -> torch.cuda.Stream:
        """A stream of a CUDA green context holding ``sms`` of the device's SMs: its kernels run on
        those SMs only, so another stream's kernels always find the rest free. Checked at creation:
        an event recorded on it can be timed against the device's reference event (the intervals)."""
        from ...errors import BackendUnavailableError, ConfigError
        total = torch.cuda.get_device_properties(self.index).multi_processor_count
        if not 0 < sms < total:
            raise ConfigError(f"stream {key[0]} lane {key[1]}: {sms} SMs for its green context; "
                              f"this device has {total}")
        try:
            from torch.cuda.green_contexts import GreenContext

            def make():
                g = GreenContext.create(num_sms=sms, device_id=self.index)
                return g, g.Stream()
            lease = green_stream_key(self.index, sms)
            ctx, s = take(lease, make)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
            ev.synchronize()
            self._ref_event.elapsed_time(ev)
        except (ImportError, RuntimeError) as e:
            raise BackendUnavailableError(f"stream {key[0]} lane {key[1]}: no CUDA green context of {sms} SMs "
                                          f"here ({e})") from e
        self._green[key], self._leases[key] = ctx, (lease, (ctx, s))
        return s

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        cs = self.cuda_stream(stream.name, work.lane)
        torch.cuda.set_device(self.index)
        last = self._last_launch.get(stream.name)     # only this stream's launcher thread touches its key
        if last is not None and last[0] is not cs:
            cs.wait_event(last[1])                    # FIFO across lanes: after the stream's last item
        for d in work.deps:
            d.enqueued().result()                 # the dependency's launch call returned ...
            if d._event is not None:
                cs.wait_event(d._event)           # ... and this stream waits for it on the device
        if work.delay_s > 0:
            time.sleep(work.delay_s)
        with torch.cuda.stream(cs), torch.inference_mode():
            start = torch.cuda.Event(enable_timing=True)
            work.t_started = self.recorder.now()
            start.record(cs)
            result = fn(*args)
            end = torch.cuda.Event(enable_timing=True)
            end.record(cs)
        work.t_launched = self.recorder.now()
        work._start_event, work._event = start, end
        self._last_launch[stream.name] = (cs, end)
        with self._lock:
            self._unnoted.setdefault(stream.name, []).append(work)
        return result

    def _note_completed(self, work: Work) -> None:
        """``work`` completed, so did every earlier item of its stream (FIFO): record the
        CUDA-event intervals of all of them, awaited or not (timeline, busy fractions)."""
        with self._lock:
            pending = self._unnoted.get(work.stream.name, [])
            if work not in pending:
                return
            i = pending.index(work)
            done, self._unnoted[work.stream.name] = pending[:i + 1], pending[i + 1:]
        for w in done:
            a = self._ref_host + self._ref_event.elapsed_time(w._start_event) / 1e3
            b = self._ref_host + self._ref_event.elapsed_time(w._event) / 1e3
            self._record(w, w.stream, a, b)


def make_device(kind: str, recorder: Recorder, *, residency_slots: int = 2, threads_per_stream: int = 1,
                index: int | None = None, high_priority_stream: str = "none", collective_slots: int = 0,
                dp_collective_slots: int = 1, collective_wait_s: float | None = None,
                lane_sms: dict[tuple[str, str], int] | None = None) -> Device:
    """``index`` None: the current CUDA device (a lockstep rank has set it to its local GPU).
    ``lane_sms``: CUDA only, (stream, lane) -> SMs of the green context that lane's items run in.
    ``collective_slots`` / ``dp_collective_slots`` / ``collective_wait_s``: the CPU stand-in's
    collective residency (:class:`~.collective_residency.CollectiveResidency`)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            from ...errors import BackendUnavailableError
            raise BackendUnavailableError("device.device=cuda but CUDA is not available on this host")
        return CudaDevice(recorder, torch.cuda.current_device() if index is None else index, high_priority_stream,
                          lane_sms)
    if any((lane_sms or {}).values()):
        from ...errors import ConfigError
        raise ConfigError(f"an SM partition of stream lanes {sorted(lane_sms)} needs a CUDA device; this one is {kind}")
    return CpuDevice(recorder, residency_slots=residency_slots, threads_per_stream=threads_per_stream,
                     collective_slots=collective_slots, dp_collective_slots=dp_collective_slots,
                     collective_wait_s=collective_wait_s)
