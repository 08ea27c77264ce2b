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

Aborts and the admission gate: :mod:`.admission`.
Sleep / wake follow verl's rollout mode (:mod:`.control`, :mod:`.residency_plan`); with
``parallel.world_size > 1`` this process is rank 0 of the replica's ranks (:mod:`.ranks`).
Configuration: :mod:`.settings`; weight sync: :mod:`.weight_staging`.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from typing import Any, Optional

from ...errors import (DuplicateRequestError, InvalidRequestError, TrajectoryBusyError,
                       UnknownTrajectoryError)
from .admission import RequestAdmission
from .control import ResidencyControl
from .observability import Observability
from .reuse import TrajectoryReuse
from .sampling import to_sampling_params
from .settings import (ENGINE_KWARGS, build_worker_config, default_config_path, engine_kwargs_of,  # noqa: F401
                       import_worker_class, model_path_of, rollout_notes)
from .weight_staging import WeightSync

logger = logging.getLogger(__name__)


#: The keys of every ``TokenOutput.extra_fields`` this server returns, whatever the path.
EXTRA_FIELDS = ("global_steps", "num_cached_tokens", "num_prompt_tokens", "ainfer_pd_trajectory_id", "ttft_s",
                "latency_s")


def _routed(out: Any) -> Any:
    """``TurnOutput.routed_experts`` as verl's ``TokenOutput`` carries it (vLLM / SGLang servers: a
    numpy array ``[tokens, layers, top_k]`` over the whole sequence; verl's agent loop casts it to
    int16 and its partial-rollout merge keeps the last ``len(token_ids)`` rows of a resumed turn)."""
    re = getattr(out, "routed_experts", None)
    return None if re is None else re.numpy()


