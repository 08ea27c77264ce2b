"""The lifecycle of :class:`~ainfer_pd.worker.RolloutWorker`: entering and leaving ``async
with`` (the engine's task in the worker's TaskGroup, the ordered exit: control calls, turns in
flight, the lockstep peers, the stream threads, the recorder) and the checks every call starts
with (open, not failed, on the worker's own loop and thread).

A mixin of the worker (:class:`WorkerLifecycle`); it reads the state the worker's ``__init__``
sets up and ends the control calls through :meth:`WorkerControl._close_control`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Self

from .errors import AInferPDError, WorkerClosedError, WrongEventLoopError, first_error

log = logging.getLogger("ainfer_pd.worker")

class WorkerLifecycle:
    """``async with`` and the open / loop / thread checks of a worker (mixin)."""

    async def __aenter__(self) -> Self:
        if self._loop is not None:
            raise WorkerClosedError("a RolloutWorker can be entered once (create a new one)")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._engine_task = self._tg.create_task(self._run_engine(), name="ainfer-engine")
        return self

    async def _run_engine(self) -> None:
        """The engine's loops. NOTE: an engine failure is recorded and every waiter gets a typed
        error; it is not re-raised into the TaskGroup, which would cancel the user's task and
        wrap what comes out of ``async with`` in an ExceptionGroup. ``__aexit__`` raises it."""
        try:
            await self.engine.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = exc
            log.error("rank %d: the engine failed: %r", self.rank, exc)
            self.engine.book.fail_all(self._failure_error())

    def _failure_error(self) -> AInferPDError:
        exc = self._failure
        if isinstance(exc, AInferPDError):
            return exc
        return WorkerClosedError(f"engine failed: {exc!r}")

    async def _await_peers_closing(self, window_s: float) -> WorkerClosedError | None:
        """Wait for the lockstep engine's task to end once every rank is closing; None when it
        ended, or the error naming the ranks still serving when its steps stopped advancing for a
        whole ``window_s``."""
        assert self._engine_task is not None
        eng = self.engine
        steps = eng.num_steps
        while True:
            try:
                async with asyncio.timeout(window_s):
                    await asyncio.shield(self._engine_task)
                return None
            except TimeoutError:
                busy = list(eng.not_closing)
                if eng.num_steps == steps:
                    who = f"; ranks not yet closing: {busy}" if busy else ""
                    return WorkerClosedError(f"rank {self.rank}: peers did not close: no lockstep step "
                                             f"for {window_s:.0f} s (2x the rendezvous timeout){who}")
                log.info("rank %d: closing, waiting for ranks %s to finish their work (%d steps)",
                         self.rank, busy, eng.num_steps - steps)
                steps = eng.num_steps

    async def __aexit__(self, et, exc, tb) -> None:
        """Abort what is in flight, stop the loops, join the stream threads. The user's own
        exception (``et``) propagates unchanged; without one, an engine failure or a peer that
        did not close is raised here, typed."""
        self._check_loop("leave the worker")
        self._closed = True
        # control calls waiting for the streams to park (update_weights, sleep, wake_up) end first
        # and let the streams go: the shutdown below joins the stream threads (issue 34, item 11)
        await self._close_control()
        for traj in self.trajectories.values():
            if traj.turn is not None:
                self.engine.book.abort(traj.turn)
        close_error: BaseException | None = None
        try:
            if (self._engine_task is not None and not self._engine_task.done() and et is None
                    and self.engine.multi_rank):
                # lockstep ranks leave together: keep stepping until every rank is closing and idle.
                # A rank with no work of its own (a TP follower) waits here as long as its peers
                # still serve theirs: every lockstep step is a rendezvous of all ranks (a dead peer
                # fails it within the rendezvous timeout), so the wait fails only when the steps stop.
                self.engine.begin_closing()
                close_error = await self._await_peers_closing(self.cfg.parallel.rendezvous_timeout_s * 2)
            await self._stop_engine_task(et)
        finally:
            await self._release_engine(et, close_error)
        self._raise_exit_error(et, close_error)
        return None

    async def _stop_engine_task(self, et) -> None:
        """Cancel the engine's task and leave the worker's TaskGroup. A BaseException of the
        engine comes out typed when the user's block raised nothing (``et``), else is logged."""
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()
        assert self._tg is not None
        try:
            # NOTE: the TaskGroup owns the worker's tasks only: the user's exception is not
            # passed in (it would come out wrapped in an ExceptionGroup).
            await self._tg.__aexit__(None, None, None)
        except BaseExceptionGroup as eg:      # a BaseException (KeyboardInterrupt...) in the engine
            if et is None:
                raise (first_error(eg, typed_only=True) or WorkerClosedError(f"engine failed: {eg!r}")) from eg
            log.error("rank %d: the engine failed while leaving on %s: %r", self.rank, et.__name__, eg)

    async def _release_engine(self, et, close_error: BaseException | None) -> None:
        """Whatever the exit met: join the stream threads, end every turn still known, close the
        control rendezvous, dump the timeline (with ``trace_dir``) and close the recorder."""
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()                    # we were cancelled while closing
        await asyncio.to_thread(self.engine.shutdown)     # joins stream threads off the loop
        self.engine.book.close()                          # no caller or drain waiter left behind
        try:
            await self.engine.aclose()                    # the control rendezvous of a lockstep rank
        except Exception as e:                            # noqa: BLE001 - closing must not mask the exit
            log.warning("rank %d: closing the control rendezvous failed: %r", self.rank, e)
        if self.cfg.trace_dir:
            self._dump_timeline(failed=et is not None or close_error is not None or self._failure is not None)
        self.recorder.close()

    def _raise_exit_error(self, et, close_error: BaseException | None) -> None:
        """The end of the exit: the user's exception propagates (an engine failure is logged);
        without one, an engine failure or a peer that did not close is raised, typed."""
        if et is not None:
            if self._failure is not None:
                log.error("rank %d: leaving on %s; the engine had failed: %r", self.rank, et.__name__, self._failure)
            return
        if self._failure is not None:
            raise self._failure_error() from self._failure
        if close_error is not None:
            raise close_error

    def _dump_timeline(self, *, failed: bool) -> None:
        """Work intervals of this rank next to its control trace (``ainfer-pd timeline RUN_DIR``
        draws them; for a failed run the plot shows where each stream stopped)."""
        import json
        path = timeline_path(self.cfg.trace_dir, self.rank)
        data = {"rank": self.rank, "failed": failed, "failure": repr(self._failure) if self._failure else None,
                "intervals": [[n, s, a, b] for (n, s, a, b, _) in self.recorder.intervals]}
        path.write_text(json.dumps(data))

    def _check_open(self) -> None:
        """Every public coroutine starts here: open, not failed, and on the worker's own loop."""
        if self._tg is None or self._closed:
            raise WorkerClosedError("worker is not running (use `async with RolloutWorker(cfg)`)")
        self._check_loop()
        if self._failure is not None:
            raise WorkerClosedError(f"worker failed: {self._failure!r}")

    def _check_loop(self, what: str = "use the worker") -> None:
        """The running loop must be the one that entered the worker (issue 13, case 9: a call
        from another thread's loop, or from a later ``asyncio.run()``, used to hang)."""
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise WrongEventLoopError(
                f"cannot {what} from {'this event loop' if running is not None else 'outside an event loop'}: "
                f"the worker belongs to the event loop that entered it (thread {self._thread}); "
                "submit calls there, e.g. with asyncio.run_coroutine_threadsafe")

    def _check_thread(self) -> None:
        """Synchronous methods read the engine's state: while the worker runs, only from its thread."""
        if self._loop is None or self._closed:
            return
        if threading.get_ident() != self._thread:
            raise WrongEventLoopError("the worker's state belongs to the thread of the event loop that "
                                      f"entered it (thread {self._thread}); call it there")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is not self._loop:
            raise WrongEventLoopError("the worker belongs to another event loop of this thread")


def timeline_path(trace_dir: str, rank: int) -> Path:
    """Where a rank's work intervals go at the end of its run (``ainfer-pd timeline`` reads them)."""
    return Path(trace_dir) / f"timeline_rank{rank}.json"
