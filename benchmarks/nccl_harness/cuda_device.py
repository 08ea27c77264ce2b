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
* :class:`DepCudaDevice`: :class:`~ainfer_pd.engine.runtime.device.CudaDevice` (its items' ``deps``
  are device-side waits, ``cudaStreamWaitEvent``) plus the gate, the poller and :meth:`close`
  (releases every stream thread blocked in the gate after a stall).
* :func:`cuda_collective_item`: the stream item of one phase collective on CUDA, built from the
  library's :class:`~ainfer_pd.comm.collectives.PhaseCollectives` halves; only the completion
  differs from :meth:`~ainfer_pd.comm.collectives.PhaseCollectives.run` (the end event, not the
  host call's return: an NCCL call returns once enqueued).

The NCCL communicators are created in one order before any run and aborted after a stall by the
library (:func:`ainfer_pd.comm.backend.warm_up_nccl`, :func:`~ainfer_pd.comm.backend.abort_nccl`).

Importable without CUDA; :class:`DepCudaDevice` raises :class:`BackendUnavailableError` on a
host without CUDA.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ainfer_pd.comm.backend import require_cuda
from ainfer_pd.engine.runtime.device import CudaDevice, Work
from ainfer_pd.errors import DistributedError

__all__ = ["CompletionPoller", "DepCudaDevice", "ResidencyGate", "cuda_collective_item", "device_sleep"]

log = logging.getLogger("benchmarks.nccl_harness.cuda")


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
    """CUDA streams (one per phase, plus ``C``; the library's device: cross-stream dependencies
    are device-side waits), the residency gate for collectives and a completion poller."""

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


def cuda_collective_item(colls: Any, info: dict, make: Callable[[], torch.Tensor], dev: DepCudaDevice,
                         on_done: Callable[[dict], None]) -> Callable[[], torch.Tensor]:
    """The stream item of the collective ``info`` (enqueued on ``colls``, a
    :class:`~ainfer_pd.comm.collectives.PhaseCollectives`) on ``dev``; it runs on the stream's
    launcher thread under ``torch.cuda.stream``. With a gate: wait until the stream reached it,
    take a residency slot, enqueue the NCCL call between two timing events, bind the slot to the
    end event. ``mark_completed`` (``coll_done``, the ``work`` interval, progress) and
    ``on_done(info)`` run on the poller thread when the end event fired."""
    kind = info["kind"]
    what = f"{info['name']} #{info['seq']}"

    def done(start: Any, end: Any) -> None:
        colls.mark_completed(info, dev.host_time(start), dev.host_time(end))
        on_done(info)

    def run() -> torch.Tensor:
        stream = torch.cuda.current_stream(dev.index)
        slot = None
        try:
            if colls.take(kind) is not info:
                raise DistributedError(f"{what} ran out of its communicator's host order")
            if dev.gate is not None:
                dev.wait_reached(stream, what)
                slot = dev.gate.acquire(what)
            t = make()
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            colls.mark_started(info)
            out = colls.apply(kind, t)
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
            raise colls.failure(info, exc) from exc
        if slot is not None:
            dev.gate.bind(slot, end)
        dev.poller.add(end, lambda: done(start, end))
        return out

    return run