class AInferPDServer(ResidencyControl, WeightSync, TrajectoryReuse, RequestAdmission):
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
        self.sleep_mode = self._get("enable_sleep_mode", True) is not False
        for note in rollout_notes(config, self.worker_config):      # verl keys not applied as asked: said once
            logger.warning("ainfer_pd: %s", note)
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
        # request bookkeeping, by verl's request_id: every request from arrival to return (a second
        # one with the same id is refused), the admitted ones (past the gate: what abort_all_requests
        # aborts and the drain waits for) with their trajectory id, and the admitted ones marked
        # aborted before their turn reached the worker (they return "aborted" without running)
        self._requests: set[str] = set()
        self._inflight: dict[str, str] = {}          # admitted request_id -> trajectory id
        self._abort_marked: set[str] = set()
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
                self.ranks.on_failure(lambda err: worker.engine.book.fail_all(err))
                self.stats["rank_start_ms"] = int(self.ranks.started_s * 1000)
            else:
                worker = cls(self.worker_config)
                await worker.__aenter__()
            self.worker = worker
            if self.engine_kwargs.get("http", False):
                from .http_api import start_http
                self._http, self._port, self._http_task = await start_http(self, self._host)
            await self.obs.start_metrics()

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
        """``(host, port)`` of the HTTP generation endpoint (port 0 when ``http`` is off)."""
        return self._host, self._port

    def get_advertised_address(self) -> Optional[str]:
        """What the replica gives verl as its ``server_address``: with verl's Prometheus on, the
        ``/metrics`` endpoint (verl writes the replicas' addresses into Prometheus as scrape
        targets); else the HTTP endpoint when ``http``; else None (the replica names the actor)."""
        from .observability import prometheus_enabled
        if prometheus_enabled(self.config) and self.obs.metrics_address is not None:
            return "%s:%d" % self.obs.metrics_address
        if self._port:
            return f"{self._host}:{self._port}"
        return None

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
                logger.warning("ainfer_pd: sampling_params key %r has no effect in this token-in/token-out backend", k)
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
        """verl's server ``generate``: token ids in, :class:`TokenOutput` out. Two requests in flight
        with one ``request_id``: the second raises :class:`DuplicateRequestError`.

        ``ainfer_pd_trajectory_id`` names the client's trajectory (``ainfer_pd_tool_agent``: one per
        episode): the turn runs under that name. With ``ainfer_pd_continue``, ``prompt_ids`` are
        only the new tokens after the context the server holds for it; a trajectory not retained
        here raises :class:`UnknownTrajectoryError` (the client then sends the whole context)."""
        if image_data or video_data or audio_data:
            raise InvalidRequestError("ainfer-pd serves text-only MoE models: image/video/audio data is not supported")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight on this server: "
                                        "each request in flight needs its own id")
        self._requests.add(request_id)
        try:
            return await self._generate(prompt_ids, sampling_params, request_id, session_id,
                                        ainfer_pd_trajectory_id, ainfer_pd_continue)
        finally:
            self._requests.discard(request_id)

    async def _generate(self, prompt_ids, sampling_params, request_id: str, session_id: Optional[str],
                        ainfer_pd_trajectory_id: Optional[str], ainfer_pd_continue: bool):
        from verl.workers.rollout.replica import TokenOutput

        prompt_ids = await self._prepared(prompt_ids)
        # every TokenOutput carries the same extra_fields keys (EXTRA_FIELDS; None where a path has no
        # value): verl's agent loops copy them into their outputs, and DataProto.concat of the batches
        # of several AgentLoopWorkers needs one key set
        extra: dict[str, Any] = dict.fromkeys(EXTRA_FIELDS)
        extra.update(global_steps=self.global_steps, num_cached_tokens=0)

        def aborted() -> "TokenOutput":
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=dict(extra))

        while self._paused:
            if self._rejecting:
                return aborted()
            await self._resume.wait()

        named = ainfer_pd_trajectory_id
        tid, obs, full = self._reuse_path(prompt_ids, session_id, named, ainfer_pd_continue)
        self.stats["request_tokens"] += len(prompt_ids)
        sp = self._map(sampling_params, len(full))
        if self.routing_replay:
            sp = dataclasses.replace(sp, return_routed_experts=True)

        # Admitted: no await since the gate was passed, so abort_all_requests sees every request
        # that is past it. A new trajectory gets its id here, so abort_request can abort it (and
        # keep its partial output).
        fresh = named or f"verl-{uuid.uuid4().hex[:16]}"
        self._busy.add(tid or fresh)
        self._inflight[request_id] = tid or fresh
        prior_ctx = self._contexts.get(tid) if tid else None
        try:
            out = await self._run_turn(request_id, tid, full, sp, fresh)
        except asyncio.CancelledError:
            return aborted()
        finally:
            self._inflight.pop(request_id, None)
            self._abort_marked.discard(request_id)
            self._busy.discard(tid or fresh)
        if out is None:                       # aborted before its turn reached the worker: nothing produced
            self.stats["aborted"] += 1
            return aborted()
        log_probs = list(out.logprobs) if sp.logprobs and out.logprobs is not None else None
        if out.finish_reason == "abort":
            return await self._partial_output(out, log_probs, full, obs, prior_ctx, extra)
        return await self._completed_output(out, log_probs, full, session_id, extra)

    async def _prepared(self, prompt_ids) -> list[int]:
        """Start the worker on first use and check the ranks; the prompt as a list of ints."""
        if self.worker is None:
            await self.launch_server()
        if self.ranks is not None:
            self.ranks.check()                    # a dead rank: its typed error, not a hang
        return [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]

    def _reuse_path(self, prompt_ids: list[int], session_id: Optional[str], named: Optional[str],
                    cont: bool) -> tuple[Optional[str], Optional[list[int]], list[int]]:
        """Choose the KV-reuse path: ``(trajectory to reuse or None, the new observation of a
        continued turn or None, the whole context)``."""
        tid: Optional[str] = None
        obs: Optional[list[int]] = None
        if named is not None and (not isinstance(named, str) or not named):
            raise InvalidRequestError(f"ainfer_pd_trajectory_id must be a non-empty string, got {named!r}")
        if named is not None and named in self._busy:
            raise TrajectoryBusyError(f"trajectory {named} already has a turn in flight")
        if cont:
            if named not in self._contexts:
                # Context unknown here (released, cleared, other replica): the client re-sends it all.
                raise UnknownTrajectoryError(f"trajectory {named!r} is not retained on this server: "
                                             "send the whole context")
            tid, obs = named, prompt_ids
            full = self._contexts[tid] + obs
        else:
            full = prompt_ids
            # a trajectory the client named (its episode) is used under that name (its KV when retained;
            # prefix blocks are shared by content either way); else the best retained match
            if named is not None:
                tid = named if named in self._contexts else None
            else:
                tid = self._find_reuse(full, session_id)
        return tid, obs, full

    async def _partial_output(self, out: Any, log_probs: Optional[list], full: list[int],
                              obs: Optional[list[int]], prior_ctx: Optional[list[int]], extra: dict):
        """The ``TokenOutput`` of a turn aborted while it ran (a partial rollout)."""
        from verl.workers.rollout.replica import TokenOutput

        new_tid = out.trajectory_id
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

    async def _completed_output(self, out: Any, log_probs: Optional[list], full: list[int],
                                session_id: Optional[str], extra: dict):
        """The ``TokenOutput`` of a completed turn; its context is retained for the next one."""
        from verl.workers.rollout.replica import TokenOutput

        new_tid = out.trajectory_id
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

    async def _run_turn(self, request_id: str, tid, full, sp, fresh: str):
        """The worker's turn, or None when the request was aborted before it reached the worker."""
        # NOTE: a continued turn runs as generate(full context, trajectory_id): the worker keeps the
        # longest prefix it holds (after an aborted turn its context already has the observation
        # and the partial tokens, which the resubmission sends again).
        # NOTE: the abort mark is read right before each worker.generate, which submits the turn
        # before it first suspends: an abort either sees the turn in the worker or marked it here.
        if tid is not None:
            if request_id in self._abort_marked:
                return None
            try:
                return await self.worker.generate(full, sp, trajectory_id=tid)
            except UnknownTrajectoryError:
                self.stats["reuse_lost"] += 1
                self._contexts.pop(tid, None)
        if request_id in self._abort_marked:
            return None
        return await self.worker.generate(full, sp, trajectory_id=fresh)

    # ------------------------------------------------------------------ control plane
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
