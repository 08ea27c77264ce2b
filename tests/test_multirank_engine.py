"""The lockstep multi-rank engine: expert parallelism over real gloo processes."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from tests._dist_util import run_ranks
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _plans(n: int, seed: int):
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        out.append([(rand_ids(rng, rng.randrange(8, 120)), rng.randrange(2, 12), rng.random() * 0.01)
                    for _ in range(3)])
    return out


async def _drive(worker, plans):
    async def one(plan):
        outs = []
        prompt, n, _ = plan[0]
        o = await worker.generate(prompt, SamplingParams(max_new_tokens=n, **GREEDY))
        outs.append((o.token_ids, o.num_cached_tokens))
        for obs, n, wait in plan[1:]:
            await asyncio.sleep(wait)
            o = await worker.continue_(o.trajectory_id, obs, SamplingParams(max_new_tokens=n, **GREEDY))
            outs.append((o.token_ids, o.num_cached_tokens))
        await worker.release(o.trajectory_id)
        return outs

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(p)) for p in plans]
    return [t.result() for t in tasks]


async def _rank_main(rank, world_size, policy, plans):
    cfg = tiny_cfg(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                      "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
                      "parallel.rendezvous_timeout_s": 60.0, "scheduler.policy": policy})
    mine = plans[rank::world_size]
    async with RolloutWorker(cfg) as w:
        outs = await _drive(w, mine)
        m = w.metrics()
        leak_free = w.kv_leak_free() and w.engine.kv.num_free_blocks == cfg.cache.num_blocks
    return outs, leak_free, m.get("rendezvous", 0), m["num_epochs"]


async def _single(plans, policy):
    async with RolloutWorker(tiny_cfg(**{"scheduler.policy": policy})) as w:
        return await _drive(w, plans)


@pytest.mark.parametrize("world_size,policy", [(2, "fine-grained"), (4, "fine-grained"), (2, "normal"),
                                               (2, "global-enqueue")])
def test_expert_parallel_greedy_outputs_equal_the_single_rank_run(world_size, policy):
    plans = _plans(8, seed=11)
    ref = asyncio.run(_single(plans, "normal"))
    res = run_ranks(_rank_main, world_size, policy, plans, timeout_s=240)
    got = [None] * len(plans)
    for r, (outs, leak_free, rdv, epochs) in enumerate(res):
        assert leak_free
        assert epochs > 0
        for j, o in enumerate(outs):
            got[r + j * world_size] = o
    assert [[t for t, _ in traj] for traj in got] == [[t for t, _ in traj] for traj in ref]
    assert [[c for _, c in traj] for traj in got] == [[c for _, c in traj] for traj in ref]
