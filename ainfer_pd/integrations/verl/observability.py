"""What the verl server shows about itself: the Prometheus endpoint and ``torch.profiler`` sessions.

* ``/metrics`` (:class:`~ainfer_pd.metrics.prometheus.MetricsEndpoint`) on
  ``engine_kwargs.ainfer_pd.metrics_port`` (0: a free port), or on a free port when verl's
  ``rollout.prometheus.enable`` (read from verl's ``RolloutConfig`` dataclass, a DictConfig or a
  dict). ``rollout.prometheus.port`` is the port of the Prometheus server itself (9090), never
  bound here. With Prometheus on, the replica advertises this endpoint as its ``server_address``:
  verl's ``update_prometheus_config`` writes the replicas' addresses as the scrape targets of job
  ``rollout`` (path ``/metrics``). It binds ``engine_kwargs.ainfer_pd.host`` when given, else the
  node's IP address (the Prometheus server scrapes it from its own node). Independent of ``http``. Every rank of
  the replica (``rank`` label; followers answer through their control pipe), and the server's own
  counters (turns, output tokens, KV reuse, aborts, retained trajectories, requests in flight).
* ``start_profile`` / ``stop_profile``: one :class:`~.profiling.TorchProfile` per rank.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from ...errors import InvalidRequestError
from ...metrics.prometheus import MetricsEndpoint, numeric_samples, render, worker_families
from .profiling import TorchProfile, profile_dir_of
from .settings import field, to_plain

logger = logging.getLogger(__name__)


def prometheus_enabled(rollout_config: Any) -> bool:
    """verl's ``rollout.prometheus.enable`` (a ``PrometheusConfig`` dataclass, a DictConfig or a dict)."""
    return bool(field(to_plain(field(rollout_config, "prometheus")), "enable", False))


def metrics_port_of(engine_kwargs: dict, rollout_config: Any) -> Optional[int]:
    """The port to serve ``/metrics`` on: ``metrics_port``, else a free one (0) when verl's Prometheus
    is on, else None (off)."""
    if engine_kwargs.get("metrics_port") is not None:
        return int(engine_kwargs["metrics_port"])
    if prometheus_enabled(rollout_config):
        return 0
    return None


def metrics_host_of(engine_kwargs: dict, rollout_config: Any) -> str:
    """``host`` when given; else, with verl's Prometheus on, this node's IP address (Prometheus scrapes
    from its own node); else 127.0.0.1."""
    if engine_kwargs.get("host"):
        return str(engine_kwargs["host"])
    if prometheus_enabled(rollout_config):
        import ray
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return "127.0.0.1"


class Observability:
    def __init__(self, server: Any) -> None:
        self.server = server
        self.endpoint: Optional[MetricsEndpoint] = None
        self.profile: Optional[TorchProfile] = None

    # ------------------------------------------------------------------ Prometheus
    async def start_metrics(self) -> None:
        s = self.server
        port = metrics_port_of(s.engine_kwargs, s.config)
        if port is None:
            return
        host = metrics_host_of(s.engine_kwargs, s.config)
        self.endpoint = MetricsEndpoint(self.collect, host=host, port=port)
        await self.endpoint.start()
        logger.info("ainfer_pd: Prometheus metrics at http://%s:%d/metrics", host, self.endpoint.port)

    @property
    def metrics_address(self) -> Optional[tuple[str, int]]:
        return (self.endpoint.host, self.endpoint.port) if self.endpoint is not None else None

    async def collect(self) -> str:
        s = self.server
        labels = {"replica": str(s.replica_rank)}
        samples = numeric_samples(dict(s.stats), "ainfer_pd_server", labels,
                                  counters=[k for k in s.stats if k != "rank_start_ms"])
        samples += numeric_samples({"retained_trajectories": len(s._contexts), "inflight_requests": len(s._inflight),
                                    "replica_ranks": s.worker_config.parallel.world_size,
                                    "rank_failed": s.ranks is not None and s.ranks.failure is not None},
                                   "ainfer_pd_server", labels)
        w = s.worker
        if w is not None:
            eng = w.engine
            samples += worker_families(w.metrics(), rank=w.rank, waiting=len(eng.book.waiting), decoding=len(eng.book.decoding))
        if s.ranks is not None and s.ranks.failure is None:
            for r, (m, waiting, decoding) in zip(sorted(s.ranks.procs), await s.ranks.call("metrics")):
                samples += worker_families(m, rank=r, waiting=waiting, decoding=decoding)
        return render(samples)

    # ------------------------------------------------------------------ torch.profiler
    async def start_profile(self, **kwargs: Any) -> str:
        s = self.server
        if self.profile is not None:
            raise InvalidRequestError("a profile is already running: stop_profile first")
        directory = kwargs.get("profile_dir") or profile_dir_of(s.engine_kwargs, s.config)
        step = kwargs.get("profile_step")
        prof = TorchProfile(directory, rank=0, tag=f"step{step}" if step is not None else None)
        await prof.start()
        self.profile = prof
        if s.ranks is not None:
            await s.ranks.call("start_profile", directory, prof.tag)
        return directory

    async def stop_profile(self) -> list[str]:
        """Stop every rank's session; the trace paths, rank order ([] when none was running: verl
        may stop a replica it did not start, as vLLM's server allows)."""
        s = self.server
        prof, self.profile = self.profile, None
        if prof is None:
            return []
        paths = [await prof.stop()]
        if s.ranks is not None:
            paths += await s.ranks.call("stop_profile")
        return paths

    async def close(self) -> None:
        if self.profile is not None:
            try:
                await self.profile.stop()
            finally:
                self.profile = None
        if self.endpoint is not None:
            ep, self.endpoint = self.endpoint, None
            await ep.close()
