"""Output KV taken as rows decode, and preemption when the pool is full (``cache.reserve_output:
estimate``): the policy (pure), the cache's growth, and the engine's preemption, whose outputs
must equal a run that never preempts, greedy and seeded, under every policy, with no block leaked.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.errors import ConfigError, LifetimeError, UnsupportedOptionError
from ainfer_pd.sched.output_reserve import (OutputReserve, expected_tokens, growth_target, headroom_blocks,
                                            next_ratio, reserve_tokens)
from tests.conftest import rand_ids, tiny_cfg

ALL, EST = OutputReserve("all"), OutputReserve("estimate", 0.7, 0.1, 6)


# ====================================================================== the policy (pure)
def test_all_reserves_the_whole_budget_and_estimate_the_prompt_and_one_token():
    assert reserve_tokens(ALL, 100, 50) == 150
    assert reserve_tokens(EST, 100, 50) == 101
    assert reserve_tokens(EST, 100, 0) == 100
    assert expected_tokens(ALL, 100, 50, 0.1) == 150
    assert expected_tokens(EST, 100, 50, 0.5) == 125
    assert expected_tokens(EST, 100, 50, 0.001) == 101      # at least one while any is left


def test_headroom_counts_the_expected_blocks_beyond_those_held():
    rows = [(100, 64, 7), (16, 100, 1)]          # 100 + ceil(0.5 * 64) = 132 -> 9 blocks; 16 + 50 -> 5
    assert headroom_blocks(EST, rows, 0.5, 16) == (9 - 7) + (5 - 1)
    assert headroom_blocks(EST, [(100, 0, 7)], 0.5, 16) == 0
    assert headroom_blocks(ALL, rows, 0.5, 16) == 0


def test_the_ratio_decays_linearly_to_its_min_and_a_preemption_resets_it():
    r = EST.init
    seen = []
    for _ in range(10):
        r = next_ratio(EST, r, preempted=False)
        seen.append(r)
    assert seen[0] == pytest.approx(0.6) and seen[5] == pytest.approx(0.1) and seen[-1] == pytest.approx(0.1)
    assert next_ratio(EST, 0.1, preempted=True) == 0.7


def test_growth_stops_at_the_last_position_a_turn_can_write():
    assert growth_target(100, 4, 60, 200, 4096) == 104
    assert growth_target(258, 4, 60, 200, 4096) == 260      # context 60 + budget 200
    assert growth_target(4094, 4, 60, 8000, 4096) == 4096


def test_the_config_checks_its_values():
    with pytest.raises(UnsupportedOptionError):
        tiny_cfg(**{"cache.reserve_output": "lazy"})
    with pytest.raises(ConfigError):
        tiny_cfg(**{"cache.reserve_output": "estimate", "cache.output_ratio_min": 0.9})


# ====================================================================== the cache
def test_grow_takes_free_blocks_then_evicts_cached_ones_and_refuses_without_taking():
    kv = KVCacheManager(6, 4)
    a = kv.reserve("a", 8, list(range(8)))                  # 2 blocks
    kv.mark_written("a", a, 8)
    kv.finish_turn("a", a, 8, 0.0)                          # 2 cached
    life = kv.reserve("b", 5, [9, 9, 9, 9, 9])              # 2 blocks, 2 free left
    assert kv.grow("b", life, 8) and len(kv.trajectories["b"].blocks) == 2
    assert kv.grow("b", life, 16) and kv.num_evictions == 0   # the 2 free ones
    v = kv.version
    assert kv.grow("b", life, 20) and kv.num_evictions == 1 and kv.version > v
    seq = kv.trajectories["b"]
    assert list(seq.block_arr) == seq.blocks and len(seq.blocks) == 5
    assert not kv.grow("b", life, 28)                        # 2 more: only 1 left
    assert len(seq.blocks) == 5 and kv.num_free_blocks == 1
    assert kv.audit() == []
    with pytest.raises(LifetimeError):
        kv.grow("b", life + 1000, 24)


# ====================================================================== the engine
def _trajs(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [rand_ids(rng, 30 + 9 * i) for i in range(n)]


async def _run(policy: str, reserve: str, blocks: int, *, temperature: float, overlap="auto",
               abort_first_preempted: bool = False) -> tuple[dict, dict, list]:
    cfg = tiny_cfg(**{"scheduler.policy": policy, "cache.reserve_output": reserve, "cache.num_blocks": blocks,
                      "scheduler.overlap_decode": overlap})
    p = SamplingParams(max_new_tokens=56, temperature=temperature, ignore_eos=True, seed=11)
    preempted: list[str] = []
    async with RolloutWorker(cfg) as w:
        book = w.engine.book
        real = book.preempt

        def spy(t) -> None:
            real(t)
            if abort_first_preempted and not preempted:
                asyncio.get_running_loop().create_task(w.abort(t.tid))
            preempted.append(t.tid)
        book.preempt = spy

        async def traj(i: int, prompt: list[int]) -> list:
            tid = f"t{i}"
            o1 = await w.generate(prompt, p, trajectory_id=tid)
            out = [(o1.finish_reason, o1.token_ids)]
            if o1.finish_reason != "abort":
                o2 = await w.continue_(tid, [5, 6, 7, 8 + i], p)
                out.append((o2.finish_reason, o2.token_ids))
            await w.release(tid)
            return out
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(traj(i, x)) for i, x in enumerate(_trajs(8))]
        m = w.metrics()
        kv = w.engine.kv
        assert kv.audit() == [] and not kv.trajectories and kv.num_free_blocks == blocks, "a block leaked"
    return {f"t{i}": r.result() for i, r in enumerate(runs)}, m, preempted


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "mixed-chunked"])
async def test_preempted_rows_resume_with_the_outputs_of_a_run_that_never_preempts(policy):
    """Eight trajectories of two turns (up to ~250 tokens each) on 48 blocks (768 tokens): reserving
    every budget, about three run at once; growing on demand, more are admitted and a full pool
    preempts. Greedy and seeded-sampled outputs equal a run on a pool that holds everything."""
    for temp in (0.0, 1.0):
        ref, m_ref, _ = await _run(policy, "all", 1024, temperature=temp)
        got, m, pre = await _run(policy, "estimate", 48, temperature=temp)
        assert m_ref["kv_preemptions"] == 0
        assert m["kv_preemptions"] == len(pre) > 0, "the pool must be full enough to preempt"
        assert got == ref


async def test_preemption_with_and_without_the_overlapped_read_gives_the_same_tokens():
    ref, _, _ = await _run("normal", "all", 1024, temperature=1.0, overlap=False)
    got, m, _ = await _run("normal", "estimate", 48, temperature=1.0, overlap=True)
    assert m["kv_preemptions"] > 0 and got == ref


async def test_all_never_preempts_on_the_small_pool():
    ref, _, _ = await _run("normal", "all", 1024, temperature=0.0)
    got, m, pre = await _run("normal", "all", 48, temperature=0.0)
    assert m["kv_preemptions"] == 0 and not pre and got == ref


@pytest.mark.parametrize("policy", ["normal", "fine-grained"])
async def test_admission_headroom_is_computed_once_an_iteration_and_an_admission_adds_its_own_term(policy):
    """``headroom()`` walks every row once a D iteration (and after a preemption), not at every
    admission check: an admitted turn adds exactly the term a fresh walk would add for it."""
    cfg = tiny_cfg(**{"scheduler.policy": policy, "cache.reserve_output": "estimate", "cache.num_blocks": 64})
    p = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        book = w.engine.book
        walks, steps, admits = [0], [0], []
        walk, grow, admit = book._headroom_now, book.grow_rows, book.admit

        def counted_walk():
            walks[0] += 1
            return walk()

        def counted_grow(rows, extra, *, step=True):
            steps[0] += step
            return grow(rows, extra, step=step)

        def checked_admit(chunks, admitted, budget=None):
            kept, before = book.headroom(), walk()
            work = admit(chunks, admitted, budget)
            admits.append((book.headroom() - kept, walk() - before))
            return work
        book._headroom_now, book.grow_rows, book.admit = counted_walk, counted_grow, checked_admit

        async def traj(i: int, prompt: list[int]) -> None:
            o = await w.generate(prompt, p, trajectory_id=f"t{i}")
            await w.continue_(o.trajectory_id, [5, 6, 7, 8 + i], p)
            await w.release(o.trajectory_id)
        async with asyncio.TaskGroup() as tg:
            for i, x in enumerate(_trajs(8)):
                tg.create_task(traj(i, x))
        m = w.metrics()
    assert admits and all(kept == fresh for kept, fresh in admits), admits
    assert any(kept > 0 for kept, _ in admits)
    assert 0 < walks[0] <= steps[0] + m["kv_preemptions"] + 1


async def test_aborting_a_preempted_turn_returns_its_output_so_far_and_the_rest_run_on():
    ref, _, _ = await _run("fine-grained", "all", 1024, temperature=0.0)
    got, m, pre = await _run("fine-grained", "estimate", 48, temperature=0.0, abort_first_preempted=True)
    victim = pre[0]
    reason, toks = got[victim][0]
    assert reason == "abort" and 0 < len(toks) < 56 and toks == ref[victim][0][1][:len(toks)]
    assert {k: v for k, v in got.items() if k != victim} == {k: v for k, v in ref.items() if k != victim}


# ====================================================================== several ranks (gloo processes)
def _plans_long(n: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(5)
    return [(rand_ids(rng, rng.randrange(30, 90)), rand_ids(rng, 6)) for _ in range(n)]


async def _drive(w, plans) -> list[list[list[int]]]:
    p = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)

    async def one(prompt, obs):
        o = await w.generate(prompt, p)
        o2 = await w.continue_(o.trajectory_id, obs, p)
        await w.release(o.trajectory_id)
        return [o.token_ids, o2.token_ids]
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(*x)) for x in plans]
    return [t.result() for t in tasks]


async def _rank_grow(rank: int, world_size: int, plans):
    """One rank of an expert-parallel world preempting on a 40-block pool (admission over-commits: an
    expected output of 5% of the budget)."""
    cfg = tiny_cfg(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                      "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
                      "parallel.rendezvous_timeout_s": 60.0, "scheduler.policy": "fine-grained",
                      "cache.reserve_output": "estimate", "cache.num_blocks": 40,
                      "cache.output_ratio_init": 0.05, "cache.output_ratio_min": 0.05})
    async with RolloutWorker(cfg) as w:
        outs = await _drive(w, plans[rank::world_size])
        return outs, w.metrics()["kv_preemptions"], w.kv_leak_free() and w.engine.kv.num_free_blocks == 40


def test_ranks_of_an_expert_parallel_world_preempt_on_their_own_and_give_the_single_rank_tokens():
    """Each rank's pool is its own (attention data-parallel): a rank preempts rows of its own while
    the lockstep step loop pads its batch; the tokens equal one rank's run on a pool that holds all."""
    from tests._dist_util import run_ranks

    async def single():
        async with RolloutWorker(tiny_cfg()) as w:
            return await _drive(w, plans)
    plans = _plans_long(8)
    ref = asyncio.run(single())
    res = run_ranks(_rank_grow, 2, plans, timeout_s=240)
    got = [None] * len(plans)
    for r, (outs, _, leak_free) in enumerate(res):
        assert leak_free
        for j, o in enumerate(outs):
            got[r + j * 2] = o
    assert sum(n for _, n, _ in res) > 0
    assert got == ref


