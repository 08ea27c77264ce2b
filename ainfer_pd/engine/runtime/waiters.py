"""Daemon threads that run the device's blocking waits for the event loop.

A CUDA item's completion is awaited by a thread blocked in its end event's ``synchronize`` (it
releases the GIL and wakes the loop at once: :class:`~.device.CudaDevice`). On a device that
stopped (a kernel that never finishes) that call never returns. A
:class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits,
whatever ``shutdown(wait=False)`` said, so one such thread would keep the process from exiting
after the engine had already failed with :class:`~ainfer_pd.errors.DeviceStallError`. These
threads are daemons: a stalled device's shutdown leaves them where they are.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable

__all__ = ["BlockingWaiters"]

_STOP = None


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class BlockingWaiters:
    """``n`` daemon threads running blocking calls (:meth:`run`) in the order they were asked;
    a call beyond ``n`` at once waits for a free thread."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}_{i}", daemon=True) for i in range(n)]
        self._closed = False
        for t in self._threads:
            t.start()

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on a waiter thread; its result or exception, without blocking the loop."""
        if self._closed:
            raise RuntimeError("the device's waiters are shut down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((fn, loop, fut))
        return await fut

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            fn, loop, fut = job
            try:
                value, ok = fn(), True
            except BaseException as e:       # noqa: BLE001 - handed to the awaiting task
                value, ok = e, False
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:             # the loop closed while the wait ran: nobody awaits it
                pass

    def shutdown(self, wait: bool = True, grace_s: float = 0.5) -> list[threading.Thread]:
        """Stop the threads once their current call returns: ``wait``, join them; else give them
        ``grace_s`` to stop. Returns the threads still running (a call that never returns: a
        stalled device)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(_STOP)
        deadline = time.monotonic() + grace_s
        for t in self._threads:
            t.join(None if wait else max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive()]
