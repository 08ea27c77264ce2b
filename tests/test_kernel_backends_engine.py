"""The whole worker on the Triton backends (paged attention + fused MoE; CPU interpreter) gives
the greedy tokens and logprobs of the torch reference path, over multi-turn trajectories with
KV reuse, mixed batches (mixed-chunked) and segmented P (fine-grained)."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _run(cfg):
    outs = {}
    async with RolloutWorker(cfg) as w:
        async def conv(i):
            rng = random.Random(i)
            o = await w.generate(rand_ids(rng, 20 + 13 * i), SamplingParams(max_new_tokens=4, **GREEDY))
            o2 = await w.continue_(o.trajectory_id, rand_ids(rng, 7), SamplingParams(max_new_tokens=4, **GREEDY))
            outs[i] = (o.token_ids, o2.token_ids, o.logprobs + o2.logprobs, o2.num_cached_tokens)
            await w.release(o.trajectory_id)
        async with asyncio.TaskGroup() as tg:
            for i in range(2):
                tg.create_task(conv(i))
        assert w.kv_leak_free()
    return outs


@pytest.mark.parametrize("policy", ["fine-grained", "mixed-chunked"])
async def test_triton_backends_match_reference(policy):
    base = {"scheduler.policy": policy, "model.num_layers": 2, "cache.num_blocks": 256}
    ref = await _run(tiny_cfg(**base, **{"device.attention_backend": "torch", "device.moe_backend": "torch"}))
    tri = await _run(tiny_cfg(**base, **{"device.attention_backend": "triton", "device.moe_backend": "triton"}))
    for i in ref:
        assert tri[i][:2] == ref[i][:2]
        assert tri[i][3] == ref[i][3] > 0                      # the continuation reused its KV
        assert tri[i][2] == pytest.approx(ref[i][2], abs=1e-4)