# ====================================================================== a released trajectory's KV goes first
def test_a_released_trajectorys_blocks_past_its_first_prompt_are_evicted_first_tail_first():
    kv = KVCacheManager(16, 4)
    old = kv.reserve("waiting", 8, list(range(100, 108)))          # a trajectory in a tool wait: released first
    kv.mark_written("waiting", old, 8)
    kv.finish_turn("waiting", old, 8, 0.0)
    toks = list(range(1, 15))                                        # 14 tokens: 3 full blocks + a tail of 1
    life = kv.reserve("done", 15, toks)
    kv.mark_written("done", life, 14)
    kv.finish_turn("done", life, 13, 0.0)                            # 13 written: blocks 0-2 full, 1 in the tail
    seq_blocks = [kv.alloc.lookup(h) for h in kv.prompt_hashes(toks)]
    lru_before = list(kv.alloc.lru)
    assert lru_before[:2] == [b for b in lru_before if b not in seq_blocks][:2]     # LRU: the waiting one first
    n = kv.forget(toks, 4, tid="done")                               # keep the first prompt's block
    order = list(kv.alloc.lru)
    tail = order[0]
    assert n == 3 and tail not in seq_blocks                         # blocks 1, 2 and the tail, tail in front
    assert order[1:3] == [seq_blocks[2], seq_blocks[1]] and seq_blocks[0] not in order[:3]
    assert kv.audit() == []
    assert kv.forget([], 0) == 0


