"""The weight sync of :class:`~ainfer_pd.worker.RolloutWorker`: ``update_weights`` and its steps
(preflight checks, staging the source, the multi-rank agreement, the copy, what a complete sync
restores).

A mixin (:class:`WeightSync`), a base of :class:`~ainfer_pd.worker_control.WorkerControl`: it runs
under WorkerControl's control lock and stream parking (``_control_lock``, ``_or_closed``,
``_or_closed_coro``, ``_with_streams_parked``, ``_recapture_graphs``) and reads the state that
:meth:`WorkerControl._init_control` sets up.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .engine.model.weights import WeightStage, is_bucket
from .errors import AInferPDError, InvalidRequestError, WeightUpdateError, WorkerAsleepError, WorkerClosedError
from .weight_transfer import StageClosed, SyncAgreement


INLINE_STAGE_BYTES = 1 << 20
"""An async sync's item up to this size is checked on the loop; larger ones in a thread."""
_END = object()


class _SyncCall:
    """One update_weights call's place in a multi-rank sync (``seq``: its sync, until decided).
    An error under the control lock fails that sync for every rank (:meth:`on_fail`)."""

    __slots__ = ("agreement", "seq")

    def __init__(self, agreement: SyncAgreement | None) -> None:
        self.agreement = agreement
        self.seq: int | None = None

    def on_fail(self, exc: BaseException) -> None:
        if self.agreement is not None and self.seq is not None:
            reason = "cancelled" if isinstance(exc, asyncio.CancelledError) else f"{type(exc).__name__}: {exc}"
            self.agreement.fail_soon(self.seq, reason)


