"""The CUDA (NCCL) variant of the multi-rank device: real CUDA streams per phase, NCCL
collectives enqueued on them, and a **residency gate** that makes the crossed-order stall
deterministic.

Why a gate. On a GPU two NCCL kernels of different communicators usually fit on the SMs
together, so opposite enqueue orders on the P and D streams only deadlock when the device
cannot run the second collective while the first one spins on its peers (SPEC 2: the paper
saw it with SMs full of D graph kernels; limiting per-SM residency made it go away). Neither
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue: kernels of different streams still run
concurrently once launched) nor NCCL channel counts guarantee that on a 132-SM H200. The gate
does, the way the CPU stand-in's residency semaphore does: with ``slots`` = N, at most N
collectives of this GPU are *resident* (launched and their end event not fired). A collective
becomes resident only when its stream reached it (every earlier item of that stream, and every
cross-stream dependency, completed: a waiting stream holds no SMs), then holds its slot until
its NCCL kernel completed on the device, i.e. until every peer joined. ``slots = 0`` turns the
gate off (pure hardware behaviour; the outcome of the crossed run then depends on the GPU).

* :class:`ResidencyGate`: the slots (held by CUDA end events; polled, never blocks the loop).
* :class:`CompletionPoller`: one daemon thread per device that turns CUDA events into
  completion callbacks (collective bookkeeping, work intervals for the trace).
* :class:`DepCudaDevice`: :class:`~ainfer_pd.engine.device.CudaDevice` plus cross-stream
  dependencies (``cudaStreamWaitEvent``), the gate, the poller and :meth:`close` (releases
  every stream thread blocked in the gate after a stall).
* :func:`cuda_collective_item`: the stream item of one phase collective on CUDA.
* :func:`warm_up_nccl`: creates the NCCL communicators in one global order before any
  out-of-phase traffic (lazy creation inside racing stream threads could itself deadlock).
* :func:`abort_nccl`: ``ncclCommAbort`` of the data groups after a stall (bounded; the
  spinning kernels exit), so the process can exit.

Importable without CUDA; :class:`DepCudaDevice` raises :class:`BackendUnavailableError` on a
host without CUDA.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..engine.device import CudaDevice, Stream, Work
from ..errors import DistributedError
from ..phase import Phase
from ..comm.backend import group_backend, require_cuda

__all__ = [
    "CompletionPoller",
    "DepCudaDevice",
    "ResidencyGate",
    "abort_nccl",
    "cuda_collective_item",
    "device_sleep",
    "warm_up_nccl",
]

log = logging.getLogger("ainfer_pd.multirank.cuda")


class _Slot:
    __slots__ = ("event", "released")

    def __init__(self) -> None:
        self.event: Any = None          # end event of the collective holding the slot
        self.released = False

    def done(self) -> bool:
        return self.released or (self.event is not None and bool(self.event.query()))


class ResidencyGate:
    """At most ``slots`` collectives of one device resident at once (see module docstring).

    ``acquire`` blocks the calling *stream thread* (never the event loop) until a slot is
    free; the returned slot is bound to the collective's end event and frees itself when
    that event fired. ``closed`` (set by :meth:`DepCudaDevice.close`) makes waiters raise.
    Works with any event object that has ``query()`` (unit-tested with fakes on CPU).
    """

    def __init__(self, slots: int, closed: threading.Event | None = None, poll_s: float = 1e-4) -> None:
        if slots < 1:
            raise ValueError(f"residency gate needs >= 1 slot, got {slots}")
        self.slots = slots
        self.closed = closed or threading.Event()
        self.poll_s = poll_s
        self._held: list[_Slot] = []
        self._lock = threading.Lock()

    def in_use(self) -> int:
        with self._lock:
            self._held = [s for s in self._held if not s.done()]
            return len(self._held)

    def acquire(self, what: str = "a collective") -> _Slot:
        while True:
            with self._lock:
                self._held = [s for s in self._held if not s.done()]
                if len(self._held) < self.slots:
                    slot = _Slot()
                    self._held.append(slot)
                    return slot
            if self.closed.is_set():
                raise DistributedError(f"device closed while {what} waited for a residency slot")
            time.sleep(self.poll_s)

    @staticmethod
    def bind(slot: _Slot, end_event: Any) -> None:
        slot.event = end_event

    @staticmethod
    def release(slot: _Slot) -> None:
        slot.released = True


class CompletionPoller:
    """Calls ``callback()`` once ``event.query()`` is true, on one daemon thread, in the order
    the events were added (FIFO per stream holds: a later event of a stream never fires first)."""

    def __init__(self, poll_s: float = 2e-4, name: str = "ainfer-pd-cuda-poller") -> None:
        self.poll_s = poll_s
        self.name = name
        self._items: list[tuple[Any, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[BaseException] = []

    def add(self, event: Any, callback: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((event, callback))
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def poll_once(self) -> int:
        """Fire every completed item; returns how many fired."""
        with self._lock:
            items = list(self._items)
        fired = []
        for ev, cb in items:
            if not ev.query():
                continue
            fired.append((ev, cb))
            try:
                cb()
            except BaseException as exc:
                self.errors.append(exc)
                log.exception("completion callback failed")
        if fired:
            ids = {id(cb) for _, cb in fired}
            with self._lock:
                self._items = [(e, c) for e, c in self._items if id(c) not in ids]
        return len(fired)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.poll_once():
                self._stop.wait(self.poll_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait (this thread) until nothing is pending; False at the deadline."""
        end = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() >= end:
                return False
            time.sleep(self.poll_s)
        return True

    def stop(self) -> None:
        self._stop.set()