async def test_release_sends_the_trajectorys_kv_past_its_first_prompt_to_the_front_of_the_eviction_order():
    p = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 256})) as w:
        kv = w.engine.kv
        a = await w.generate(list(range(2, 50)), p, trajectory_id="a")           # in a tool wait: kept
        b = await w.generate(list(range(60, 108)), p, trajectory_id="b")
        b2 = await w.continue_("b", list(range(200, 240)), p)
        toks_b = list(range(60, 108)) + b.token_ids + list(range(200, 240)) + b2.token_ids
        hashes = kv.prompt_hashes(toks_b)
        first_b = {kv.alloc.lookup(h) for h in hashes[:48 // 16]}              # its first prompt's blocks
        later_b = {kv.alloc.lookup(h) for h in hashes[48 // 16:]} - {None}
        await w.release("b")
        order = list(kv.alloc.lru)
        assert later_b and set(order[1:1 + len(later_b)]) == later_b          # its tail block first, then these
        assert not first_b & set(order[:1 + len(later_b)])
        await w.release("a")
        assert a.token_ids and w.kv_leak_free()


async def test_a_soak_of_cancels_and_aborts_under_preemption_leaks_nothing_and_changes_no_completed_turn():
    """Sixty trajectories of three turns on 128 blocks, admission over-committing (an expected output
    of 5%), each turn cancelled or its trajectory aborted with probability 0.1: rows are preempted,
    nothing fails, every block comes back, and every completed turn equals a fresh run of it."""
    from ainfer_pd.tools.soak import soak, verify_against_fresh
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "cache.num_blocks": 128, "mux.activation_threshold": 1,
                      "cache.reserve_output": "estimate", "cache.output_ratio_init": 0.05, "cache.output_ratio_min": 0.05})
    async with RolloutWorker(cfg) as w:
        res = await soak(w, num_trajectories=60, turns=3, seed=3, cancel_p=0.1, abort_p=0.1, gen_range=(8, 64))
        m = w.metrics()
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 128 and not w.engine.kv.trajectories
    assert res.failed == 0 and res.completed > 0 and m["kv_preemptions"] > 0
    assert await verify_against_fresh(tiny_cfg(), res.outputs) == 0
