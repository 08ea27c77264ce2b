"""The verl server's device-memory control calls (sleep, wake_up, release / resume of the KV
pool): verl's meaning of each (:mod:`.residency_plan`) applied to rank 0's worker and every
follower rank together (lockstep ranks must agree on what is on the device: a P epoch needs
every rank's experts). A mixin of :class:`~.server.AInferPDServer` (its Ray actor methods)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from . import residency_plan


class ResidencyControl:
    async def _all_ranks(self, op: str, *args: Any, **kw: Any) -> None:
        """``op`` on rank 0's worker and every follower together (lockstep ranks must agree on
        what is on the device: a P epoch needs every rank's experts)."""
        jobs = [getattr(self.worker, op)(*args, **kw)]
        if self.ranks is not None:
            jobs.append(self.ranks.call(op, *args, **kw))
        for res in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(res, BaseException):
                raise res

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        want = residency_plan.wake_tags(self.rollout_mode, tags, node_rank=self.node_rank)
        if want is None or self.worker is None:
            return
        t0 = time.monotonic()
        await self._all_ranks("wake_up", want)
        self.stats["wake_ups"] += 1
        self.stats["wake_ms_sum"] += int((time.monotonic() - t0) * 1000)

    async def sleep(self) -> None:
        """verl's ``sleep()``: level 2 (weights dropped) in hybrid mode, 1 colocated, nothing
        standalone or without ``free_cache_engine`` (:func:`.residency_plan.sleep_plan`); nothing
        with ``rollout.enable_sleep_mode=False``."""
        if not self.sleep_mode:
            return
        plan = residency_plan.sleep_plan(self.rollout_mode, free_cache_engine=self.free_cache_engine,
                                         node_rank=self.node_rank, level=self.engine_kwargs.get("sleep_level"),
                                         keep_weights=self.engine_kwargs.get("sleep_keep_weights"))
        if plan is None or self.worker is None:
            return
        await self.wait_for_requests_to_drain()
        t0 = time.monotonic()
        await self._all_ranks("sleep", plan.level, keep_weights=plan.keep_weights)
        self.stats["sleeps"] += 1
        self.stats[f"sleeps_level{plan.level}"] += 1
        self.stats["sleep_ms_sum"] += int((time.monotonic() - t0) * 1000)

    async def release_kv_cache(self) -> None:
        """Before a checkpoint-engine sync that writes into the weights in place: free the KV pool
        (``sleep(1)``) when verl frees cache memory here, else drop the cached blocks."""
        if self.worker is None:
            return
        if residency_plan.frees_kv_pool(self.rollout_mode, free_cache_engine=self.free_cache_engine,
                                        node_rank=self.node_rank):
            await self.wait_for_requests_to_drain()
            await self._all_ranks("sleep", 1)
        else:
            await self.worker.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        if self.worker is None:
            return
        if residency_plan.frees_kv_pool(self.rollout_mode, free_cache_engine=self.free_cache_engine,
                                        node_rank=self.node_rank):
            await self._all_ranks("wake_up", ["kv_cache"])
        else:
            await self.worker.resume_kv_cache()
