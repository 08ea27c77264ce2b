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
  of N slots is held by every running item, the way kernels hold SMs; a collective
  (see ``hold_until``) keeps its slot until every peer has joined, as spinning NCCL /
  DeepEP kernels do. torch releases the GIL inside ops, so the P and D streams really
  run at once on two cores.

Both devices take per-item ``deps`` (items of other streams this one must wait for, like
``cudaStreamWaitEvent``: a waiting stream holds no residency slot and no SMs) and ``attrs``
(explicit phase identity of the item, e.g. a P collective routed onto the D stream, for the
cross-rank trace's ``work`` intervals). :meth:`Device.comm_budget` runs expert exchanges outside
the residency slots: DeepEP-style kernels have their own communication-SM budget (SPEC 3.4).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..metrics.recorder import Recorder


@dataclass(eq=False, slots=True)
class Work:
    """One enqueued item of a stream."""

    stream: "Stream"
    label: str
    enqueued_at: float
    _future: cf.Future = field(default_factory=cf.Future)
    _event: Any = None            # CUDA completion event (CudaDevice)
    _start_event: Any = None
    deps: tuple = ()
    """Items of other streams this item waits for before it starts (not before it is enqueued)."""
    delay_s: float = 0.0
    """Extra wait before the item takes the device (fault injection: replicas out of phase)."""
    attrs: dict = field(default_factory=dict)
    """Trace attributes (``phase``, ``kind``, ``registered``, ``epoch``, ``boundary``)."""
    lane: str | None = None
    """Which of its stream's hardware queues runs the item (CUDA: a lane the device maps to a
    green context's stream, see :class:`CudaDevice`; None or an unmapped lane: the stream's own).
    The stream stays FIFO across lanes."""
    t_started: float | None = None
    """Recorder time the launcher began the item (its dependencies and delay passed)."""
    t_launched: float | None = None
    """Recorder time the launch call returned (CPU: the item ran)."""
    interval: tuple[float, float] | None = None
    """The item's device interval in recorder seconds, once recorded (CUDA: from its events,
    mapped onto the host clock at the device's start; CPU: the residency slot held)."""

    def enqueued(self) -> cf.Future:
        """Resolves when the launch call returned (CPU: when it ran)."""
        return self._future

    async def done(self) -> Any:
        """Wait for completion without blocking the event loop; returns fn's result."""
        result = await asyncio.wrap_future(self._future)
        if self._event is not None:
            if not self._event.query():
                await self.stream.device.wait_event(self._event)
            self.stream.device._note_completed(self)
        return result

    def is_done(self) -> bool:
        if not self._future.done():
            return False
        return self._event is None or self._event.query()


class StreamHold:
    """A stream parked at a FIFO point: ``reached`` resolves once every item submitted before
    the hold has run (CPU) or been launched (CUDA); items submitted after it wait until
    :meth:`release`. The parked launcher holds no residency slot (it bypasses ``_execute``),
    so holding every stream of a device at once cannot deadlock it."""

    __slots__ = ("stream", "label", "reached", "_release")

    def __init__(self, stream: str, label: str) -> None:
        self.stream = stream
        self.label = label
        self.reached: cf.Future = cf.Future()
        self._release = threading.Event()

    def release(self) -> None:
        self._release.set()


class Stream:
    def __init__(self, device: "Device", name: str) -> None:
        self.device = device
        self.name = name
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ainfer-{name}")
        self._pending = 0
        self.num_done = 0
        """Items that ran (progress for the multi-rank watchdog)."""
        self._lock = threading.Lock()

    def _post(self, item: Callable[[], None]) -> None:
        """Queue ``item`` on the launcher thread (FIFO), counted in :attr:`num_pending` until it returns."""
        with self._lock:
            self._pending += 1

        def run() -> None:
            try:
                item()
            finally:
                with self._lock:
                    self._pending -= 1
                    self.num_done += 1

        self._pool.submit(run)

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "", deps: tuple = (),
               delay_s: float = 0.0, attrs: dict | None = None, lane: str | None = None) -> Work:
        """Enqueue ``fn(*args)`` on this stream (FIFO); returns at once. ``deps``: items of other
        streams that must complete first (waited for outside the residency slots); ``lane``: see
        :attr:`Work.lane`."""
        work = Work(self, label or getattr(fn, "__name__", "work"), self.device.recorder.now(),
                    deps=tuple(d for d in deps if d is not None), delay_s=delay_s, attrs=dict(attrs or {}),
                    lane=lane)

        def run() -> None:
            try:
                result = self.device._execute(self, work, fn, args)
            except BaseException as exc:  # delivered to whoever awaits the work
                work._future.set_exception(exc)
            else:
                work._future.set_result(result)

        self._post(run)
        return work

    def hold(self, label: str = "hold") -> "StreamHold":
        """Park this stream's launcher at a FIFO point (see :class:`StreamHold`); returns at once."""
        h = StreamHold(self.name, label)

        def park() -> None:
            h.reached.set_result(None)
            h._release.wait()

        self._post(park)
        return h

    @property
    def num_pending(self) -> int:
        with self._lock:
            return self._pending

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Device:
    kind = "abstract"

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.streams: dict[str, Stream] = {}

    def stream(self, name: str) -> Stream:
        if name not in self.streams:
            self.streams[name] = Stream(self, name)
        return self.streams[name]

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        raise NotImplementedError

    def _note_completed(self, work: Work) -> None:  # pragma: no cover - CUDA only
        pass

    async def wait_event(self, event) -> None:  # pragma: no cover - CUDA only
        raise NotImplementedError

    @contextlib.contextmanager
    def comm_budget(self):
        """Run an expert exchange outside the compute residency (its own SM budget); a no-op
        where the device does not model residency."""
        yield

    @contextlib.contextmanager
    def collective_slot(self):
        """Hold one of the device's collective slots while an attention collective is resident
        (CPU stand-in with ``collective_slots``; a no-op elsewhere: the hardware decides)."""
        yield

    def _record(self, work: Work, stream: "Stream", t0: float, t1: float) -> None:
        """The interval of a completed item; with trace attributes also a ``work`` trace event."""
        rec = self.recorder
        work.interval = (t0, t1)
        rec.interval(work.label, stream.name, t0, t1, **work.attrs)
        if work.attrs:
            rec.event("work", what=work.label, stream=stream.name, t0=t0, t1=t1, **work.attrs)

    @property
    def torch_device(self) -> torch.device:
        raise NotImplementedError

    def shutdown(self) -> None:
        for s in self.streams.values():
            s.shutdown()

    def live_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("ainfer-")]