def device_sleep(seconds: float, index: int) -> None:
    """Keep the current CUDA stream busy for about ``seconds`` (``torch.cuda._sleep`` spins
    clock cycles; the clock rate comes from the device properties, else 1.5 GHz)."""
    if seconds <= 0:
        return
    khz = getattr(torch.cuda.get_device_properties(index), "clock_rate", 0) or 1_500_000
    torch.cuda._sleep(max(1, int(seconds * khz * 1e3)))


class DepCudaDevice(CudaDevice):
    """CUDA streams (one per phase, plus ``C``), cross-stream dependencies as device-side waits,
    the residency gate for collectives and a completion poller."""

    kind = "cuda"

    def __init__(self, recorder: Any, index: int = 0, *, residency_slots: int = 1, poll_s: float = 1e-4) -> None:
        require_cuda("the CUDA harness device")
        if residency_slots < 0:
            raise ValueError(f"residency_slots must be >= 0 (0: no gate), got {residency_slots}")
        super().__init__(recorder, index)
        self.poll_s = poll_s
        self.closed = threading.Event()
        self.residency_slots = residency_slots
        self.gate = ResidencyGate(residency_slots, self.closed, poll_s) if residency_slots > 0 else None
        self.poller = CompletionPoller(name=f"ainfer-pd-cuda-poller-{index}")

    # ------------------------------------------------------------------ stream items
    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        from .collectives import _WithDeps
        if isinstance(fn, _WithDeps) and fn.deps:
            torch.cuda.set_device(self.index)
            cs = self.cuda_stream(stream.name)
            for d in fn.deps:
                d.enqueued().result()            # launched (re-raises a failed dependency)
                if d._event is not None:
                    cs.wait_event(d._event)      # device-side wait: a waiting stream holds no SMs
        return super()._execute(stream, work, fn, args)

    def host_time(self, event: Any) -> float:
        """Recorder seconds of a completed timing event."""
        return self._ref_host + self._ref_event.elapsed_time(event) / 1e3

    def on_done(self, work: Work, cb: Callable[[float, float], None]) -> None:
        """``cb(t0, t1)`` (device interval of ``work`` in recorder seconds) once it completed."""
        def launched(fut: Any) -> None:
            if fut.cancelled() or fut.exception() is not None or work._event is None:
                return
            start, end = work._start_event, work._event
            self.poller.add(end, lambda: cb(self.host_time(start), self.host_time(end)))
        work.enqueued().add_done_callback(launched)

    def wait_reached(self, stream: torch.cuda.Stream, what: str) -> None:
        """Block this stream thread until the device has run everything enqueued on ``stream``
        so far (the next kernel would start now). Raises once the device is closed."""
        ev = torch.cuda.Event()
        ev.record(stream)
        while not ev.query():
            if self.closed.is_set():
                raise DistributedError(f"device closed while {what} waited for its stream")
            time.sleep(self.poll_s)

    # ------------------------------------------------------------------ lifecycle
    def quiesce(self, timeout_s: float = 5.0) -> bool:
        """Wait (off the loop: call through ``asyncio.to_thread``) for every tracked completion."""
        return self.poller.drain(timeout_s)

    def close(self) -> None:
        """Release every stream thread waiting in the gate or for its stream (after a stall)."""
        self.closed.set()

    def shutdown(self) -> None:
        self.close()
        self.poller.stop()
        super().shutdown()


