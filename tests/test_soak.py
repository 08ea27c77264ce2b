"""Soak: hundreds of trajectories, random cancels, aborts and tool waits; nothing lost."""
import asyncio

import pytest

from ainfer_pd import RolloutWorker
from ainfer_pd.tools.soak import soak, verify_against_fresh
from tests._dist_util import run_ranks
from tests.conftest import tiny_cfg


@pytest.mark.slow
async def test_single_rank_soak_reconciles_and_every_completed_turn_matches_a_fault_free_run():
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "cache.num_blocks": 512, "mux.activation_threshold": 1})
    async with RolloutWorker(cfg) as w:
        res = await soak(w, num_trajectories=200, turns=3, seed=5, cancel_p=0.1, abort_p=0.1)
        m = w.metrics()
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 512
        assert not w.trajectories
    assert res.reconciles and res.requests >= 400
    assert res.failed == 0, res.errors[:3]
    assert res.cancelled > 0 and res.aborted > 0 and res.completed > 200
    assert m["finished"] == res.completed
    assert m["aborted"] == res.aborted + res.cancelled
    assert await verify_against_fresh(tiny_cfg(), res.outputs) == 0


async def _rank_soak(rank, world_size):
    cfg = tiny_cfg(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                      "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
                      "parallel.rendezvous_timeout_s": 60.0, "scheduler.policy": "fine-grained",
                      "cache.num_blocks": 384, "mux.activation_threshold": 1})
    async with RolloutWorker(cfg) as w:
        res = await soak(w, num_trajectories=60, turns=3, seed=100 + rank, cancel_p=0.1, abort_p=0.1)
        leak_free = w.kv_leak_free() and w.engine.kv.num_free_blocks == 384
    return res, leak_free


@pytest.mark.slow
def test_two_rank_expert_parallel_soak_reconciles_and_matches_a_fault_free_run():
    results = run_ranks(_rank_soak, 2, timeout_s=300)
    outputs = []
    for res, leak_free in results:
        assert leak_free and res.reconciles and res.failed == 0, res.errors[:3]
        assert res.cancelled + res.aborted > 0
        outputs += res.outputs
    assert asyncio.run(verify_against_fresh(tiny_cfg(), outputs)) == 0
