"""``RolloutReplica`` for ainfer-pd: one :class:`~.server.AInferPDServer` Ray actor per replica.

Registered as ``RolloutReplicaRegistry.register("ainfer_pd", ...)`` by :mod:`.register`;
verl picks it with ``actor_rollout_ref.rollout.name=ainfer_pd``.

* hybrid (``init_hybrid``): the server actor is placed on the node of the replica's first
  trainer worker and sees the workers' GPUs (``CUDA_VISIBLE_DEVICES``), like verl's vLLM
  replica; it holds no Ray GPU resource itself (the trainer workers do).
* standalone (``init_standalone``): verl's own GPU resource pool, then the same launch;
  with ``device.device: cpu`` in the ainfer-pd config no GPU pool is made.
* :meth:`AInferPDReplica.init_local`: no placement at all (CPU tests, one-host debugging).

The ainfer-pd config comes from ``rollout.engine_kwargs.ainfer_pd`` (see
:data:`.settings.ENGINE_KWARGS`); the model from verl's ``actor_rollout_ref.model.path`` when
that is a Hugging Face directory (its ``config.json`` and safetensors: the trainer's model, whose
weight syncs then arrive in its own names). The server hosts rank 0's :class:`RolloutWorker`; with
``parallel.world_size`` g > 1 it starts ranks 1..g-1 as its own child processes, one per GPU it
sees (:mod:`.ranks`). g should equal verl's ``tensor_model_parallel_size * data_parallel_size *
pipeline_model_parallel_size`` (GPUs per replica), which is checked with a warning.
"""
from __future__ import annotations

import asyncio
import logging

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .server import AInferPDServer
from .settings import build_worker_config, engine_kwargs_of, model_path_of

logger = logging.getLogger(__name__)


class AInferPDReplica(RolloutReplica):
    def __init__(self, replica_rank, config, model_config, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        self.server_class = ray.remote(AInferPDServer)
        self.model_path = model_path_of(model_config)      # actor_rollout_ref.model.path (local copy)
        self.worker_config = build_worker_config(engine_kwargs_of(self.config), self.model_path, self.config)
        g = self.worker_config.parallel.world_size
        if g != self.world_size:
            logger.warning("ainfer_pd: parallel.world_size=%d but verl allots %d GPUs per replica "
                           "(tensor_model_parallel_size * data_parallel_size * pipeline_model_parallel_size)",
                           g, self.world_size)

    @property
    def on_cpu(self) -> bool:
        return self.worker_config.device.device == "cpu"

    def rollout_worker_use_gpu(self) -> bool:
        return not self.on_cpu

    async def init_standalone(self):
        if self.on_cpu:
            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()
            return
        await super().init_standalone()

    async def init_local(self, mode: RolloutMode = RolloutMode.HYBRID):
        """Launch the server in the current Ray cluster without placement groups."""
        self.rollout_mode = mode
        self.workers = []
        await self.launch_servers()

    def _actor_name(self, node_rank: int = 0) -> str:
        kind = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        return f"ainfer_pd_server_{kind}{self.replica_rank}_{node_rank}{self.name_suffix}"

    async def launch_servers(self):
        options: dict = {"name": self._actor_name(0), "max_concurrency": self.max_concurrency, "num_cpus": 0}
        env: dict = {}
        if self.workers:
            infos = await asyncio.gather(*[
                w.__ray_call__.remote(lambda self: (
                    ray.get_runtime_context().get_node_id(),
                    ",".join(str(x) for x in ray.get_runtime_context().get_accelerator_ids().get("GPU", []))))
                for w in self.workers[: self.world_size]])
            node_id = infos[0][0]
            devices = ",".join(i[1] for i in infos if i[1])
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False)
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = devices
                env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if env:
            options["runtime_env"] = {"env_vars": env}
        server = self.server_class.options(**options).remote(
            config=self.config, replica_rank=self.replica_rank, node_rank=0,
            rollout_mode=self.rollout_mode.value if self.rollout_mode else "standalone", model_path=self.model_path)
        await server.launch_server.remote()
        address = await server.get_advertised_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = address or f"ainfer_pd://{self._actor_name(0)}"

    async def sleep(self):
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    async def abort_all_requests(self, reject_request: bool = False, reset_prefix_cache: bool = True):
        """verl's partial-rollout abort on every server (:meth:`.server.AInferPDServer.abort_all_requests`:
        every admitted request, then the cached KV dropped unless ``reset_prefix_cache=False``)."""
        results = await asyncio.gather(*[s.abort_all_requests.remote(reject_request=reject_request,
                                                                     reset_prefix_cache=reset_prefix_cache)
                                         for s in self.servers])
        ids = [rid for r in results for rid in r.get("request_ids", [])]
        return {"aborted_count": len(ids), "request_ids": ids, "server_results": results}

    async def abort_request(self, request_id: str):
        results = await asyncio.gather(*[s.abort_request.remote(request_id) for s in self.servers])
        return next((r for r in results if r.get("aborted")), results[0] if results else {"aborted": False})

    async def shutdown(self):
        await asyncio.gather(*[s.shutdown.remote() for s in self.servers])
