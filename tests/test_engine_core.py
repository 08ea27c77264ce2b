"""Engine core: KV reuse equals recompute, concurrency, cancellation, no leaks."""
import asyncio
import dataclasses
import random

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
from ainfer_pd.engine.model.model import build_model
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def recompute_greedy(model, cfg, context: list[int], n: int) -> tuple[list[int], list[float]]:
    """Reference: no cache reuse at all; every token recomputes the whole sequence."""
    mc = cfg.model
    toks, lps = [], []
    seq = list(context)
    for _ in range(n):
        T = len(seq)
        kv = torch.zeros(mc.num_layers, 2, T, mc.num_kv_heads, mc.head_dim)
        slots = torch.arange(T)
        fb = ForwardBatch(torch.tensor(seq), torch.arange(T), slots, [PrefillSeq(0, T, T, slots)], None,
                          torch.tensor([T - 1]))
        with torch.inference_mode():
            logits = model.forward_batch(fb, kv)
        lp = torch.log_softmax(logits[0], -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        seq.append(t)
    return toks, lps


async def test_multi_turn_kv_reuse_matches_full_recompute(worker, cfg):
    model = build_model(cfg.model)
    rng = random.Random(0)
    for traj in range(3):
        out = await worker.generate(rand_ids(rng, 40 + 17 * traj), SamplingParams(max_new_tokens=6, **GREEDY))
        context = None
        for turn in range(3):
            if turn:
                obs = rand_ids(rng, 9 + turn)
                retained = len(context) - 1          # the last sampled token has no KV yet
                out = await worker.continue_(out.trajectory_id, obs, SamplingParams(max_new_tokens=6, **GREEDY))
                assert out.num_cached_tokens == retained
                context = context + obs
            else:
                assert out.num_cached_tokens == 0
                context = worker.trajectories[out.trajectory_id].tokens[:out.num_prompt_tokens]
            assert out.num_prompt_tokens == len(context)
            ref, ref_lp = recompute_greedy(model, cfg, context, 6)
            assert out.token_ids == ref
            assert out.logprobs == pytest.approx(ref_lp, abs=1e-4)
            context = context + out.token_ids


async def test_generate_with_full_context_reuses_the_retained_prefix(worker, cfg):
    model = build_model(cfg.model)
    rng = random.Random(1)
    p = rand_ids(rng, 50)
    a = await worker.generate(p, SamplingParams(max_new_tokens=5, **GREEDY))
    obs = rand_ids(rng, 7)
    full = p + a.token_ids + obs
    b = await worker.generate(full, SamplingParams(max_new_tokens=5, **GREEDY), trajectory_id=a.trajectory_id)
    # a new trajectory (a new request id) with the same context shares the cached KV too (issue 15)
    fresh = await worker.generate(full, SamplingParams(max_new_tokens=5, **GREEDY))
    assert b.num_cached_tokens == len(p) + len(a.token_ids) - 1
    assert fresh.num_cached_tokens == len(full) - 1
    assert b.token_ids == fresh.token_ids == recompute_greedy(model, cfg, full, 5)[0]


async def test_a_diverging_context_truncates_the_reused_prefix(worker, cfg):
    model = build_model(cfg.model)
    rng = random.Random(2)
    p = rand_ids(rng, 64)
    a = await worker.generate(p, SamplingParams(max_new_tokens=4, **GREEDY))
    edited = p[:20] + rand_ids(rng, 30)
    b = await worker.generate(edited, SamplingParams(max_new_tokens=4, **GREEDY), trajectory_id=a.trajectory_id)
    assert b.num_cached_tokens == 20
    assert b.token_ids == recompute_greedy(model, cfg, edited, 4)[0]


async def test_sixty_four_trajectories_with_tool_waits_complete_and_match_solo_runs():
    cfg = tiny_cfg(**{"scheduler.max_decode_batch": 32, "scheduler.max_prefill_tokens": 512})
    plans = []
    for i in range(64):
        rng = random.Random(100 + i)
        plans.append([(rand_ids(rng, rng.randrange(8, 80)), rng.randrange(2, 10), rng.random() * 0.02)
                      for _ in range(3)])

    async def run_traj(w, plan):
        outs = []
        prompt, n, _ = plan[0]
        o = await w.generate(prompt, SamplingParams(max_new_tokens=n, **GREEDY))
        outs.append(o.token_ids)
        for obs, n, wait in plan[1:]:
            await asyncio.sleep(wait)
            o = await w.continue_(o.trajectory_id, obs, SamplingParams(max_new_tokens=n, **GREEDY))
            outs.append(o.token_ids)
        await w.release(o.trajectory_id)
        return outs

    async with RolloutWorker(cfg) as w:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(run_traj(w, p)) for p in plans]
        together = [t.result() for t in tasks]
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == cfg.cache.num_blocks
        solo = [await run_traj(w, p) for p in plans[:8]]
    assert together[:8] == solo


