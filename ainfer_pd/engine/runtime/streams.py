"""Work items, streams and the device base class: what :mod:`.device`'s devices share.

* :class:`Work` - one enqueued item of a stream (its future, CUDA events, deps, lane, interval).
* :class:`Stream` - a FIFO launcher thread: ``submit`` enqueues and returns at once;
  :class:`StreamHold` parks it at a FIFO point.
* :class:`Device` - the streams of one device and what every device provides (``comm_budget``,
  ``collective_slot``, the recorded intervals); :class:`~.device.CpuDevice` and
  :class:`~.device.CudaDevice` run the items.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...metrics.recorder import Recorder

log = logging.getLogger(__name__)

__all__ = ["Work", "StreamHold", "Stream", "Device"]


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

    @property
    def state(self) -> str:
        """Where an unfinished item is (stall reports): ``queued`` (its launcher has not begun it),
        ``in its launch`` (the launch call runs: on the CPU device the item itself), ``launched, not
        complete on the device``."""
        if self._future.done():
            return "launched, not complete on the device"
        return "in its launch" if self.t_started is not None else "queued"

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
        self._unfinished: deque[Work] = deque()
        """Submitted items, oldest first, not yet seen complete (CPU: ran; CUDA: the end event
        passed). FIFO, so the completed ones are a prefix: :meth:`oldest_unfinished` drops it."""
        self._prune_at = 64
        self.num_completed = 0
        """Items seen complete by :meth:`oldest_unfinished` (the device watchdog's progress)."""
        self.parked = 0
        """Holds (:meth:`hold`) parked on the launcher thread now: held on purpose, not stalled."""

    def _post(self, item: Callable[[], None], work: "Work | None" = None) -> None:
        """Queue ``item`` on the launcher thread (FIFO), counted in :attr:`num_pending` until it
        returns; ``work`` joins the unfinished items under the same lock."""
        with self._lock:
            self._pending += 1
            if work is not None:
                self._unfinished.append(work)

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

        self._post(run, work)
        if len(self._unfinished) >= self._prune_at:     # bounded without a watchdog (amortized O(1))
            self.oldest_unfinished()
            self._prune_at = max(64, 2 * len(self._unfinished))
        return work

    def oldest_unfinished(self) -> "Work | None":
        """Drop the completed items at the head of the unfinished ones (counted in
        :attr:`num_completed`) and return the first that is not complete, or None. CUDA
        completion is read with a non-blocking ``event.query()``."""
        with self._lock:
            q = self._unfinished
            while q:
                try:
                    done = q[0].is_done()
                except Exception:   # noqa: BLE001 - a CUDA query in a broken context: unfinished
                    done = False
                if not done:
                    return q[0]
                q.popleft()
                self.num_completed += 1
            return None

    def unfinished(self) -> list["Work"]:
        """The items not seen complete yet, oldest first (after dropping the completed head)."""
        self.oldest_unfinished()
        with self._lock:
            return list(self._unfinished)

    def hold(self, label: str = "hold") -> "StreamHold":
        """Park this stream's launcher at a FIFO point (see :class:`StreamHold`); returns at once."""
        h = StreamHold(self.name, label)

        def park() -> None:
            with self._lock:
                self.parked += 1
            try:
                h.reached.set_result(None)
                h._release.wait()
            finally:
                with self._lock:
                    self.parked -= 1

        self._post(park)
        return h

    @property
    def num_pending(self) -> int:
        with self._lock:
            return self._pending

    def shutdown(self, wait: bool = True) -> None:
        """Cancel what is queued and stop the launcher thread; ``wait``: join it (a stalled
        device's shutdown does not: an item stuck on the device may never let it go)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


class Device:
    kind = "abstract"
    items_run_in_launch = True
    """An item's launch call runs it (the CPU device), so an item stuck in its launch is the device
    not progressing. False (CUDA): a launch only enqueues, and a long one is host work (a kernel's
    first compile), so only launched items owe the device's progress (:meth:`has_unfinished_work`)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.streams: dict[str, Stream] = {}
        self.stalled: str | None = None
        """Why the device was found stalled (the device watchdog's report), else None: its shutdown
        then joins no thread that may be stuck on it, and its memory is not freed."""

    def mark_stalled(self, why: str) -> None:
        """The device stopped progressing (:class:`~ainfer_pd.errors.DeviceStallError`)."""
        if self.stalled is None:
            self.stalled = why

    def stream(self, name: str) -> Stream:
        if name not in self.streams:
            self.streams[name] = Stream(self, name)
        return self.streams[name]

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ the device watchdog's view
    def num_completed(self) -> int:
        """Stream items seen complete so far, all streams (progress: it grows while the device runs)."""
        total = 0
        for s in list(self.streams.values()):
            s.oldest_unfinished()              # drops (and counts) the completed head
            total += s.num_completed
        return total

    def has_unfinished_work(self) -> bool:
        """Some stream that is not parked on purpose (:meth:`Stream.hold`) has an item not
        complete (where launches only enqueue, one whose launch returned): the device owes progress
        (idle, parked or compiling in a launch: never a stall)."""
        return any(not s.parked and self._owes(s.oldest_unfinished()) for s in list(self.streams.values()))

    def _owes(self, w: "Work | None") -> bool:
        return w is not None and (self.items_run_in_launch or w._future.done())

    def unfinished_report(self) -> list[dict]:
        """Each stream's oldest unfinished item (JSON-ready, for a stall's message): stream, label,
        lane, trace attributes, seconds since it was submitted, its state, and how many items of
        the stream are unfinished."""
        now = self.recorder.now()
        out = []
        for name, s in sorted(self.streams.items()):
            items = s.unfinished()
            if not items:
                continue
            w = items[0]
            out.append({"stream": name, "label": w.label, "lane": w.lane, "attrs": dict(w.attrs),
                        "age_s": round(now - w.enqueued_at, 3), "state": w.state, "count": len(items),
                        "parked": bool(s.parked)})
        return out

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
    def collective_slot(self, comm: str | None = None):
        """Keep an attention collective of communicator family ``comm`` resident in the device's
        collective residency while it runs (the CPU stand-in's model; a no-op elsewhere: the
        hardware decides)."""
        yield

    def coresident(self, *comms: str) -> bool:
        """Collectives of these communicator families can be resident at once on this device (a
        GPU: assumed, as the paper's Table 4 finds for an attention-TP pair; the CPU stand-in: its
        collective residency decides)."""
        return True

    def _record(self, work: Work, stream: "Stream", t0: float, t1: float) -> None:
        """The interval of a completed item; with trace attributes also a ``work`` trace event."""
        rec = self.recorder
        work.interval = (t0, t1)
        rec.interval(work.label, stream.name, t0, t1, **work.attrs)
        if work.attrs:
            # launch_s: the host's launch call of the item (its kernels enqueued), beside its device interval
            # (where the host launches slower than the device runs, the interval holds the device's waits)
            launch = (work.t_launched - work.t_started) if work.t_launched is not None and work.t_started is not None \
                else None
            rec.event("work", what=work.label, stream=stream.name, t0=t0, t1=t1, launch_s=launch, **work.attrs)

    @property
    def torch_device(self) -> torch.device:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop every stream's launcher; joined unless the device stalled (:attr:`stalled`: its
        memory is then kept too, since freeing it would wait for the device)."""
        for s in self.streams.values():
            s.shutdown(wait=self.stalled is None)
        if self.stalled is not None:
            log.warning("the device stalled: its stream threads are not joined and its memory is not given back")

    def live_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("ainfer-")]
