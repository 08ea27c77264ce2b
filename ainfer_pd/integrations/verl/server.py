"""The ainfer-pd rollout server: one Ray actor per replica, hosting a :class:`RolloutWorker`.

verl's ``LLMServerClient`` calls :meth:`AInferPDServer.generate` through Ray (token in,
token out); ``RolloutReplica`` fans the control methods out to it (``wake_up``,
``sleep``, ``abort_all_requests``, ``resume_generation``, ``clear_kv_cache``,
``release_kv_cache``, ``resume_kv_cache``, ``set_global_steps``, ...); the
``BaseRollout`` adapter (:mod:`.rollout`) streams weights into it.

KV reuse across turns (``ainfer_pd_continue``, ``session_id``, prefix match) and the bound on
retained trajectories: :mod:`.reuse`.

No socket is opened unless ``http: true`` in the engine kwargs (then a small token-in/token-out
HTTP endpoint binds to ``127.0.0.1``, ``host`` overrides it: :mod:`.http_api`) or a
``metrics_port`` is set (Prometheus text at ``/metrics``: :mod:`.observability`).

Sleep / wake follow verl's rollout mode (:mod:`.control`, :mod:`.residency_plan`); with
``parallel.world_size > 1`` this process is rank 0 of the replica's ranks (:mod:`.ranks`).
Configuration: :mod:`.settings`; weight sync: :mod:`.weight_staging`.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from typing import Any, Optional

from ...errors import (InvalidRequestError, TrajectoryBusyError,
                       UnknownTrajectoryError)
from .control import ResidencyControl
from .observability import Observability
from .reuse import TrajectoryReuse
from .sampling import to_sampling_params
from .settings import (ENGINE_KWARGS, build_worker_config, default_config_path, engine_kwargs_of,  # noqa: F401
                       import_worker_class, model_path_of)
from .weight_staging import WeightSync

logger = logging.getLogger(__name__)


def _routed(out: Any) -> Any:
    """``TurnOutput.routed_experts`` as verl's ``TokenOutput`` carries it (vLLM / SGLang servers: a
    numpy array ``[tokens, layers, top_k]`` over the whole sequence; verl's agent loop casts it to
    int16 and its partial-rollout merge keeps the last ``len(token_ids)`` rows of a resumed turn)."""
    re = getattr(out, "routed_experts", None)
    return None if re is None else re.numpy()


class AInferPDServer(ResidencyControl, WeightSync, TrajectoryReuse):
    """Plain class; the replica wraps it with ``ray.remote``. One asyncio loop (Ray's)."""

    def __init__(self, config: Any, replica_rank: int = 0, node_rank: int = 0,
                 rollout_mode: str = "standalone", cuda_visible_devices: Optional[str] = None,
                 model_path: Optional[str] = None) -> None:
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.rollout_mode = str(getattr(rollout_mode, "value", rollout_mode))
        self.config = config
        self.engine_kwargs = engine_kwargs_of(config)
        self.model_path = model_path
        self.worker_config = build_worker_config(self.engine_kwargs, model_path, config)
        self._get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) \
            else (lambda k, d=None: getattr(config, k, d))
        self.free_cache_engine = bool(self._get("free_cache_engine", True))
        # routing replay (verl's R3): the worker keeps every token's expert ids, every turn returns them
        self.routing_replay = bool(self._get("enable_rollout_routing_replay", False))
        if self.routing_replay:
            self.worker_config = self.worker_config.replace(**{"cache.routed_experts": True})
        self.max_retained = int(self.engine_kwargs.get("max_retained_trajectories", 4096))
        self.cast_weight_dtype = bool(self.engine_kwargs.get("cast_weight_dtype", True))
        self.worker = None
        self.ranks = None                             # ReplicaRanks of a multi-rank replica
        self.global_steps: Optional[int] = None
        # KV-reuse bookkeeping (token contexts are cheap host lists)
        self._contexts: "collections.OrderedDict[str, list[int]]" = collections.OrderedDict()
        self._sessions: dict[str, str] = {}
        self._busy: set[str] = set()
        self._inflight: dict[str, str] = {}          # verl request_id -> trajectory id (or "")
        self._inflight_tasks: dict[str, asyncio.Task] = {}
        # admission gate (abort_all_requests / resume_generation)
        self._paused = False
        self._rejecting = False
        self._resume = asyncio.Event()
        self._resume.set()
        self._staged: Optional[list] = None
        self._warned_keys: set[str] = set()
        self._http = None
        self._http_task: Optional[asyncio.Task] = None
        self._host = str(self.engine_kwargs.get("host", "127.0.0.1"))
        self._port = 0
        self.stats = collections.Counter()
        self.obs = Observability(self)
        self._launch_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle
    async def launch_server(self, *args, **kwargs) -> None:
        async with self._launch_lock:
            if self.worker is not None:
                return
            cls = import_worker_class(self.engine_kwargs.get("worker_cls") or "ainfer_pd.RolloutWorker")
            if self.worker_config.parallel.world_size > 1:
                from .ranks import ReplicaRanks
                self.ranks, worker = await ReplicaRanks.start(
                    self.worker_config, lambda: cls(self.worker_config),
                    timeout_s=float(self.engine_kwargs.get("rank_timeout_s", 300.0)))
                self.ranks.on_failure(lambda err: worker.engine.fail_all(err))
                self.stats["rank_start_ms"] = int(self.ranks.started_s * 1000)
            else:
                worker = cls(self.worker_config)
                await worker.__aenter__()
            self.worker = worker
            if self.engine_kwargs.get("http", False):
                from .http_api import start_http
                self._http, self._port, self._http_task = await start_http(self, self._host)
            await self.obs.start_metrics(self._host)

    async def shutdown(self) -> None:
        await self.obs.close()
        if self._http is not None:
            self._http.should_exit = True
            await self._http_task
            self._http = None
        if self.worker is not None:
            w, self.worker = self.worker, None
            if self.ranks is not None:
                await self.ranks.close(w)
            else:
                await w.__aexit__(None, None, None)

    def get_server_address(self) -> tuple[str, int]:
        return self._host, self._port

    def get_metrics_address(self) -> Optional[tuple[str, int]]:
        """``(host, port)`` of the Prometheus endpoint, None when it is off."""
        return self.obs.metrics_address

    def get_worker_config(self) -> dict:
        return self.worker_config.to_dict()

    def get_rank_pids(self) -> dict[int, int]:
        """Process ids of the replica's follower ranks (rank 0 is this process)."""
        return self.ranks.pids if self.ranks is not None else {}

    # ------------------------------------------------------------------ generate
    def _ctx_len(self) -> int:
        return int(self.worker_config.model.max_context_len)

    def _map(self, sampling_params: dict, prompt_len: int):
        mapped = to_sampling_params(
            sampling_params, prompt_len=prompt_len, max_context_len=self._ctx_len(),
            response_length=self._get("response_length", None), prompt_length=self._get("prompt_length", None),
            default_repetition_penalty=float(self._get("repetition_penalty", 1.0) or 1.0),
            default_ignore_eos=bool(self._get("ignore_eos", False)))
        for k in mapped.ignored + mapped.unknown:
            if k not in self._warned_keys:
                self._warned_keys.add(k)
                logger.info("ainfer_pd: sampling_params key %r is ignored by this backend", k)
        return mapped.params
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        audio_data: Optional[list[Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        priority: int = 0,
        session_id: Optional[str] = None,
        ainfer_pd_trajectory_id: Optional[str] = None,
        ainfer_pd_continue: bool = False,
        **kwargs: Any,
    ):
        """verl's server ``generate``: token ids in, :class:`TokenOutput` out."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise InvalidRequestError("ainfer-pd serves text-only MoE models: image/video/audio data is not supported")
        if self.worker is None:
            await self.launch_server()
        if self.ranks is not None:
            self.ranks.check()                    # a dead rank: its typed error, not a hang
        prompt_ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        extra: dict[str, Any] = {"global_steps": self.global_steps}

        def aborted(**more) -> "TokenOutput":
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                               extra_fields={**extra, "num_cached_tokens": 0, **more})

        while self._paused:
            if self._rejecting:
                return aborted()
            await self._resume.wait()

        # ---- choose the KV-reuse path
        tid: Optional[str] = None
        obs: Optional[list[int]] = None
        if ainfer_pd_continue:
            if ainfer_pd_trajectory_id not in self._contexts:
                # Context unknown here (released, cleared, other replica): the client re-sends it all.
                return aborted(ainfer_pd_resend_full=True)
            if ainfer_pd_trajectory_id in self._busy:
                raise TrajectoryBusyError(f"trajectory {ainfer_pd_trajectory_id} already has a turn in flight")
            tid, obs = ainfer_pd_trajectory_id, prompt_ids
            full = self._contexts[tid] + obs
        else:
            full = prompt_ids
            tid = self._find_reuse(full, session_id)
        sp = self._map(sampling_params, len(full))
        if self.routing_replay:
            sp = dataclasses.replace(sp, return_routed_experts=True)

        # a new trajectory gets its id here, so abort_request can abort it (and keep its partial output)
        fresh = f"verl-{uuid.uuid4().hex[:16]}"
        self._busy.add(tid or fresh)
        self._inflight[request_id] = tid or fresh
        prior_ctx = self._contexts.get(tid) if tid else None
        try:
            task = asyncio.ensure_future(self._run_turn(tid, full, sp, fresh))
            self._inflight_tasks[request_id] = task
            out = await task
        except asyncio.CancelledError:
            return aborted()
        finally:
            self._inflight.pop(request_id, None)
            self._inflight_tasks.pop(request_id, None)
            self._busy.discard(tid or fresh)

        new_tid = out.trajectory_id
        log_probs = list(out.logprobs) if sp.logprobs and out.logprobs is not None else None
        if out.finish_reason == "abort":
            # Partial rollout: the worker returned the tokens produced so far and keeps their KV
            # (the trajectory's context is now ``full`` + those tokens). verl's fully-async client
            # resends the request with the partial tokens appended (a continued episode: the new
            # observation + the partial tokens, relative to the context before this turn), so the
            # context recorded here is a prefix of that resubmission and the next turn reuses
            # everything (worker.generate(..., trajectory_id) keeps the longest common prefix).
            self.stats["aborted"] += 1
            self.stats["partial_tokens"] += len(out.token_ids)
            self._contexts[new_tid] = prior_ctx if (obs is not None and prior_ctx is not None) else full
            self._contexts.move_to_end(new_tid)
            await self._evict()
            extra.update(num_cached_tokens=int(out.num_cached_tokens), num_prompt_tokens=int(out.num_prompt_tokens),
                         ainfer_pd_trajectory_id=new_tid)
            return TokenOutput(token_ids=list(out.token_ids), log_probs=log_probs, stop_reason="aborted",
                               routed_experts=_routed(out), num_preempted=0, extra_fields=extra)
        self._contexts[new_tid] = full + list(out.token_ids)
        self._contexts.move_to_end(new_tid)
        if session_id is not None:
            self._sessions[session_id] = new_tid
        await self._evict()
        self.stats["turns"] += 1
        self.stats["output_tokens"] += len(out.token_ids)
        self.stats["cached_tokens"] += out.num_cached_tokens
        extra.update(num_cached_tokens=int(out.num_cached_tokens), num_prompt_tokens=int(out.num_prompt_tokens),
                     ainfer_pd_trajectory_id=new_tid, ttft_s=float(out.ttft_s), latency_s=float(out.latency_s))
        return TokenOutput(
            token_ids=list(out.token_ids),
            log_probs=log_probs,
            routed_experts=_routed(out),
            stop_reason="completed",
            num_preempted=0,
            extra_fields=extra,
        )

    async def _run_turn(self, tid, full, sp, fresh: str):
        # NOTE: a continued turn runs as generate(full context, trajectory_id): the worker keeps the
        # longest prefix it holds (after an aborted turn its context already has the observation
        # and the partial tokens, which the resubmission sends again).
        if tid is not None:
            try:
                return await self.worker.generate(full, sp, trajectory_id=tid)
            except UnknownTrajectoryError:
                self.stats["reuse_lost"] += 1
                self._contexts.pop(tid, None)
        return await self.worker.generate(full, sp, trajectory_id=fresh)
    async def abort_request(self, request_id: str, reset_prefix_cache: bool = False) -> dict[str, Any]:
        if request_id not in self._inflight:
            return {"aborted": False, "request_id": request_id, "error": "request not found"}
        tid = self._inflight[request_id]
        try:
            # the turn ends "aborted" with its partial output (kept for a resubmission)
            await self.worker.abort(tid)
        except UnknownTrajectoryError:      # not submitted to the worker yet: nothing produced
            task = self._inflight_tasks.get(request_id)
            if task is not None:
                task.cancel()
        return {"aborted": True, "request_id": request_id}

    # ------------------------------------------------------------------ control plane
    async def abort_all_requests(self, reset_prefix_cache: bool = False, reject_request: bool = False) -> dict[str, Any]:
        """Close admission and abort every in-flight turn (``stop_reason="aborted"``).

        Unlike vLLM, idle retained trajectories are kept unless ``reset_prefix_cache``:
        verl calls :meth:`clear_kv_cache` after any weight update anyway.
        """
        self._paused = True
        self._rejecting = reject_request
        self._resume.clear()
        request_ids = list(self._inflight)
        abort_all = getattr(self.worker, "abort_all", None)
        if abort_all is not None:
            await abort_all()
        else:
            # Fallback until the worker has abort_all(): abort each in-flight trajectory.
            for rid in request_ids:
                await self.abort_request(rid)
        await self.wait_for_requests_to_drain()
        if reset_prefix_cache:
            await self.clear_kv_cache()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def resume_generation(self) -> None:
        self._paused = False
        self._rejecting = False
        self._resume.set()

    async def wait_for_requests_to_drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def start_profile(self, **kwargs) -> str:
        """A ``torch.profiler`` session on every rank (:mod:`.profiling`); returns the trace directory."""
        return await self.obs.start_profile(**kwargs)

    async def stop_profile(self) -> list[str]:
        """Ends the session; the trace files written (rank order)."""
        return await self.obs.stop_profile()

    def metrics(self) -> dict:
        m = dict(self.worker.metrics()) if self.worker is not None else {}
        m["server"] = dict(self.stats, retained=len(self._contexts), inflight=len(self._inflight))
        return m

    async def metrics_text(self) -> str:
        """Every rank's metrics and the server's counters in the Prometheus text format."""
        return await self.obs.collect()
