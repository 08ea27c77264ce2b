"""Devices and streams: enqueue returns at once, completion comes later.

* :class:`CudaDevice` - real CUDA streams. Each stream has one launcher thread that
  enqueues kernels under ``torch.cuda.stream(s)`` (so launches never block the event
  loop) and records CUDA events; completion is awaited by polling ``event.query()``.
* :class:`CpuDevice` - a **CPU stand-in** for a GPU, named as such. Each stream is a
  FIFO executor thread; ``submit`` only enqueues. A device-wide *residency* semaphore
  of N slots is held by every running item, the way kernels hold SMs; a collective
  (see ``hold_until``) keeps its slot until every peer has joined, as spinning NCCL /
  DeepEP kernels do. torch releases the GIL inside ops, so the P and D streams really
  run at once on two cores.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
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

    def enqueued(self) -> cf.Future:
        """Resolves when the launch call returned (CPU: when it ran)."""
        return self._future

    async def done(self) -> Any:
        """Wait for completion without blocking the event loop; returns fn's result."""
        result = await asyncio.wrap_future(self._future)
        if self._event is not None:
            while not self._event.query():
                await asyncio.sleep(0.0002)
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

        self._pool.submit(run)

    def submit(self, fn: Callable[..., Any], *args: Any, label: str = "") -> Work:
        """Enqueue ``fn(*args)`` on this stream (FIFO); returns at once."""
        work = Work(self, label or getattr(fn, "__name__", "work"), self.device.recorder.now())

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

    def __init__(self, recorder: Recorder, *, residency_slots: int = 2, threads_per_stream: int = 1) -> None:
        super().__init__(recorder)
        self.residency = threading.BoundedSemaphore(residency_slots)
        self.residency_slots = residency_slots
        self.threads_per_stream = threads_per_stream

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        with self.residency:
            t0 = self.recorder.now()
            try:
                with torch.inference_mode():
                    return fn(*args)
            finally:
                self.recorder.interval(work.label, stream.name, t0, self.recorder.now())


class CudaDevice(Device):
    """Real CUDA streams; completion through CUDA events."""

    kind = "cuda"

    def __init__(self, recorder: Recorder, index: int = 0, high_priority_stream: str = "none") -> None:
        super().__init__(recorder)
        self.index = index
        self.high_priority_stream = high_priority_stream
        torch.cuda.set_device(index)
        self._cuda_streams: dict[str, torch.cuda.Stream] = {}
        self._unnoted: dict[str, list[Work]] = {}      # launched items whose interval is not recorded yet
        self._lock = threading.Lock()
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record()
        torch.cuda.synchronize()
        self._ref_host = recorder.now()

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def cuda_stream(self, name: str) -> torch.cuda.Stream:
        if name not in self._cuda_streams:
            # lower number = higher priority; priority_range() is (lowest, highest)
            prio = torch.cuda.Stream.priority_range()[1] if name == self.high_priority_stream else 0
            self._cuda_streams[name] = torch.cuda.Stream(device=self.index, priority=prio)
        return self._cuda_streams[name]

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        cs = self.cuda_stream(stream.name)
        torch.cuda.set_device(self.index)
        with torch.cuda.stream(cs), torch.inference_mode():
            start = torch.cuda.Event(enable_timing=True)
            start.record(cs)
            result = fn(*args)
            end = torch.cuda.Event(enable_timing=True)
            end.record(cs)
        work._start_event, work._event = start, end
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
            self.recorder.interval(w.label, w.stream.name, a, b)


def make_device(kind: str, recorder: Recorder, *, residency_slots: int = 2, threads_per_stream: int = 1,
                index: int | None = None, high_priority_stream: str = "none") -> Device:
    """``index`` None: the current CUDA device (a lockstep rank has set it to its local GPU)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            from ..errors import BackendUnavailableError
            raise BackendUnavailableError("device.device=cuda but CUDA is not available on this host")
        return CudaDevice(recorder, torch.cuda.current_device() if index is None else index, high_priority_stream)
    return CpuDevice(recorder, residency_slots=residency_slots, threads_per_stream=threads_per_stream)
