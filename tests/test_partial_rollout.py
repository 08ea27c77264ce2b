"""Partial rollout (issue 15): an aborted turn returns what it produced and keeps its KV; a
later ``continue_(tid, [])`` or a resubmission of prompt + partial tokens resumes from there
without recomputing it, and the result equals an uninterrupted greedy run."""
from __future__ import annotations

import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.model.model import build_model
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
N = 24


async def _until(pred, what: str, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not pred():
            await asyncio.sleep(0.001)


async def _abort_after(w, tid: str, prompt: list[int], k: int):
    """Start a long greedy turn of ``tid`` and abort it once it produced at least ``k`` tokens."""
    task = asyncio.ensure_future(w.generate(prompt, SamplingParams(max_new_tokens=N, **GREEDY), trajectory_id=tid))
    await _until(lambda: tid in w.trajectories and w.trajectories[tid].turn is not None
                 and len(w.trajectories[tid].turn.out_tokens) >= k, f"{k} tokens of {tid}")
    assert await w.abort(tid) is True
    return await asyncio.wait_for(task, 20)


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "mixed-chunked"])
async def test_an_aborted_turn_returns_its_tokens_and_continue_resumes_without_recompute(policy):
    cfg = tiny_cfg(**{"scheduler.policy": policy})
    model = build_model(cfg.model)
    prompt = rand_ids(random.Random(3), 37)
    full, full_lps = recompute_greedy(model, cfg, prompt, N)
    async with RolloutWorker(cfg) as w:
        part = await _abort_after(w, "A", prompt, 5)
        k = len(part.token_ids)
        assert part.finish_reason == "abort" and 5 <= k < N
        assert part.token_ids == full[:k]
        assert part.logprobs == pytest.approx(full_lps[:k], abs=1e-4)
        assert w.trajectories["A"].tokens == prompt + part.token_ids
        await _until(lambda: w.trajectories["A"].draining is None, "the drain")
        rest = await w.continue_("A", [], SamplingParams(max_new_tokens=N - k, **GREEDY))
        assert rest.finish_reason == "length"
        assert part.token_ids + rest.token_ids == full            # equals the uninterrupted run
        # only the last token is fed again: nothing of the partial turn is recomputed
        assert rest.num_cached_tokens == len(prompt) + k - 1
        await w.release("A")
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


async def test_resubmitting_prompt_plus_partial_tokens_resumes_as_the_fully_async_client_does():
    cfg = tiny_cfg()
    model = build_model(cfg.model)
    prompt = rand_ids(random.Random(4), 50)
    full, _ = recompute_greedy(model, cfg, prompt, N)
    async with RolloutWorker(cfg) as w:
        part = await _abort_after(w, "B", prompt, 3)
        k = len(part.token_ids)
        await _until(lambda: w.trajectories["B"].draining is None, "the drain")
        rest = await w.generate(prompt + part.token_ids, SamplingParams(max_new_tokens=N - k, **GREEDY),
                                trajectory_id="B")
        assert part.token_ids + rest.token_ids == full
        assert rest.num_cached_tokens == len(prompt) + k - 1
        await w.release("B")
        assert w.kv_leak_free()


async def test_an_abort_before_the_first_token_keeps_the_prompt_and_a_cancel_keeps_the_old_context():
    cfg = tiny_cfg()
    model = build_model(cfg.model)
    rng = random.Random(5)
    async with RolloutWorker(cfg) as w:
        first = await w.generate(rand_ids(rng, 20), SamplingParams(max_new_tokens=3, **GREEDY), trajectory_id="C")
        before = list(w.trajectories["C"].tokens)
        # abort while the turn is still queued / in prefill: no tokens, the context is committed
        obs = rand_ids(rng, 30)
        holds = [w.engine.prefill_ctx.stream.hold("test")]
        try:
            task = asyncio.ensure_future(w.continue_("C", obs, SamplingParams(max_new_tokens=4, **GREEDY)))
            await _until(lambda: w.trajectories["C"].turn is not None, "submitted")
            await w.abort("C")
            out = await asyncio.wait_for(task, 20)
        finally:
            for h in holds:
                h.release()
        assert out.finish_reason == "abort" and out.token_ids == [] and out.logprobs == []
        assert w.trajectories["C"].tokens == before + obs
        await _until(lambda: w.trajectories["C"].draining is None, "the drain")
        nxt = await w.continue_("C", [], SamplingParams(max_new_tokens=4, **GREEDY))
        assert nxt.token_ids == recompute_greedy(model, cfg, before + obs, 4)[0]
        # a cancelled turn: its caller never sees the tokens, so the trajectory keeps its context
        ctx = list(w.trajectories["C"].tokens)
        task = asyncio.ensure_future(w.continue_("C", [7, 8], SamplingParams(max_new_tokens=N, **GREEDY)))
        await _until(lambda: w.trajectories["C"].turn is not None and w.trajectories["C"].turn.out_tokens, "decoding")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert w.trajectories["C"].tokens == ctx
        await w.release("C")
        assert first.token_ids and w.kv_leak_free()