class WeightSync:
    """The weight sync of a running worker (mixin of :class:`~ainfer_pd.worker_control.WorkerControl`)."""

    # ================================================================== weights
    async def update_weights(self, named_tensors: Any, *, partial: bool = False,
                             timeout_s: float | None = None) -> int:
        """In-place weight sync, all-or-nothing: nothing is written before the whole sync is checked (names,
        shapes, dtypes, finiteness, and completeness unless ``partial=True``); anything malformed raises
        :class:`WeightUpdateError`. Returns the number of tensors written on this rank; what the sync did is in
        ``last_weight_sync``.

        ``named_tensors`` may be any of:

        * (name, tensor) pairs: a list, a generator (e.g. ``named_parameters()``), or a ``{name: tensor}``
          mapping such as a ``state_dict()``;
        * an iterable of *buckets*, each a list / tuple of (name, tensor) pairs or a mapping;
        * an **async** iterable of pairs or of buckets (an async generator, e.g. what verl's nccl / nixl /
          mooncake / hccl / kimi checkpoint engines hand the server adapter). It is consumed bucket by bucket on
          the event loop (large items checked in a thread); each tensor is checked and *copied* (into the
          parameter's dtype and device) as it arrives, because such sources reuse a bucket's memory for the next
          one. The copies are written into the parameters only once the last bucket has arrived and been
          checked.

        A synchronous iterable is consumed in a thread (never on the loop) and its tensors are referenced, not
        copied: do not reuse a tensor's memory for another tensor of the same sync. Names: the checkpoint's
        safetensors names, the installed transformers' ``named_parameters()`` names and layouts (packed
        ``mlp.experts.gate_up_proj`` ...), or this engine's own names, in any order. With expert parallelism
        this rank keeps only its own experts' tensors (the others are shape-checked, never read). Any floating
        dtype and any device is accepted and converted to the parameter's; meta and sparse tensors are refused.
        The parameters keep their storage, so captured CUDA graphs replay with the new values.

        **Multi-rank workers** (``parallel.world_size > 1``): a sync is one collective act. Every rank must call
        ``update_weights`` with the same manifest (names, shapes, dtypes, ``partial``: a sha256 digest is
        compared over the ``torch.distributed`` store) before any rank writes; otherwise it fails, typed, on
        every rank, nothing written anywhere: :class:`WeightSyncMismatchError` (manifests differ, the first
        difference named), :class:`WeightSyncError` (a rank's own part failed: bad input, asleep, cancelled) or
        :class:`WeightSyncTimeout` after ``timeout_s`` (default ``parallel.rendezvous_timeout_s``) naming the
        ranks that never joined. A rank that calls late joins the failed sync (and raises it); its next call
        joins its peers' next sync.

        Retained KV does not survive a weight change: the idle trajectories' KV is dropped once the copy is done
        and their next turn recomputes its context; a turn in flight reads the new weights from its next stream
        item on and keeps no KV when it ends.

        Never blocks the event loop: the checks run in a thread (or, for small items of an async source, on the
        loop), then every stream of the device is parked at a FIFO point (:meth:`Stream.hold`), work launched
        before it is awaited (CUDA: a device synchronize, in the copy thread), and the copies run in a thread.
        One control call at a time (update, sleep, wake_up); a sync racing ``sleep(2)`` either runs first or
        raises :class:`WorkerAsleepError`. Cancelled before the copies, nothing is written; cancelled during
        them, they finish first (never half-written weights); then it re-raises. Leaving ``async with`` while it
        waits ends it with :class:`WorkerClosedError` (or lets it finish)."""
        self._check_open()
        return await self._sync_weights(named_tensors, partial, timeout_s)

    async def _sync_weights(self, named_tensors: Any, partial: bool, timeout_s: float | None) -> int:
        """:meth:`update_weights` after its open check: under the control lock, the preflight
        checks, the staging, the agreement of the ranks and the copy; then what a complete sync
        restores. A call cancelled after its peers agreed writes like them, then re-raises."""
        call = _SyncCall(self._sync_agreement())
        async with self._control_lock("update_weights", call.on_fail, typed=True):
            if call.agreement is not None:
                call.seq = await call.agreement.begin()   # this call's sync (raises one decided without it)
            form, timeout_s = self._sync_preflight(named_tensors, timeout_s)
            stage = await self._staged(named_tensors, partial, form)
            owed = await self._agree(call, stage, partial, timeout_s)
            n = await self._with_streams_parked(lambda: self._apply_stage(stage),
                                                on_done=self.engine.kv.invalidate, locked=True)
        await self._after_sync(partial)
        if owed:
            raise asyncio.CancelledError()      # the peers had agreed: written like them, then cancelled
        return n

    def _sync_preflight(self, named_tensors: Any, timeout_s: float | None) -> tuple[str, float]:
        """The source's form (:func:`_source_form`) and the timeout (the rendezvous timeout when
        None); the weights must be on the device (checked under the lock, issue 34, item 12)."""
        form = _source_form(named_tensors)
        if timeout_s is None:
            timeout_s = float(self.cfg.parallel.rendezvous_timeout_s)
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidRequestError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if self.engine.residency.state.weights != "device":
            raise WorkerAsleepError("the weights are off the device (sleep level 2): "
                                    "wake_up(['weights']) first")
        return form, timeout_s

    async def _staged(self, named_tensors: Any, partial: bool, form: str) -> WeightStage:
        """Every item of the source checked (and, from an async source, copied) into a stage,
        complete unless ``partial``; nothing is written yet. The worker's exit cancels it."""
        stage = WeightStage(self.model, partial=partial, copy=form == "async")
        self._active_stages.add(stage)
        try:
            if form == "async":
                await self._stage_async(stage, named_tensors)
            else:
                await self._stage_in_thread(stage, lambda: stage.add_all(named_tensors))
            stage.check_complete()
        finally:
            self._active_stages.discard(stage)
        return stage

    async def _agree(self, call: _SyncCall, stage: WeightStage, partial: bool, timeout_s: float) -> bool:
        """A multi-rank sync: every rank's manifest agreed (else it raises, typed). Returns
        whether this call was cancelled after its peers had agreed (it writes, then re-raises)."""
        if call.agreement is None:
            return False
        try:
            return await call.agreement.agree(call.seq, stage.digest(), stage.manifest(), partial, timeout_s,
                                              lambda: self._ctl_closed)
        except StageClosed:
            raise WorkerClosedError("the worker was closed while update_weights waited for its peers") from None
        finally:
            call.seq = None          # decided: the lock's exit must not fail it again

    async def _after_sync(self, partial: bool) -> None:
        """A complete sync refilled weights dropped at sleep: the decode graphs owed are
        recaptured (if the KV pool is back) and the worker is awake once both are."""
        if self._weights_stale and not partial:
            self._weights_stale = False          # a complete sync refilled the dropped weights
            if self._capture_owed and self.engine.residency.state.kv:
                await self._recapture_graphs()
            self._asleep = not self.engine.residency.state.kv

    def _sync_agreement(self) -> SyncAgreement | None:
        """The store-backed agreement of a multi-rank worker (None at world size 1)."""
        dist = self.engine.dist
        if dist is None or dist.world_size <= 1:
            return None
        topo = dist.topology
        if self._agreement is None:
            from .launch import get_store
            base = dist.watchdog.prefix          # one per engine instance, alike on every rank
            self._agreement = SyncAgreement(get_store(), f"{base}/wsync", topo.rank, topo.world_size)
        return self._agreement

    def _apply_stage(self, stage: WeightStage) -> int:
        """The copy thread of :meth:`update_weights` (every stream is parked, the sync is checked)."""
        dev = self.engine.device
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

    async def _stage_in_thread(self, stage: WeightStage, fn: Callable[[], Any]) -> Any:
        """Run a staging step in a thread. Cancelled or closed: the stage stops at its next item
        (nothing was written) and the call ends at once; an untyped error is a WeightUpdateError."""
        job = asyncio.get_running_loop().run_in_executor(None, fn)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())    # an abandoned job's error is not logged
        try:
            return await self._or_closed(job, "update_weights checked its input")
        except BaseException:
            stage.cancelled = True
            raise

    async def _stage_async(self, stage: WeightStage, source: Any) -> None:
        """Consume an async source item by item: each is checked and copied before the next is
        asked for (the source may overwrite an item's memory with the next bucket)."""
        it = aiter(source)
        while True:
            item = await self._or_closed_coro(anext(it, _END), "update_weights waited for the next bucket")
            if item is _END:
                return
            if _item_bytes(item) <= INLINE_STAGE_BYTES:
                try:
                    stage.add_item(item)
                except AInferPDError:
                    raise
                except Exception as exc:    # noqa: BLE001 - a malformed input no check names
                    raise WeightUpdateError(f"weight update rejected: {exc!r}") from exc
            else:
                await self._stage_in_thread(stage, lambda item=item: stage.add_item(item))


def _source_form(src: Any) -> str:
    """"mapping", "iterable" or "async"; anything else is a WeightUpdateError."""
    if isinstance(src, Mapping):
        return "mapping"
    if isinstance(src, (str, bytes, torch.Tensor)):
        raise WeightUpdateError(f"update_weights takes (name, tensor) pairs, buckets of them or a mapping, "
                                f"got {type(src).__name__}")
    if hasattr(src, "__aiter__"):
        return "async"
    if hasattr(src, "__iter__"):
        return "iterable"
    raise WeightUpdateError("update_weights takes (name, tensor) pairs, buckets of them, a mapping, or an async "
                            f"iterable of those, got {type(src).__name__}")


def _item_bytes(item: Any) -> int:
    """Bytes of the tensors in one item of an async sync (a pair or a bucket)."""
    pairs = item.items() if isinstance(item, Mapping) else (item if is_bucket(item) else [item])
    total = 0
    for pair in pairs:
        if isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[1], torch.Tensor):
            t = pair[1]
            total += t.numel() * t.element_size() if t.layout == torch.strided else 0
    return total