async def test_cancelling_the_awaiting_task_aborts_only_that_request(worker):
    rng = random.Random(3)
    other = asyncio.create_task(worker.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=40, **GREEDY)))
    victim = asyncio.create_task(worker.generate(rand_ids(rng, 300), SamplingParams(max_new_tokens=200, **GREEDY)))
    await asyncio.sleep(0.05)
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    res = await other
    assert res.finish_reason == "length" and len(res.token_ids) == 40
    for _ in range(200):
        if all(t.turn is None for t in worker.trajectories.values()):
            break
        await asyncio.sleep(0.01)
    assert worker.metrics()["aborted"] == 1


async def test_abort_returns_finish_reason_abort_and_frees_the_turn(worker):
    rng = random.Random(4)
    task = asyncio.create_task(worker.generate(rand_ids(rng, 50), SamplingParams(max_new_tokens=300, **GREEDY),
                                               trajectory_id="t-abort"))
    await asyncio.sleep(0.05)
    assert await worker.abort("t-abort")
    out = await task
    # partial rollout (issue 15): the tokens produced before the abort come back with it
    assert out.finish_reason == "abort" and len(out.token_ids) == len(out.logprobs) < 300
    again = await worker.generate(rand_ids(rng, 10), SamplingParams(max_new_tokens=3, **GREEDY), trajectory_id="t-abort")
    assert again.finish_reason == "length"


async def test_lru_eviction_recomputes_and_gives_the_same_tokens():
    cfg = tiny_cfg(**{"cache.num_blocks": 24})          # 384 tokens of KV: forces eviction
    rng = random.Random(5)
    prompts = [rand_ids(rng, 100) for _ in range(4)]
    async with RolloutWorker(cfg) as w:
        firsts = [await w.generate(p, SamplingParams(max_new_tokens=4, **GREEDY)) for p in prompts]
        assert w.engine.kv.num_evictions > 0
        obs = rand_ids(rng, 5)
        cont = await w.continue_(firsts[0].trajectory_id, obs, SamplingParams(max_new_tokens=4, **GREEDY))
        # its blocks were the least recently used: the tail was evicted first, the rest recomputed
        assert cont.num_cached_tokens < len(prompts[0]) + 3 and cont.num_cached_tokens % 16 == 0
        ref = await w.generate(prompts[0] + firsts[0].token_ids + obs, SamplingParams(max_new_tokens=4, **GREEDY))
        assert cont.token_ids == ref.token_ids
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 24


async def test_update_weights_changes_outputs_and_rejects_bad_tensors(worker, cfg):
    from ainfer_pd.errors import WeightUpdateError
    rng = random.Random(6)
    p = rand_ids(rng, 20)
    before = await worker.generate(p, SamplingParams(max_new_tokens=8, **GREEDY))
    new = build_model(dataclasses.replace(cfg.model, seed=123))
    with pytest.raises(WeightUpdateError):
        await worker.update_weights([("layers.0.wo", torch.zeros(3, 3))])
    with pytest.raises(WeightUpdateError):
        await worker.update_weights([("nope", torch.zeros(3))])
    same = await worker.generate(p, SamplingParams(max_new_tokens=8, **GREEDY))
    assert same.token_ids == before.token_ids          # a rejected update leaves weights intact
    await worker.update_weights(new.named_parameters())
    after = await worker.generate(p, SamplingParams(max_new_tokens=8, **GREEDY))
    ref = recompute_greedy(new, cfg, p, 8)[0]
    assert after.token_ids == ref != before.token_ids