def cuda_collective_item(colls: Any, info: dict, phase: Phase, fn: Callable, make: Callable,
                         delay_s: float) -> Callable[[], torch.Tensor]:
    """The stream item of one phase collective on a :class:`DepCudaDevice` (runs on the
    stream's launcher thread under ``torch.cuda.stream``). With a gate: wait until the stream
    reached it, take a residency slot, enqueue the NCCL call between two timing events, bind
    the slot to the end event. The bookkeeping (``coll_done``, intervals, progress) runs on the
    poller thread when the end event fired."""
    dev = colls.device
    what = f"{info['name']} #{info['seq']}"

    def run() -> torch.Tensor:
        stream = torch.cuda.current_stream(dev.index)
        slot = None
        try:
            if dev.gate is not None:
                dev.wait_reached(stream, what)
                slot = dev.gate.acquire(what)
            t = make()
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            colls._started(info)
            out = fn(phase, t)
            device_sleep(delay_s, dev.index)          # delayed completion (fault knob): keeps the slot
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
        except DistributedError:
            if slot is not None:
                dev.gate.release(slot)
            info["state"] = "failed"
            raise
        except Exception as exc:
            if slot is not None:
                dev.gate.release(slot)
            raise colls._failure(info, exc) from exc
        if slot is not None:
            dev.gate.bind(slot, end)
        dev.poller.add(end, lambda: colls._completed(info, dev.host_time(start), dev.host_time(end)))
        return out

    return run


# ====================================================================== communicators
def warm_up_nccl(groups: dict[str, Any], names: Iterable[str], index: int) -> list[str]:
    """One tiny all-reduce on each NCCL group of ``names`` (in that order, the same on every
    rank), then synchronize: every communicator exists before out-of-phase traffic starts.
    Returns the names warmed up."""
    import torch.distributed as dist

    todo = [n for n in names if groups.get(n) is not None and group_backend(groups[n]) == "nccl"]
    if not todo:
        return []
    torch.cuda.set_device(index)                 # the current device is per thread
    t = torch.zeros(1, device=torch.device("cuda", index))
    for name in todo:
        dist.all_reduce(t, group=groups[name])
    torch.cuda.synchronize(index)
    return todo


def abort_nccl(groups: dict[str, Any], timeout_s: float = 10.0) -> bool:
    """Abort the NCCL communicators among ``groups`` (``ProcessGroup.abort``: ncclCommAbort,
    kernels spinning on a peer exit) on a daemon thread; True if that finished within
    ``timeout_s``. Best effort: the caller exits the process either way."""
    pgs = []
    for pg in groups.values():
        try:
            nccl = group_backend(pg) == "nccl"
        except (RuntimeError, ValueError) as exc:   # a group destroyed already: nothing to abort
            log.debug("abort_nccl: skipping a group: %s", exc)
            continue
        if nccl and all(pg is not q for q in pgs):
            pgs.append(pg)
    if not pgs:
        return True

    def work() -> None:
        for pg in pgs:
            try:
                pg.abort()
            except Exception as exc:  # noqa: BLE001 - best effort
                log.warning("NCCL abort failed: %s", exc)

    th = threading.Thread(target=work, name="ainfer-pd-nccl-abort", daemon=True)
    th.start()
    th.join(timeout_s)
    return not th.is_alive()
