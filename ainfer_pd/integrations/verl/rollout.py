"""``BaseRollout`` adapter for ``_ROLLOUT_REGISTRY[("ainfer_pd", "async")]``.

It lives in verl's trainer (or checkpoint-engine) worker process and drives the
replica's :class:`~.server.AInferPDServer` actor, found by its Ray name
``ainfer_pd_server_{replica_rank}_0``:

* ``resume(tags)`` -> ``server.wake_up(tags)`` (when ``free_cache_engine``)
* ``release()`` -> ``server.sleep()`` (when ``free_cache_engine``)
* ``update_weights(weights, global_steps=None, wire_format="named_tensors", **kw)``:
  verl's iterable of ``(name, tensor)``, a plain generator (``naive`` engine) or an *async*
  generator (the nccl, nixl, hccl, mooncake and kimi engines' ``receive_weights``), is copied to host memory in buckets of
  ``checkpoint_engine.update_weights_bucket_megabytes`` and *staged* on the server, which
  validates every name and shape against ``worker.model`` as it arrives; only when the
  generator is exhausted is the whole update applied (``worker.update_weights``), so a
  wrong name or shape raises :class:`~ainfer_pd.errors.WeightUpdateError` and leaves the
  old weights intact. Then retained KV is cleared and ``global_steps`` set.
  ``wire_format="delta_flush"`` is not supported (clear error).

Only the replica's rollout rank 0 talks to the server (like verl's vLLM adapter): the
other trainer ranks of the replica return at once.
"""
from __future__ import annotations

import os
from typing import Any, AsyncIterator, AsyncIterable, Iterable, Optional, Union

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from ...errors import WeightUpdateError

Weights = Union[Iterable[tuple[str, torch.Tensor]], AsyncIterable[tuple[str, torch.Tensor]]]


async def iterate_weights(weights: Weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """One pass over verl's weights, whichever way its checkpoint engine yields them: a plain
    iterable (``naive``: the trainer's generator) or an async iterable (nccl, nixl, hccl, mooncake,
    kimi: ``receive_weights`` is an async generator over received buckets). Anything else is a
    :class:`WeightUpdateError` naming its type."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    elif hasattr(weights, "__iter__") and not isinstance(weights, (str, bytes, torch.Tensor)):
        for item in weights:
            yield item
    else:
        raise WeightUpdateError(f"update_weights takes an iterable or async iterable of (name, tensor) pairs, "
                                f"got {type(weights).__name__}")


class AInferPDServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, *args, **kwargs) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._has_server = self.rollout_rank == 0
        self.server_handle: Optional[ray.actor.ActorHandle] = kwargs.get("server_handle")
        ce = getattr(self.config, "checkpoint_engine", None)
        self.bucket_bytes = int(getattr(ce, "update_weights_bucket_megabytes", 512) or 512) << 20

    def _server(self) -> Optional[ray.actor.ActorHandle]:
        if not self._has_server:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"ainfer_pd_server_{self.replica_rank}_0")
        return self.server_handle

    async def resume(self, tags: list[str]):
        server = self._server()
        if server is not None and self.config.free_cache_engine:
            await server.wake_up.remote(tags=list(tags))

    async def release(self):
        server = self._server()
        if server is not None and self.config.free_cache_engine:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Weights,
        global_steps: Optional[int] = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ):
        if wire_format != "named_tensors":
            raise WeightUpdateError(
                f"ainfer_pd rollout supports wire_format='named_tensors' only, got {wire_format!r}; "
                "use a full-tensor checkpoint engine")
        if kwargs.get("peft_config") is not None:
            raise WeightUpdateError("ainfer_pd rollout does not serve LoRA adapters: merge them (lora.merge=True)")
        server = self._server()
        if server is None:
            async for _ in iterate_weights(weights):  # keep collective generators in step with rank 0
                pass
            return
        await server.begin_weight_update.remote()
        bucket: list = []
        size = 0
        try:
            async for name, tensor in iterate_weights(weights):
                t = tensor.detach()
                if hasattr(t, "full_tensor"):  # DTensor
                    t = t.full_tensor()
                t = t.to("cpu", copy=True).contiguous()
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= self.bucket_bytes:
                    await server.stage_weights.remote(bucket)
                    bucket, size = [], 0
            if bucket:
                await server.stage_weights.remote(bucket)
        except BaseException:
            await server.abort_weight_update.remote()
            raise
        return await server.commit_weight_update.remote(global_steps)
