"""Output blocks taken as rows decode (``cache.reserve_output: estimate``) in the crossed topology:
4 gloo ranks, attention TP2 inside each of 2 attention-DP replicas, experts over all 4. A replica's
leader grows and preempts its rows and its TP follower runs the plans it is given; a full pool's
preemptions leave every turn's tokens those of world size 1, nothing fails and nothing leaks."""
import asyncio

import pytest

from ainfer_pd import RolloutWorker
from ainfer_pd.tools.options import load_config
from ainfer_pd.tools.replay import replay
from ainfer_pd.tools.trace import make_trace
from ainfer_pd.tools.world import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("policy", ["fine-grained"])
def test_crossed_ranks_preempt_on_a_full_pool_and_give_the_single_rank_tokens(policy):
    # 36 blocks a rank (576 tokens), admission expecting 5% of a turn's budget: the replicas' 24 x 2 turns
    # (up to ~540 tokens of context) over-commit the pool and preempt
    over = ["cache.reserve_output=estimate", "cache.num_blocks=36", "cache.output_ratio_init=0.05",
            "cache.output_ratio_min=0.05", f"scheduler.policy={policy}", "parallel.ordering=selective"]
    cfg = load_config("configs/tiny-crossed-cpu.yaml", over)
    trace = make_trace(24, 2, token_scale=0.12, max_context=cfg.model.max_context_len, seed=0)
    res = run_world(cfg, trace, 4, cell="trace", seed=0, time_scale=0.05, timeout_s=240)
    assert res.errors == [] and res.failures == 0 and res.completed == res.planned_requests == trace.num_requests
    m = res.metrics
    assert m["kv_preemptions"] > 0, "the pool must be full enough to preempt"
    assert m["kv_free_blocks"] == m["kv_total_blocks"], "a block leaked"

    async def single() -> dict:
        async with RolloutWorker(load_config("configs/tiny-cpu.yaml", [f"scheduler.policy={policy}"])) as w:
            return (await replay(w, trace, cell="trace", seed=0, time_scale=0.05)).outputs
    assert res.outputs == asyncio.run(single())
