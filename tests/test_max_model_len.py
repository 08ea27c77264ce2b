"""Issue 34, item 3: the max model length is ``model.max_context_len`` (vLLM's ``max_model_len``;
verl's ``rollout.max_model_len`` maps onto it). As vLLM: a prompt of max_context_len tokens or
more is refused with ContextLengthError; otherwise the turn is served and generation stops at the
limit (prompt + generated <= max_context_len, finish_reason "length"), its KV reserved for no more."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.errors import AInferPDError, ContextLengthError
from ainfer_pd.hf.export import config_json
from ainfer_pd.request import fit_context
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _bounded(aw, s: float = 60.0):
    return await asyncio.wait_for(aw, s)


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "mixed-chunked"])
async def test_generation_stops_at_the_max_model_length_and_longer_prompts_are_refused(policy):
    cfg = tiny_cfg(**{"model.max_context_len": 40, "scheduler.policy": policy})
    rng = random.Random(0)
    async with RolloutWorker(cfg) as w:
        prompt = rand_ids(rng, 30)
        out = await _bounded(w.generate(prompt, SamplingParams(max_new_tokens=32, **GREEDY), trajectory_id="A"))
        # the case: a 30-token prompt under a limit of 40 gets 10 tokens, not 32
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        assert out.token_ids == recompute_greedy(w.model, cfg, prompt, 10)[0]
        # the trajectory is at the limit: its next turn is refused, the trajectory kept
        with pytest.raises(ContextLengthError, match="max model length 40"):
            await w.continue_("A", [5], SamplingParams(max_new_tokens=1))
        assert w.trajectories["A"].tokens == prompt + out.token_ids
        # the other case: a 50-token prompt is refused, and so is one of exactly 40
        for n in (50, 40):
            with pytest.raises(ContextLengthError) as ei:
                await w.generate(rand_ids(rng, n), SamplingParams(max_new_tokens=1))
            assert isinstance(ei.value, AInferPDError)
        one = await _bounded(w.generate(rand_ids(rng, 39), SamplingParams(max_new_tokens=8, **GREEDY)))
        assert one.finish_reason == "length" and len(one.token_ids) == 1
        # under the limit nothing changes
        short = await _bounded(w.generate(rand_ids(rng, 10), SamplingParams(max_new_tokens=5, **GREEDY)))
        assert short.finish_reason == "length" and len(short.token_ids) == 5
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


async def test_the_cap_reserves_kv_for_the_capped_turn_only():
    """A turn capped at the limit reserves the blocks of prompt + its capped output: a pool of 3
    blocks (48 tokens) serves a 30-token prompt with max_new_tokens 1000 under a limit of 40."""
    cfg = tiny_cfg(**{"model.max_context_len": 40, "cache.num_blocks": 3})
    async with RolloutWorker(cfg) as w:
        out = await _bounded(w.generate(rand_ids(random.Random(1), 30), SamplingParams(max_new_tokens=1000, **GREEDY)))
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        await w.release(out.trajectory_id)
        assert w.kv_leak_free()


def test_fit_context_is_vllms_rule():
    p = SamplingParams(max_new_tokens=32)
    assert fit_context(p, 30, 40).max_new_tokens == 10
    assert fit_context(p, 5, 40) is p
    assert fit_context(p, 39, 40).max_new_tokens == 1
    for n in (40, 41):
        with pytest.raises(ContextLengthError):
            fit_context(p, n, 40)


def test_a_hugging_face_directorys_limit_is_overridden_beside_its_path(tmp_path):
    """max_position_embeddings gives the default; model.max_context_len beside model.path (YAML, or
    verl's rollout.max_model_len) lowers it."""
    (tmp_path / "config.json").write_text(json.dumps(config_json(tiny_cfg().model)))
    assert WorkerConfig.from_pretrained(tmp_path).model.max_context_len == 4096
    assert WorkerConfig.from_pretrained(tmp_path, {"model": {"max_context_len": 40}}).model.max_context_len == 40
