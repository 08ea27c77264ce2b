"""The device-memory and weight control of :class:`~ainfer_pd.worker.RolloutWorker`:
``update_weights``, ``sleep`` / ``wake_up``, ``release_kv_cache`` / ``resume_kv_cache``.

A mixin of the worker (its public coroutines): each runs its device work in a thread while
every stream of the device is parked (:meth:`WorkerControl._with_streams_parked`), never on
the event loop. Its state (asleep, weights stale, graphs owed) is set up by
:meth:`WorkerControl._init_control`.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Iterable

import torch

from .engine.weights import WeightStage
from .errors import AInferPDError, InvalidRequestError, WeightUpdateError


class WorkerControl:
    """Weights, sleep / wake and KV-pool control of a running worker (mixin)."""

    def _init_control(self) -> None:
        self._sleeping = False
        self._asleep = False             # device memory given back (sleep level >= 1)
        self._weights_stale = False      # weights dropped at sleep and not yet synced
        self._capture_owed = False       # decode graphs to recapture after the next complete sync
        self._weights_lock = asyncio.Lock()
        self.last_weight_sync = None
        """The :class:`~ainfer_pd.engine.weights.SyncReport` of the last applied weight sync."""

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                             partial: bool = False) -> int:
        """In-place copy of (name, tensor) pairs (or a ``{name: tensor}`` mapping such as a
        ``state_dict()``); all-or-nothing (names, shapes, dtypes and finiteness are checked, and
        the sync must be complete, before anything is written; anything malformed raises
        WeightUpdateError). Names: the checkpoint's safetensors names, the installed transformers'
        ``named_parameters()`` names and layouts (packed ``mlp.experts.gate_up_proj`` ...), or this
        engine's own names, in any order; ``named_tensors`` may be a generator over several buckets.
        ``partial=True`` updates a subset. With expert parallelism this rank keeps only its own
        experts' tensors (the others are shape-checked, never read). Any floating dtype and any
        device is accepted and converted to the parameter's (e.g. a trainer's float32 master
        weights into a bf16 worker); meta and sparse tensors are refused. The parameters keep their
        storage, so captured CUDA graphs replay with the new values. Returns the number of tensors
        written (this rank); what the sync did is in ``last_weight_sync``.

        Retained KV does not survive a weight change (it was computed with the old weights):
        the idle trajectories' KV is dropped once the copy is done and their next turn
        recomputes its context; a turn in flight reads the new weights from its next stream
        item on (a mix of both: the verl server drains requests first for a clean cut) and
        keeps no KV when it ends.

        Never blocks the event loop: every stream of the device is parked at a FIFO point
        (:meth:`Stream.hold`: work submitted later waits there), work launched before it is
        awaited (CUDA: a device synchronize, in the copy thread), then the checks and copies
        run in a thread. One update at a time. Cancelled, it lets a copy already started
        finish (or reject) before the streams move again - never half-written weights - and
        re-raises."""
        self._check_open()
        if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not hasattr(named_tensors, "__iter__"):
            raise WeightUpdateError("update_weights takes (name, tensor) pairs or a mapping, "
                                    f"got {type(named_tensors).__name__}")
        if self.engine.residency.state.weights != "device":
            from .errors import WorkerAsleepError
            raise WorkerAsleepError("the weights are off the device (sleep level 2): wake_up(['weights']) first")
        n = await self._with_streams_parked(lambda: self._apply_weights(named_tensors, partial),
                                            on_done=self.engine.kv.invalidate)  # written: old KV is stale
        if self._weights_stale and not partial:
            self._weights_stale = False          # a complete sync refilled the dropped weights
            if self._capture_owed and self.engine.residency.state.kv:
                await self._recapture_graphs()
            self._asleep = not self.engine.residency.state.kv
        return n

    def _apply_weights(self, named_tensors: Any, partial: bool = False) -> int:
        """The copy thread of :meth:`update_weights` (every stream is parked). A lazy iterable
        (verl's generator) is consumed here, off the loop: the whole sync is staged and checked
        before anything is copied."""
        dev = self.engine.device
        try:
            stage = WeightStage(self.model, partial=partial).add_all(named_tensors)
        except AInferPDError:
            raise
        except Exception as exc:       # a malformed input no check names: nothing was written
            raise WeightUpdateError(f"weight update rejected: {exc!r}") from exc
        if dev.kind == "cuda":
            # launched kernels (graph replays, unawaited P segments) may still read the weights
            # on the P/D streams, which do not order with the stream the copies run on
            torch.cuda.synchronize(dev.torch_device)
        try:
            n = stage.apply()
        except AInferPDError:
            raise
        except Exception as exc:       # a copy failing after every check passed: report it typed
            raise WeightUpdateError(f"weight update failed while copying: {exc!r}") from exc
        self.last_weight_sync = stage.report
        if dev.kind == "cuda":
            torch.cuda.synchronize(dev.torch_device)
        return n

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
            res = self.engine.residency

            def release() -> None:
                res.release_kv()
                if level >= 2:
                    res.release_weights(keep_weights)
            await self._with_streams_parked(release)
        self._sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Back from ``sleep``: restore what ``tags`` name ("weights", "kv_cache"; both when
        None, as verl passes them). Weights come back from pinned host memory (or, if they were
        dropped, as uninitialised storage that the next complete weight sync must fill: turns
        are refused until then); the KV pool is reallocated and the decode graphs recaptured
        once both are on the device."""
        self._check_open()
        if tags is not None and (isinstance(tags, (str, bytes)) or not all(isinstance(t, str) for t in tags)):
            raise InvalidRequestError(f"wake_up tags must be a list of strings, got {tags!r}")
        from .engine.residency import KV_CACHE, TAGS, WEIGHTS
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
        if res.state.kv and res.state.weights == "device" and (recapture["needed"] or self._capture_owed):
            if self._weights_stale:
                self._capture_owed = True        # captured after the sync: graphs bind the synced storage
            else:
                await self._recapture_graphs()
        self._asleep = not (res.state.kv and res.state.weights == "device")
        self._sleeping = self._asleep

    async def _recapture_graphs(self) -> None:
        eng = self.engine
        w = eng.decode_ctx.stream.submit(eng.runner.capture_decode_graphs, eng.decode_ctx, label="D.capture")
        await w.done()
        self._capture_owed = False

    async def _with_streams_parked(self, fn, on_done=None) -> Any:
        """Run ``fn`` in a thread while every stream of the device is parked at a FIFO point
        (:meth:`Stream.hold`: work submitted later waits there; work launched before it has
        drained). One at a time. A cancelled call lets ``fn`` end before the streams move on,
        then re-raises; ``on_done`` runs whenever ``fn`` completed without error, cancelled or not."""
        loop = asyncio.get_running_loop()
        async with self._weights_lock:
            holds = [s.hold("parked") for s in list(self.engine.device.streams.values())]
            job: asyncio.Future | None = None
            try:
                await asyncio.gather(*(asyncio.wrap_future(h.reached) for h in holds))
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