class CpuDevice(Device):
    """CPU stand-in for a GPU (see module docstring)."""

    kind = "cpu"

    def __init__(self, recorder: Recorder, *, residency_slots: int = 2, threads_per_stream: int = 1,
                 collective_slots: int = 0) -> None:
        super().__init__(recorder)
        self.residency = threading.BoundedSemaphore(residency_slots)
        self.residency_slots = residency_slots
        self.threads_per_stream = threads_per_stream
        self.collective_slots = collective_slots
        self._collectives = threading.BoundedSemaphore(collective_slots) if collective_slots else None
        self._holding = threading.local()

    @contextlib.contextmanager
    def collective_slot(self):
        """A resident collective holds one of ``collective_slots`` until it returned (every peer
        joined); waiting for the slot, its item keeps its residency slot (SMs stay occupied)."""
        if self._collectives is None:
            yield
            return
        with self._collectives:
            yield

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
        # stream -> (CUDA stream, end event) of its item launched last: a lane switch waits for it
        self._last_launch: dict[str, tuple[torch.cuda.Stream, Any]] = {}
        self._unnoted: dict[str, list[Work]] = {}      # launched items whose interval is not recorded yet
        self._lock = threading.Lock()
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record()
        torch.cuda.synchronize()
        self._ref_host = recorder.now()
        # one waiter per item in flight (P and D each have at most a few); synchronize releases the GIL
        self._waiters = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ainfer-cuda-wait")
        for name, lane in self.lane_sms:              # at start: a partition that cannot be had fails here
            self.cuda_stream(name, lane)

    async def wait_event(self, event) -> None:
        """Until ``event`` has completed, without blocking the loop (a waiter thread blocks)."""
        await asyncio.get_running_loop().run_in_executor(self._waiters, event.synchronize)

    def shutdown(self) -> None:
        super().shutdown()
        self._waiters.shutdown(wait=True)

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
                self._cuda_streams[key] = torch.cuda.Stream(device=self.index, priority=prio)
        return self._cuda_streams[key]

    def _green_stream(self, key: tuple[str, str], sms: int) -> torch.cuda.Stream:
        """A stream of a CUDA green context holding ``sms`` of the device's SMs: its kernels run on
        those SMs only, so another stream's kernels always find the rest free. Checked at creation:
        an event recorded on it can be timed against the device's reference event (the intervals)."""
        from ..errors import BackendUnavailableError, ConfigError
        total = torch.cuda.get_device_properties(self.index).multi_processor_count
        if not 0 < sms < total:
            raise ConfigError(f"stream {key[0]} lane {key[1]}: {sms} SMs for its green context; "
                              f"this device has {total}")
        try:
            from torch.cuda.green_contexts import GreenContext
            ctx = GreenContext.create(num_sms=sms, device_id=self.index)
            s = ctx.Stream()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
            ev.synchronize()
            self._ref_event.elapsed_time(ev)
        except (ImportError, RuntimeError) as e:
            raise BackendUnavailableError(f"stream {key[0]} lane {key[1]}: no CUDA green context of {sms} SMs "
                                          f"here ({e})") from e
        self._green[key] = ctx
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
                lane_sms: dict[tuple[str, str], int] | None = None) -> Device:
    """``index`` None: the current CUDA device (a lockstep rank has set it to its local GPU).
    ``lane_sms``: CUDA only, (stream, lane) -> SMs of the green context that lane's items run in."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            from ..errors import BackendUnavailableError
            raise BackendUnavailableError("device.device=cuda but CUDA is not available on this host")
        return CudaDevice(recorder, torch.cuda.current_device() if index is None else index, high_priority_stream,
                          lane_sms)
    if any((lane_sms or {}).values()):
        from ..errors import ConfigError
        raise ConfigError(f"an SM partition of stream lanes {sorted(lane_sms)} needs a CUDA device; this one is {kind}")
    return CpuDevice(recorder, residency_slots=residency_slots, threads_per_stream=threads_per_stream,
                     collective_slots=collective_slots)
