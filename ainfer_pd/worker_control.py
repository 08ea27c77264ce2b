"""The device-memory control of :class:`~ainfer_pd.worker.RolloutWorker`: ``sleep`` /
``wake_up``, ``release_kv_cache`` / ``resume_kv_cache``, and the control lock that
``update_weights`` (:mod:`.worker_sync`, a base of this mixin) and ``calibrate_kv_scales``
(:mod:`.worker_calibration`, another) share with them.

A mixin of the worker (its public coroutines): each runs its device work in a thread while
every stream of the device is parked (:meth:`WorkerControl._with_streams_parked`), never on
the event loop. Its state (asleep, weights stale, graphs owed) is set up by
:meth:`WorkerControl._init_control`.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from .engine.model.weights import WeightStage
from .engine.runtime.runner import graph_captures
from .errors import AInferPDError, InvalidRequestError, WeightUpdateError, WorkerAsleepError, WorkerClosedError
from .worker_calibration import KvCalibration
from .worker_sync import WeightSync


CLOSE_WAIT_S = 10.0
"""Longest the worker's exit waits for a control call to let the streams go (a copy in progress
finishes first); after it the streams are released anyway."""


class WorkerControl(WeightSync, KvCalibration):
    """Weights, sleep / wake and KV-pool control of a running worker (mixin; the weight sync is
    its base :class:`~ainfer_pd.worker_sync.WeightSync`, the FP8 KV scale calibration its base
    :class:`~ainfer_pd.worker_calibration.KvCalibration`)."""

    def _init_control(self) -> None:
        self._sleeping = False
        self._asleep = False             # device memory given back (sleep level >= 1)
        self._weights_stale = False      # weights dropped at sleep and not yet synced
        self._capture_owed = False       # decode graphs to recapture after the next complete sync
        self._weights_lock = asyncio.Lock()
        self._ctl_closed = False         # the worker is leaving: control calls stop waiting
        self._close_waiters: set[asyncio.Future] = set()
        self._active_holds: list = []    # the stream holds of the control call now parking the streams
        self._active_stages: set[WeightStage] = set()
        self._agreement = None           # SyncAgreement of a multi-rank worker (built on first use)
        self.last_weight_sync = None
        """The :class:`~ainfer_pd.engine.model.weights.SyncReport` of the last applied weight sync."""

    # ================================================================== one control call at a time
    @contextlib.asynccontextmanager
    async def _control_lock(self, what: str, on_fail: Callable[[BaseException], None] | None = None, *,
                            typed: bool = False):
        """Hold the control lock for one call; refuse it once the worker is closing. ``on_fail``
        sees any error of the body (a multi-rank sync fails its sync for every rank there); with
        ``typed`` an untyped error comes out as a WeightUpdateError."""
        try:
            async with self._weights_lock:
                if self._ctl_closed:
                    raise WorkerClosedError(f"the worker was closed before {what} could run")
                yield
        except BaseException as exc:
            if on_fail is not None:
                on_fail(exc)
            if not typed or isinstance(exc, AInferPDError) or not isinstance(exc, Exception):
                raise
            raise WeightUpdateError(f"weight update rejected: {exc!r}") from exc

    async def _or_closed(self, fut: asyncio.Future, what: str) -> Any:
        """Await ``fut`` unless the worker closes first (then WorkerClosedError; ``fut`` is left
        alone). No task is created."""
        if self._ctl_closed:
            raise WorkerClosedError(f"the worker was closed while {what}")
        closer = asyncio.get_running_loop().create_future()
        self._close_waiters.add(closer)
        try:
            await asyncio.wait([fut, closer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._close_waiters.discard(closer)
            if not closer.done():
                closer.cancel()
        if fut.done():
            return fut.result()
        raise WorkerClosedError(f"the worker was closed while {what}")

    async def _or_closed_coro(self, coro, what: str) -> Any:
        """Await the coroutine ``coro`` (a task of a TaskGroup) unless the worker closes first:
        then it is cancelled and WorkerClosedError raised. Its own error: a WeightUpdateError
        (typed errors pass unchanged)."""
        if self._ctl_closed:
            coro.close()
            raise WorkerClosedError(f"the worker was closed while {what}")
        closer = asyncio.get_running_loop().create_future()
        self._close_waiters.add(closer)
        try:
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(_outcome(coro))
                closer.add_done_callback(lambda _f: task.cancel())
        finally:
            self._close_waiters.discard(closer)
            if not closer.done():
                closer.cancel()
        if task.cancelled():
            raise WorkerClosedError(f"the worker was closed while {what}")
        ok, value = task.result()
        if ok:
            return value
        if isinstance(value, AInferPDError):
            raise value
        raise WeightUpdateError(f"the weight source raised {value!r}; nothing was written") from value

    async def _close_control(self) -> None:
        """The worker is leaving: every control call stops waiting (WorkerClosedError), a staging
        thread stops at its next item, a copy in progress finishes; then the streams are free
        (bounded by ``CLOSE_WAIT_S``: after it every hold is released anyway)."""
        self._ctl_closed = True
        for w in list(self._close_waiters):
            if not w.done():
                w.set_result(None)
        for st in list(self._active_stages):
            st.cancelled = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        while self._weights_lock.locked() and self._active_holds and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if self._active_holds:
            import logging
            logging.getLogger("ainfer_pd.worker").warning(
                "a control call still parks the streams after %.0f s: releasing them", CLOSE_WAIT_S)
            for h in self._active_holds:
                h.release()

    async def sleep(self, level: int = 0, *, keep_weights: bool = True) -> None:
        """Abort everything in flight, drop all retained KV, and give device memory back.

        ``level`` 0: the retained KV only (the pool stays allocated: later calls just work);
        1: also the KV pool and the decode CUDA graphs; 2: also the weights, to pinned host
        memory (``keep_weights``) or dropped (the next complete ``update_weights`` refills them,
        as verl syncs right after ``wake_up(["weights"])``). After level >= 1, ``generate`` /
        ``continue_`` raise :class:`WorkerAsleepError` until :meth:`wake_up`. Trajectories stay
        registered with their tokens: their next turn recomputes.

        Turns started while it waits for aborted device work to drain are aborted too; the KV
        is dropped in one step once nothing is in flight or draining (issue 13, case 11: a turn
        admitted during the wait used to lose its KV). The device memory is released in a thread
        while every stream is parked (never on the event loop)."""
        self._check_open()
        if level not in (0, 1, 2) or isinstance(level, bool):
            raise InvalidRequestError(f"sleep level must be 0, 1 or 2, got {level!r}")
        while True:
            await self.abort_all()
            draining = [t.draining for t in self.trajectories.values() if t.draining is not None]
            if not draining:
                break
            for d in draining:
                await d.drained.wait()
        # NOTE: no await from here on until the drop: nothing can be admitted in between.
        self.engine.kv.drop_cached()
        if level >= 1:
            self._asleep = True           # refuse new turns before the release awaits
            await self.engine.quiesce()   # nothing that needs this rank starts any more (issue 34, 13)
            res = self.engine.residency

            def release() -> None:
                res.release_kv()
                if level >= 2:
                    res.release_weights(keep_weights)
            await self._with_streams_parked(release)
        self._sleeping = True

    async def reserve_sleep_buffer(self) -> int:
        """Allocate (page-lock, on CUDA) the host buffer that ``sleep(2, keep_weights=True)`` moves
        the weights into, now, in a thread: the first such sleep then only copies (the buffer is
        kept across sleeps either way; page-locking the 61 GB of the Qwen3-30B-A3B shape takes
        tens of seconds). Returns its bytes. Needs the weights on the device."""
        self._check_open()
        async with self._control_lock("reserve_sleep_buffer"):
            if self.engine.residency.state.weights != "device":
                raise WorkerAsleepError("the weights are off the device: wake_up(['weights']) first")
            job = asyncio.get_running_loop().run_in_executor(None, self.engine.residency.reserve_host_buffer)
            buf = await asyncio.shield(job)
        return int(buf.numel())

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Back from ``sleep``: restore what ``tags`` name ("weights", "kv_cache"; both when
        None, as verl passes them). Weights come back from pinned host memory (or, if they were
        dropped, as uninitialised storage that the next complete weight sync must fill: turns
        are refused until then); the KV pool is reallocated and the decode graphs recaptured
        once both are on the device."""
        self._check_open()
        if tags is not None and (isinstance(tags, (str, bytes)) or not all(isinstance(t, str) for t in tags)):
            raise InvalidRequestError(f"wake_up tags must be a list of strings, got {tags!r}")
        from .engine.kv.residency import KV_CACHE, TAGS, WEIGHTS
        want = set(TAGS if tags is None else tags)
        if want - set(TAGS):
            raise InvalidRequestError(f"unknown wake_up tags {sorted(want - set(TAGS))}: expected some of {TAGS}")
        res = self.engine.residency
        recapture = {"needed": False}

        def restore() -> None:
            if WEIGHTS in want and not res.restore_weights():
                self._weights_stale = True       # dropped at sleep: only a complete sync makes them valid
            if KV_CACHE in want and res.restore_kv():
                recapture["needed"] = True
        await self._with_streams_parked(restore)
        self.engine.resume()              # this rank joins the steps again (issue 34, 13)
        if res.state.kv and res.state.weights == "device" and (recapture["needed"] or self._capture_owed):
            if self._weights_stale:
                self._capture_owed = True        # captured after the sync: graphs bind the synced storage
            else:
                await self._recapture_graphs()
        self._asleep = not (res.state.kv and res.state.weights == "device")
        self._sleeping = self._asleep

    async def _recapture_graphs(self) -> None:
        eng = self.engine
        for ctx, capture, label in graph_captures(eng.runner, eng.decode_ctx, eng.prefill_ctx):
            w = ctx.stream.submit(capture, ctx, label=label)
            await self._or_closed(asyncio.wrap_future(w.enqueued()), f"the graphs were recaptured ({label})")
            await w.done()
        self._capture_owed = False

    async def _with_streams_parked(self, fn, on_done=None, *, locked: bool = False) -> Any:
        """Run ``fn`` in a thread while every stream of the device is parked at a FIFO point
        (:meth:`Stream.hold`: work submitted later waits there; work launched before it has
        drained). One at a time (``locked``: the caller holds the control lock already). A
        cancelled call lets ``fn`` end before the streams move on, then re-raises; ``on_done``
        runs whenever ``fn`` completed without error, cancelled or not. The worker's exit
        while the streams are not parked yet ends the call with WorkerClosedError (issue 34,
        item 11: the exit's shutdown drops a queued park, so the wait never ended and the hold
        already reached on another stream kept its thread parked: the exit hung)."""
        if not locked:
            async with self._control_lock(getattr(fn, "__name__", "a control call")):
                return await self._with_streams_parked(fn, on_done, locked=True)
        loop = asyncio.get_running_loop()
        holds = [s.hold("parked") for s in list(self.engine.device.streams.values())]
        self._active_holds = holds
        job: asyncio.Future | None = None
        try:
            await self._or_closed(_all_reached(loop, holds), "waiting for the streams to park")
            job = loop.run_in_executor(None, fn)
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            while job is not None and not job.done():
                try:
                    await asyncio.wait([job])
                except asyncio.CancelledError:   # cancelled again: fn still must end first
                    continue
            raise
        finally:
            self._active_holds = []
            for h in holds:
                h.release()
            if on_done is not None and job is not None and job.done() and not job.cancelled() \
                    and job.exception() is None:
                on_done()

    async def release_kv_cache(self) -> int:
        """Drop the cached KV that no turn in flight holds (idle trajectories keep their tokens
        and recompute on their next turn: correct either way). Returns the number of blocks freed."""
        self._check_open()
        return self.engine.kv.drop_cached()

    async def resume_kv_cache(self) -> None:
        """The KV pool stays allocated: the next turns simply fill it again."""
        self._check_open()


async def _outcome(coro) -> tuple[bool, Any]:
    try:
        return True, await coro
    except Exception as exc:          # noqa: BLE001 - handed to the caller
        return False, exc


def _all_reached(loop: asyncio.AbstractEventLoop, holds: list) -> asyncio.Future:
    """A loop future resolved once every hold is reached (cancelling it leaves the holds alone)."""
    fut = loop.create_future()
    left = [len(holds)]

    def one(_f) -> None:
        left[0] -= 1
        if left[0] == 0 and not fut.done():
            fut.set_result(None)

    if not holds:
        fut.set_result(None)
    def from_thread(f) -> None:
        try:
            loop.call_soon_threadsafe(one, f)
        except RuntimeError:          # the loop is closed (the worker's exit gave up on this park)
            pass

    for h in holds:
        h.reached.add_done_callback(from_thread)
    return fut
