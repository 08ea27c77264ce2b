"""RolloutWorker: the async front end an RL trainer awaits from its agent loops.

``async with RolloutWorker(cfg) as worker`` starts the engine's loops in a TaskGroup
owned by the worker; leaving the block aborts what is in flight, stops the loops and
joins the stream threads. Every public coroutine validates its input first and raises a
typed :class:`~ainfer_pd.errors.AInferPDError` subclass without touching other
trajectories.

A worker belongs to the event loop that entered it: a call from another loop or thread
raises :class:`~ainfer_pd.errors.WrongEventLoopError`. An exception raised by your own code
inside ``async with`` comes out unchanged (the worker's TaskGroup never wraps it); a failure
of the engine itself ends every turn in flight with a typed error and is raised, typed, when
the block is left.

The weight, sleep / wake and KV-pool control calls are :mod:`.worker_control` (a mixin of
the worker); the input checks are :mod:`.worker_input`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from typing import Any, Sequence

import torch

from .config import WorkerConfig
from .engine.block_hash import common_prefix
from .engine.make import make_engine
from .engine.sampler import sample_seed
from .engine.state import Trajectory, Turn
from .errors import (AInferPDError, first_error, CapacityError, ContextLengthError, InvalidRequestError,
                     TrajectoryBusyError, UnknownTrajectoryError, WorkerClosedError,
                     WrongEventLoopError)
from .metrics.recorder import Recorder
from .request import SamplingParams, TurnOutput
from .worker_control import WorkerControl
from .worker_input import check_params, check_tokens, token_list
from .request import fit_context

log = logging.getLogger("ainfer_pd.worker")
_request_ids = itertools.count(1)


class RolloutWorker(WorkerControl):
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._init_control()

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.runner.model

    # ================================================================== lifecycle
    async def __aenter__(self) -> "RolloutWorker":
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
        finally:
            if self._engine_task is not None and not self._engine_task.done():
                self._engine_task.cancel()                    # we were cancelled while closing
            await asyncio.to_thread(self.engine.shutdown)     # joins stream threads off the loop
            self.engine.book.close()                               # no caller or drain waiter left behind
            try:
                await self.engine.aclose()                    # the control rendezvous of a lockstep rank
            except Exception as e:                            # noqa: BLE001 - closing must not mask the exit
                log.warning("rank %d: closing the control rendezvous failed: %r", self.rank, e)
            if self.cfg.trace_dir:
                self._dump_timeline(failed=et is not None or close_error is not None or self._failure is not None)
            self.recorder.close()
        if et is not None:
            if self._failure is not None:
                log.error("rank %d: leaving on %s; the engine had failed: %r", self.rank, et.__name__, self._failure)
            return None
        if self._failure is not None:
            raise self._failure_error() from self._failure
        if close_error is not None:
            raise close_error
        return None

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

    # ================================================================== API
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                       trajectory_id: str | None = None) -> TurnOutput:
        """Generate one turn. With ``trajectory_id`` naming a retained trajectory whose
        tokens are a prefix of ``prompt_ids``, that prefix's KV is reused (a prompt that does
        not extend them replaces the trajectory's context). Token ids: see :func:`~ainfer_pd.worker_input.token_list`."""
        self._check_open()
        ids = check_tokens(prompt_ids, "prompt_ids", self.cfg.model.vocab_size)
        if not ids:
            raise InvalidRequestError("prompt_ids is empty")
        params = check_params(params, vocab_size=self.cfg.model.vocab_size,
                              routed_experts=self.cfg.cache.routed_experts)
        if trajectory_id is None:
            trajectory_id = f"traj-{uuid.uuid4().hex[:12]}"
        if not isinstance(trajectory_id, str) or not trajectory_id:
            raise InvalidRequestError("trajectory_id must be a non-empty string")
        traj = self.trajectories.get(trajectory_id)
        if traj is not None and traj.releasing:
            raise TrajectoryBusyError(f"trajectory {trajectory_id!r} is being released")
        if traj is None:
            traj = Trajectory(trajectory_id)
        return await self._run_turn(traj, ids, params, new=trajectory_id not in self.trajectories)

    async def continue_(self, trajectory_id: str, observation_ids: Sequence[int],
                        params: SamplingParams | None = None) -> TurnOutput:
        """Append ``observation_ids`` to the trajectory's context and generate; only the
        new suffix is prefilled when the trajectory's KV is retained. ``observation_ids`` may be
        empty: after an aborted turn that resumes its generation (partial rollout)."""
        self._check_open()
        traj = self._get(trajectory_id)
        obs = check_tokens(observation_ids, "observation_ids", self.cfg.model.vocab_size)
        params = check_params(params, vocab_size=self.cfg.model.vocab_size,
                              routed_experts=self.cfg.cache.routed_experts)
        if traj.turn is not None:
            raise TrajectoryBusyError(f"trajectory {trajectory_id!r} already has a turn in flight")
        if not traj.tokens and not obs:
            raise InvalidRequestError("observation_ids is empty and the trajectory has no context")
        return await self._run_turn(traj, traj.tokens + obs, params, new=False)

    async def _run_turn(self, traj: Trajectory, context: list[int], params: SamplingParams, *, new: bool) -> TurnOutput:
        # NOTE: every check first; nothing is registered or changed before they all passed, and
        # nothing awaits between the checks and the submission (no window for abort / exit).
        self.engine.check_accepts()           # a TP follower raises InvalidRequestError naming its leader
        if self._asleep or self._weights_stale:
            from .errors import WorkerAsleepError
            raise WorkerAsleepError("the worker is asleep (its KV pool or weights are off the device): "
                                    "call wake_up()" + (" and sync the weights" if self._weights_stale else ""))
        if traj.turn is not None:
            raise TrajectoryBusyError(f"trajectory {traj.tid!r} already has a turn in flight")
        # the max model length, as vLLM's max_model_len: a prompt at or over it is refused
        # (ContextLengthError), max_new_tokens is capped so prompt + generated <= it (issue 34, item 3)
        params = fit_context(params, len(context), self.cfg.model.max_context_len)
        kvm = self.engine.kv
        need = kvm.alloc.blocks_for(len(context) + params.max_new_tokens)
        if need > kvm.alloc.num_blocks:
            raise CapacityError(f"a turn of {len(context) + params.max_new_tokens} tokens needs {need} KV blocks; "
                                f"the cache has {kvm.alloc.num_blocks}")
        seed = sample_seed(params, fallback_seed=hash((traj.tid, traj.num_turns)) & 0x7FFFFFFF)
        if new:
            self.trajectories[traj.tid] = traj
        if not traj.group:                # siblings (GRPO samples of one prompt) share their first prompt
            traj.group = f"g{hash(tuple(context)) & 0xFFFFFFFFFFFF:x}"
        # an estimate (the reuse is decided at admission, from what the cache holds then)
        num_cached = kvm.cached_prefix(context, tid=traj.tid)
        loop = asyncio.get_running_loop()
        rid = f"req-{next(_request_ids)}"
        turn = Turn(request_id=rid, traj=traj, params=params, context=context, prev_tokens=list(traj.tokens),
                    num_cached=num_cached, prefilled=num_cached, future=loop.create_future(), t_submit=self.recorder.now(),
                    seed=seed)
        traj.turn = turn
        traj.num_turns += 1
        # NOTE: a trajectory whose aborted turn still drains gets this turn queued behind the
        # drain inside the engine (TurnBook.behind_drain): it is the trajectory's turn from now on.
        self.engine.submit(turn)
        try:
            return await asyncio.shield(turn.future)
        except asyncio.CancelledError:
            # NOTE: the caller went away (it never sees the partial tokens): abort this request
            # only, the trajectory keeps its context from before the turn, re-raise.
            self.engine.book.abort(turn, commit=False)
            raise

    def _get(self, trajectory_id: str, *, releasing_ok: bool = False) -> Trajectory:
        traj = self.trajectories.get(trajectory_id) if isinstance(trajectory_id, str) else None
        if traj is None or (traj.releasing and not releasing_ok):
            state = "being released" if traj is not None else "unknown or released"
            raise UnknownTrajectoryError(f"{state} trajectory {trajectory_id!r}")
        return traj

    async def abort(self, trajectory_id: str) -> bool:
        """Abort the trajectory's turn in flight, a turn still queued behind the drain of an
        earlier aborted one included. Its caller gets finish_reason "abort" with the tokens and
        logprobs produced so far (partial rollout); the trajectory's context becomes that turn's
        prompt plus those tokens, and their KV is kept: ``continue_(tid, [], params)`` resumes
        the generation without recomputing it (so does resubmitting prompt + partial tokens).
        Returns whether there was a turn."""
        self._check_open()
        traj = self._get(trajectory_id, releasing_ok=True)
        if traj.turn is None:
            return False
        self.engine.book.abort(traj.turn)
        return True

    async def abort_all(self) -> int:
        """Abort every turn in flight (queued ones included), as :meth:`abort`; returns how many."""
        self._check_open()
        n = 0
        for traj in list(self.trajectories.values()):
            if traj.turn is not None:
                self.engine.book.abort(traj.turn)
                n += 1
        return n

    async def release(self, trajectory_id: str) -> None:
        """Forget the trajectory and free its KV, aborting its turn in flight first (a turn
        queued behind the drain of an earlier aborted one included: its caller gets "abort");
        the blocks are freed only after submitted device work on them has drained. While it
        runs, the trajectory takes no new turn, and a second ``release`` of it raises
        UnknownTrajectoryError (as after it)."""
        self._check_open()
        traj = self._get(trajectory_id)
        traj.releasing = True
        try:
            while True:
                if traj.turn is not None:
                    self.engine.book.abort(traj.turn)
                if traj.draining is None:
                    break
                await traj.draining.drained.wait()
        except BaseException:
            traj.releasing = False     # cancelled while waiting: the trajectory stays as it was
            raise
        del self.trajectories[trajectory_id]
        self.engine.kv.release(trajectory_id)
        self.engine.notify()                 # blocks may have come back: admission re-checks
        self.engine.book.record_trajectory(traj.group or trajectory_id, traj.num_turns, len(traj.tokens))

    def find_prefix_trajectory(self, prompt_ids: Sequence[int], *, min_tokens: int | None = None) -> tuple[str, int] | None:
        """The idle retained trajectory sharing the longest KV-valid prefix with
        ``prompt_ids`` (for trainers that resend the whole context each turn)."""
        self._check_thread()
        ids = token_list(prompt_ids, "prompt_ids")
        best: tuple[str, int] | None = None
        floor = self.cfg.cache.block_size if min_tokens is None else min_tokens
        kvm = self.engine.kv
        cached = kvm.cached_prefix(ids, len(ids)) if kvm.sharing else None
        for tid, traj in self.trajectories.items():
            if traj.turn is not None:
                continue
            valid = cached if cached is not None else kvm.cached_prefix(ids, len(ids), tid=tid)
            m = min(common_prefix(traj.tokens, ids), valid)
            if m >= floor and (best is None or m > best[1]):
                best = (tid, m)
        return best
    def metrics(self) -> dict[str, Any]:
        self._check_thread()
        m = self.engine.metrics()
        m["trajectories"] = len(self.trajectories)
        return m

    def audit(self, *, strict: bool = False):
        """The phase-ownership audit of this rank (multi-rank engines with expert parallelism)."""
        self._check_thread()
        if self.engine.dist is None:
            from .errors import OwnershipAuditError
            raise OwnershipAuditError("this engine has no phase-owned communication state (world size 1)")
        return self.engine.dist.audit(strict=strict)

    def metrics_text(self) -> str:
        """``metrics()`` in the Prometheus text exposition format."""
        from .metrics.export import prometheus_text
        return prometheus_text(self.metrics(), rank=self.rank)

    def timeline(self) -> list[tuple]:
        self._check_thread()
        return list(self.recorder.intervals)

    def kv_leak_free(self) -> bool:
        """Block accounting is consistent (and nothing is pinned when idle)."""
        self._check_thread()
        return self.engine.kv.check_no_leak()