async def test_seeded_sampling_is_reproducible_and_batch_independent(worker):
    rng = random.Random(7)
    p = rand_ids(rng, 30)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=42, ignore_eos=True)
    a = await worker.generate(p, sp)
    noise = [asyncio.create_task(worker.generate(rand_ids(rng, 40), SamplingParams(max_new_tokens=10, temperature=1.0)))
             for _ in range(5)]
    b = await worker.generate(p, sp)
    await asyncio.gather(*noise)
    assert a.token_ids == b.token_ids
    assert all(lp <= 0 for lp in a.logprobs)


async def test_stop_tokens_end_the_turn(worker):
    rng = random.Random(8)
    p = rand_ids(rng, 30)
    a = await worker.generate(p, SamplingParams(max_new_tokens=10, **GREEDY))
    stop = a.token_ids[3]
    b = await worker.generate(p, SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
    assert b.finish_reason == "stop"
    assert b.token_ids == a.token_ids[:a.token_ids.index(stop) + 1]


async def test_release_kv_cache_frees_idle_kv_and_the_next_turn_recomputes(worker):
    rng = random.Random(9)
    a = await worker.generate(rand_ids(rng, 60), SamplingParams(max_new_tokens=4, **GREEDY))
    freed = await worker.release_kv_cache()
    assert freed > 0 and worker.engine.kv.num_free_blocks == worker.engine.kv.alloc.num_blocks
    await worker.resume_kv_cache()
    obs = rand_ids(rng, 5)
    b = await worker.continue_(a.trajectory_id, obs, SamplingParams(max_new_tokens=4, **GREEDY))
    assert b.num_cached_tokens == 0
    ref = await worker.generate(worker.trajectories[a.trajectory_id].tokens[:b.num_prompt_tokens],
                                SamplingParams(max_new_tokens=4, **GREEDY))
    assert b.token_ids == ref.token_ids


async def test_waiting_turns_never_hold_the_cache_hostage():
    # 8 retained trajectories fill the cache exactly; then all 8 continue at once, each needing more
    # blocks than are free. Idle prefixes of waiting turns must stay evictable, or nothing is admitted.
    cfg = tiny_cfg(**{"cache.num_blocks": 40})
    rng = random.Random(11)
    async with RolloutWorker(cfg) as w:
        firsts = [await w.generate(rand_ids(rng, 70), SamplingParams(max_new_tokens=4, **GREEDY)) for _ in range(8)]
        assert w.engine.kv.alloc.num_free == 0 and w.engine.kv.num_cached_blocks == 40   # all cached, none held
        conts = await asyncio.wait_for(asyncio.gather(*[
            w.continue_(o.trajectory_id, rand_ids(rng, 20), SamplingParams(max_new_tokens=4, **GREEDY)) for o in firsts]),
            timeout=60)
        assert all(len(c.token_ids) == 4 for c in conts)
        assert any(c.num_cached_tokens < 73 for c in conts)       # some prefixes were (partly) evicted and recomputed
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 40


def test_the_model_segments_pass_every_safe_boundary_once_in_order():
    model = build_model(tiny_cfg(**{"model.num_layers": 3}).model)
    segs = model.segments
    assert [s.label for s in segs] == ["embed", "attn0", "experts0", "attn1", "experts1", "attn2", "experts2", "head"]
    assert [s.boundary for s in segs if s.boundary is not None] == list(range(model.num_boundaries))
    # the expert notification points (odd) come right before each layer's experts
    assert [(s.kind, s.layer) for s in segs if s.boundary and s.boundary % 2] == [("experts", i) for i in range(3)]


@pytest.mark.parametrize("policy", ["normal", "fine-grained"])
async def test_a_p_epoch_runs_the_model_segments_in_order_on_the_p_stream(policy):
    cfg = tiny_cfg(**{"scheduler.policy": policy})
    async with RolloutWorker(cfg) as w:
        out = await w.generate(rand_ids(random.Random(1), 50), SamplingParams(max_new_tokens=2, **GREEDY))
        await w.release(out.trajectory_id)
        p_items = [name for (name, stream, _, _, _) in w.recorder.intervals if stream == "P"]
        labels = ["P." + s.label for s in w.engine.runner.model.segments]
        # one epoch: items in segment order, each named for its first segment (segments passed back
        # to back share an item: p_walk.COALESCE_MAX); the embed alone first, the head alone last
        assert p_items[0] == labels[0] and p_items[-1] == labels[-1] and len(p_items) < len(labels)
        at = [labels.index(n) for n in p_items]
        assert at == sorted(set(at)), p_items
        assert w.metrics()["num_epochs"] == 1
