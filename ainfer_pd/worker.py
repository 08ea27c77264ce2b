"""RolloutWorker: the async front end an RL trainer awaits from its agent loops.

``async with RolloutWorker(cfg) as worker`` starts the engine's loops in a TaskGroup
owned by the worker; leaving the block aborts what is in flight, stops the loops and
joins the stream threads. Every public coroutine validates its input first and raises a
typed :class:`~ainfer_pd.errors.AInferPDError` subclass without touching other
trajectories.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Iterable, Sequence

import torch

from .config import WorkerConfig
from .engine.multirank import make_engine
from .engine.sampler import make_generator
from .engine.state import Trajectory, Turn
from .engine.weights import WeightStage
from .errors import (AInferPDError, CapacityError, ContextLengthError, InvalidRequestError,
                     TrajectoryBusyError, UnknownTrajectoryError, WorkerClosedError)
from .metrics.recorder import Recorder
from .request import SamplingParams, TurnOutput

_request_ids = itertools.count(1)


class RolloutWorker:
    def __init__(self, cfg: WorkerConfig, *, rank: int = 0, rendezvous=None) -> None:
        if not isinstance(cfg, WorkerConfig):
            raise InvalidRequestError("RolloutWorker needs a WorkerConfig")
        self.cfg = cfg
        if cfg.parallel.world_size > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                rank = dist.get_rank()
        self.rank = rank
        trace = None
        if cfg.trace_dir:
            trace = f"{cfg.trace_dir}/rank{rank}.jsonl"
        self.recorder = Recorder(rank=rank, trace_path=trace)
        self.engine = make_engine(cfg, self.recorder, rank=rank, rendezvous=rendezvous)
        self.trajectories: dict[str, Trajectory] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._engine_task: asyncio.Task | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._sleeping = False
        self._weights_lock = asyncio.Lock()
        self.last_weight_sync = None
        """The :class:`~ainfer_pd.engine.weights.SyncReport` of the last applied weight sync."""

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.runner.model

    # ================================================================== lifecycle
    async def __aenter__(self) -> "RolloutWorker":
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._engine_task = self._tg.create_task(self._run_engine(), name="ainfer-engine")
        return self

    async def _run_engine(self) -> None:
        try:
            await self.engine.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:          # the engine failed: every waiter gets a typed error
            self._failure = exc
            err = exc if isinstance(exc, AInferPDError) else WorkerClosedError(f"engine failed: {exc!r}")
            self.engine.fail_all(err)
            raise

    async def __aexit__(self, et, exc, tb) -> bool | None:
        self._closed = True
        for traj in self.trajectories.values():
            if traj.turn is not None:
                self.engine.abort(traj.turn)
        close_error: BaseException | None = None
        if (self._engine_task is not None and not self._engine_task.done() and et is None
                and hasattr(self.engine, "closing")):
            # lockstep ranks leave together: keep stepping until every rank is closing and idle
            self.engine.closing = True
            try:
                async with asyncio.timeout(self.cfg.parallel.rendezvous_timeout_s * 2):
                    await asyncio.shield(self._engine_task)
            except TimeoutError:
                close_error = WorkerClosedError("peers did not close within 2x the rendezvous timeout")
            except BaseException as e:                    # a peer failed while we were closing
                close_error = _first_typed(e) or e
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()
        try:
            assert self._tg is not None
            try:
                suppressed = await self._tg.__aexit__(et, exc, tb)
            except BaseExceptionGroup as eg:
                typed = _first_typed(eg)           # surface the engine's own typed error, not a group
                if typed is not None and et is None:
                    raise typed from eg
                raise
            if close_error is not None and et is None:
                raise close_error
            return suppressed
        finally:
            await asyncio.to_thread(self.engine.shutdown)     # joins stream threads off the loop
            if self.cfg.trace_dir:
                self._dump_timeline(failed=et is not None or close_error is not None or self._failure is not None)
            self.recorder.close()

    def _dump_timeline(self, *, failed: bool) -> None:
        """Work intervals of this rank next to its control trace (``ainfer-pd timeline RUN_DIR``
        draws them; for a failed run the plot shows where each stream stopped)."""
        import json
        from pathlib import Path
        path = Path(self.cfg.trace_dir) / f"timeline_rank{self.rank}.json"
        data = {"rank": self.rank, "failed": failed, "failure": repr(self._failure) if self._failure else None,
                "intervals": [[n, s, a, b] for (n, s, a, b, _) in self.recorder.intervals]}
        path.write_text(json.dumps(data))

    def _check_open(self) -> None:
        if self._tg is None or self._closed:
            raise WorkerClosedError("worker is not running (use `async with RolloutWorker(cfg)`)")
        if self._failure is not None:
            raise WorkerClosedError(f"worker failed: {self._failure!r}")

    # ================================================================== validation
    def _check_tokens(self, ids: Sequence[int], what: str) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        try:
            ids = list(ids)
        except TypeError:
            raise InvalidRequestError(f"{what} must be a sequence of token ids") from None
        V = self.cfg.model.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"{what} contains a non-integer token {t!r}")
            if not 0 <= t < V:
                raise InvalidRequestError(f"{what} contains token id {t} outside the vocabulary [0, {V})")
        return ids

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams")
        params.validate()      # frozen, but a caller may have bypassed __post_init__
        for t in params.stop_token_ids:
            if t >= self.cfg.model.vocab_size:
                raise InvalidRequestError(f"stop token {t} outside the vocabulary")
        return params

    # ================================================================== API
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                       trajectory_id: str | None = None) -> TurnOutput:
        """Generate one turn. With ``trajectory_id`` naming a retained trajectory whose
        tokens are a prefix of ``prompt_ids``, that prefix's KV is reused."""
        self._check_open()
        ids = self._check_tokens(prompt_ids, "prompt_ids")
        if not ids:
            raise InvalidRequestError("prompt_ids is empty")
        params = self._check_params(params)
        if trajectory_id is None:
            trajectory_id = f"traj-{uuid.uuid4().hex[:12]}"
        if not isinstance(trajectory_id, str) or not trajectory_id:
            raise InvalidRequestError("trajectory_id must be a non-empty string")
        traj = self.trajectories.get(trajectory_id)
        if traj is None:
            traj = Trajectory(trajectory_id)
        return await self._run_turn(traj, ids, params, new=trajectory_id not in self.trajectories)

    async def continue_(self, trajectory_id: str, observation_ids: Sequence[int],
                        params: SamplingParams | None = None) -> TurnOutput:
        """Append ``observation_ids`` to the trajectory's context and generate; only the
        new suffix is prefilled when the trajectory's KV is retained."""
        self._check_open()
        traj = self._get(trajectory_id)
        obs = self._check_tokens(observation_ids, "observation_ids")
        params = self._check_params(params)
        if traj.turn is not None:
            raise TrajectoryBusyError(f"trajectory {trajectory_id!r} already has a turn in flight")
        if not traj.tokens and not obs:
            raise InvalidRequestError("observation_ids is empty and the trajectory has no context")
        return await self._run_turn(traj, traj.tokens + obs, params, new=False)

    async def _run_turn(self, traj: Trajectory, context: list[int], params: SamplingParams, *, new: bool) -> TurnOutput:
        if traj.turn is not None:
            raise TrajectoryBusyError(f"trajectory {traj.tid!r} already has a turn in flight")
        limit = self.cfg.model.max_context_len
        if len(context) + params.max_new_tokens > limit:
            raise ContextLengthError(f"prompt of {len(context)} tokens + max_new_tokens={params.max_new_tokens} "
                                     f"exceeds the context limit {limit}")
        kvm = self.engine.kv
        need = kvm.alloc.blocks_for(len(context) + params.max_new_tokens)
        if need > kvm.alloc.num_blocks:
            raise CapacityError(f"a turn of {len(context) + params.max_new_tokens} tokens needs {need} KV blocks; "
                                f"the cache has {kvm.alloc.num_blocks}")
        if new:
            self.trajectories[traj.tid] = traj
        if traj.draining is not None:          # an aborted turn's device work must drain before its KV is reused
            traj.turn = traj.draining
            try:
                await traj.draining.drained.wait()
            finally:
                traj.turn = None
        kv = kvm.trajectories.get(traj.tid)
        valid = kv.num_tokens if kv is not None else 0
        m = _common_prefix(traj.tokens[:valid], context)
        num_cached = min(m, len(context) - 1)
        loop = asyncio.get_running_loop()
        rid = f"req-{next(_request_ids)}"
        turn = Turn(request_id=rid, traj=traj, params=params, context=context, prev_tokens=list(traj.tokens),
                    num_cached=num_cached, prefilled=num_cached, future=loop.create_future(), t_submit=self.recorder.now(),
                    generator=make_generator(params, fallback_seed=hash((traj.tid, traj.num_turns)) & 0x7FFFFFFF))
        traj.turn = turn
        traj.num_turns += 1
        self.engine.submit(turn)
        try:
            return await asyncio.shield(turn.future)
        except asyncio.CancelledError:
            # NOTE: the caller went away: abort this request only, free its KV, re-raise.
            self.engine.abort(turn)
            raise

    def _get(self, trajectory_id: str) -> Trajectory:
        traj = self.trajectories.get(trajectory_id) if isinstance(trajectory_id, str) else None
        if traj is None:
            raise UnknownTrajectoryError(f"unknown or released trajectory {trajectory_id!r}")
        return traj

    async def abort(self, trajectory_id: str) -> bool:
        """Abort the trajectory's turn in flight (its caller gets finish_reason "abort")."""
        traj = self._get(trajectory_id)
        if traj.turn is None:
            return False
        self.engine.abort(traj.turn)
        return True

    async def abort_all(self) -> int:
        n = 0
        for traj in list(self.trajectories.values()):
            if traj.turn is not None:
                self.engine.abort(traj.turn)
                n += 1
        return n

    async def release(self, trajectory_id: str) -> None:
        """Forget the trajectory and free its KV (aborting a turn in flight first; its
        blocks are freed only after submitted device work on them has drained)."""
        traj = self._get(trajectory_id)
        turn = traj.turn
        if turn is not None:
            self.engine.abort(turn)
        if traj.draining is not None:
            await traj.draining.drained.wait()
        if traj.turn is not None:
            raise TrajectoryBusyError(f"trajectory {trajectory_id!r} got a new turn while being released")
        del self.trajectories[trajectory_id]
        self.engine.kv.release(trajectory_id)

    def find_prefix_trajectory(self, prompt_ids: Sequence[int], *, min_tokens: int | None = None) -> tuple[str, int] | None:
        """The idle retained trajectory sharing the longest KV-valid prefix with
        ``prompt_ids`` (for trainers that resend the whole context each turn)."""
        ids = list(prompt_ids)
        best: tuple[str, int] | None = None
        floor = self.cfg.cache.block_size if min_tokens is None else min_tokens
        for tid, traj in self.trajectories.items():
            if traj.turn is not None:
                continue
            kv = self.engine.kv.trajectories.get(tid)
            valid = kv.num_tokens if kv is not None else 0
            m = _common_prefix(traj.tokens[:valid], ids)
            if m >= floor and (best is None or m > best[1]):
                best = (tid, m)
        return best

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                             partial: bool = False) -> int:
        """In-place copy of (name, tensor) pairs; all-or-nothing (names, shapes, dtypes and
        finiteness are checked, and the sync must be complete, before anything is written).
        Names: the checkpoint's safetensors names, the installed transformers' ``named_parameters()``
        names and layouts (packed ``mlp.experts.gate_up_proj`` ...), or this engine's own names, in
        any order; ``named_tensors`` may be a generator over several buckets. ``partial=True``
        updates a subset. With expert parallelism this rank keeps only its own experts' tensors
        (the others are shape-checked, never read). Any floating dtype and any device
        is accepted and converted to the parameter's (e.g. a trainer's float32 master weights
        into a bf16 worker). The parameters keep their storage, so captured CUDA graphs replay
        with the new values. Returns the number of tensors written (this rank); what the sync
        did is in ``last_weight_sync``.

        Never blocks the event loop: every stream of the device is parked at a FIFO point
        (:meth:`Stream.hold`: work submitted later waits there), work launched before it is
        awaited (CUDA: a device synchronize, in the copy thread), then the checks and copies
        run in a thread. Trajectories in flight keep their place and read the new weights from
        their next stream item on (the verl server drains requests first for a clean cut). One
        update at a time. Cancelled, it lets a copy already started finish (or reject) before
        the streams move again - never half-written weights - and re-raises."""
        self._check_open()
        loop = asyncio.get_running_loop()
        async with self._weights_lock:
            holds = [s.hold("weights") for s in list(self.engine.device.streams.values())]
            copy: asyncio.Future | None = None
            try:
                await asyncio.gather(*(asyncio.wrap_future(h.reached) for h in holds))
                copy = loop.run_in_executor(None, self._apply_weights, named_tensors, partial)
                return await asyncio.shield(copy)
            except asyncio.CancelledError:
                while copy is not None and not copy.done():
                    try:
                        await asyncio.wait([copy])
                    except asyncio.CancelledError:   # cancelled again: the copy still must end first
                        continue
                raise
            finally:
                for h in holds:
                    h.release()

    def _apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> int:
        """The copy thread of :meth:`update_weights` (every stream is parked): stage and check
        the whole sync, then copy."""
        dev = self.engine.device
        stage = WeightStage(self.model, partial=partial).add_all(named_tensors)
        if dev.kind == "cuda":
            # launched kernels (graph replays, unawaited P segments) may still read the weights
            # on the P/D streams, which do not order with the stream the copies run on
            torch.cuda.synchronize(dev.torch_device)
        n = stage.apply()
        self.last_weight_sync = stage.report
        if dev.kind == "cuda":
            torch.cuda.synchronize(dev.torch_device)
        return n

    async def sleep(self) -> None:
        """Abort everything in flight and drop all retained KV (trainer takes the GPU)."""
        await self.abort_all()
        for tid in list(self.trajectories):
            traj = self.trajectories[tid]
            if traj.draining is not None:
                await traj.draining.drained.wait()
            self.engine.kv.release(tid)
            self.engine.kv.trajectories.pop(tid, None)
        self._sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Back from ``sleep``: weights and the KV pool were never freed on this engine, so
        nothing is reloaded (``tags`` as verl passes them: "weights", "kv_cache")."""
        self._sleeping = False

    async def release_kv_cache(self) -> int:
        """Drop the retained KV of every idle trajectory (they keep their tokens and recompute
        on their next turn: correct either way). Returns the number of blocks freed."""
        kvm = self.engine.kv
        freed = 0
        for tid, traj in self.trajectories.items():
            kv = kvm.trajectories.get(tid)
            if traj.turn is None and traj.draining is None and kv is not None and not kv.pinned:
                freed += len(kv.blocks)
                kvm.release(tid)
        return freed

    async def resume_kv_cache(self) -> None:
        """The KV pool stays allocated: the next turns simply fill it again."""

    def metrics(self) -> dict[str, Any]:
        m = self.engine.metrics()
        m["trajectories"] = len(self.trajectories)
        return m

    def audit(self, *, strict: bool = False):
        """The phase-ownership audit of this rank (multi-rank engines with expert parallelism)."""
        fn = getattr(self.engine, "audit", None)
        if fn is None:
            from .errors import OwnershipAuditError
            raise OwnershipAuditError("this engine has no phase-owned communication state (world size 1)")
        return fn(strict=strict)

    def metrics_text(self) -> str:
        """``metrics()`` in the Prometheus text exposition format."""
        from .metrics.export import prometheus_text
        return prometheus_text(self.metrics(), rank=self.rank)

    def timeline(self) -> list[tuple]:
        return list(self.recorder.intervals)

    def kv_leak_free(self) -> bool:
        """Block accounting is consistent (and nothing is pinned when idle)."""
        return self.engine.kv.check_no_leak()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _first_typed(exc: BaseException) -> AInferPDError | None:
    if isinstance(exc, AInferPDError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            t = _first_typed(e)
            if t is not None:
                return t
    return None
