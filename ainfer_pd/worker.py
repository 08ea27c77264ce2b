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

Entering and leaving ``async with`` and the checks every call starts with are
:mod:`.worker_lifecycle`; the weight, sleep / wake and KV-pool control calls are
:mod:`.worker_control` and :mod:`.worker_sync` (mixins of the worker); the input checks are
:mod:`.worker_input`.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, Sequence

import torch

from .config import WorkerConfig
from .engine.kv.block_hash import common_prefix
from .engine.make import make_engine
from .engine.model.sampler import sample_seed
from .engine.loop.state import Trajectory, Turn
from .errors import (CapacityError, ContextLengthError, InvalidRequestError, TrajectoryBusyError,
                     UnknownTrajectoryError)
from .metrics.recorder import Recorder
from .request import SamplingParams, TurnOutput
from .worker_control import WorkerControl
from .worker_input import check_params, check_tokens, token_list
from .worker_lifecycle import WorkerLifecycle, timeline_path
from .request import fit_context

_request_ids = itertools.count(1)


class RolloutWorker(WorkerLifecycle, WorkerControl):
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
            # an earlier run's intervals would be read beside this run's trace if this run never dumps its own
            timeline_path(cfg.trace_dir, rank).unlink(missing_ok=True)
        self.recorder = Recorder(rank=rank, trace_path=trace)
        try:
            self.engine = make_engine(cfg, self.recorder, rank=rank, rendezvous=rendezvous)
        except BaseException:
            self.recorder.close()     # a failed start (the engine joined its threads) keeps no trace file open
            raise
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
            traj.first_prompt = len(context)
        if not traj.group:                # siblings (GRPO samples of one prompt) share their first prompt
            traj.group = f"g{hash(tuple(context)) & 0xFFFFFFFFFFFF:x}"
        # the prompt's block hashes, once (the blocks its last prompt had keep theirs); the reuse is
        # an estimate (decided at admission, from what the cache holds then)
        hashes = kvm.prompt_hashes(context, tid=traj.tid, known=traj.block_hashes)
        traj.block_hashes = (context[:len(hashes) * kvm.block_size], hashes)
        num_cached = kvm.match(context, hashes=hashes, tid=traj.tid)[1] if context else 0
        loop = asyncio.get_running_loop()
        rid = f"req-{next(_request_ids)}"
        turn = Turn(request_id=rid, traj=traj, params=params, context=context, prev_tokens=list(traj.tokens),
                    num_cached=num_cached, prefilled=num_cached, future=loop.create_future(), t_submit=self.recorder.now(),
                    seed=seed, prompt_hashes=hashes)
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
        # its KV past the first prompt (which GRPO siblings share) is evicted before any other
        self.engine.kv.forget(traj.tokens, traj.first_prompt, tid=trajectory_id, known=traj.block_hashes)
        if self.engine.spec is not None:
            self.engine.spec.release(trajectory_id)       # its drafts and backoff go with its KV
        self.engine.notify()                 # blocks may have come back: admission re-checks
        self.engine.book.record_trajectory(traj.group or trajectory_id, traj.num_turns, len(traj.tokens))
        self.engine.book.live.released(trajectory_id)

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
