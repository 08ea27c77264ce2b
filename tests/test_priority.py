"""Trajectory-aware priority (scheduler.priority): the pure ordering, and the engine serving it
without changing any output."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import ConfigError
from ainfer_pd.sched.priority import History, PriorityConfig, Work, order, remaining_work
from tests.conftest import rand_ids, tiny_cfg

CP = PriorityConfig("critical-path", aging_s=2.0, ttft_bound_tokens=1000)


def W(key, group="g", turns=0, tokens=100, waited=0.0, ahead=0, started=False):
    return Work(key, group, turns, tokens, waited, ahead, started)


def test_fifo_keeps_arrival_order():
    items = [W("a"), W("b", tokens=10), W("c", started=True)]
    assert order(items, History(), PriorityConfig()) == items


def test_most_remaining_work_first_learnt_per_group():
    h = History()
    for _ in range(3):
        h.record("long", turns=8, tokens=8000)       # this group's trajectories run 8 turns, 8K tokens
        h.record("short", turns=2, tokens=600)
    items = [W("s", "short", 1, 300), W("l", "long", 1, 1000), W("l2", "long", 6, 7000)]
    assert [w.key for w in order(items, h, CP)] == ["l", "l2", "s"]
    assert remaining_work(items[1], h) == pytest.approx(7000)
    assert remaining_work(items[2], h) == pytest.approx(1000)      # at least one typical turn (1000)


def test_started_work_keeps_its_place_and_the_first_token_bound_jumps_the_queue():
    h = History()
    h.record("long", 8, 8000)
    h.record("x", 2, 200)
    items = [W("short", "x", 0, 50, waited=0.1), W("late", "x", 0, 50, waited=3.0, ahead=1000),
             W("big", "long", 0, 100), W("run", "x", 0, 50, started=True)]
    assert [w.key for w in order(items, h, CP)] == ["run", "late", "big", "short"]


def test_aging_lets_a_long_wait_overtake():
    h = History()
    h.record("long", 4, 4000)
    h.record("short", 4, 400)
    fresh_long, old_short = W("L", "long", 0, 100, waited=0.0), W("S", "short", 0, 100, waited=0.0)
    assert [w.key for w in order([old_short, fresh_long], h, CP)] == ["L", "S"]
    old_short = W("S", "short", 0, 100, waited=3600.0)                 # an hour of waiting
    assert [w.key for w in order([old_short, fresh_long], h, CP)] == ["S", "L"]


def test_bad_priority_config_is_typed():
    with pytest.raises(ConfigError):
        tiny_cfg(**{"scheduler.priority": "random"})
    with pytest.raises(ConfigError):
        tiny_cfg(**{"scheduler.priority_aging_s": 0.0})


@pytest.mark.parametrize("policy", ["fine-grained", "mixed-chunked"])
async def test_critical_path_changes_no_output(policy):
    """Greedy outputs of a multi-turn workload are the same under fifo and critical-path (only
    the order of service changes), and the predictor learns from released trajectories."""
    async def run(priority, short=0):
        cfg = tiny_cfg(**{"scheduler.policy": policy, "scheduler.priority": priority, "cache.num_blocks": 512,
                          "scheduler.max_decode_batch": 4, "scheduler.max_prefill_tokens": 256,
                          "scheduler.short_prefill_tokens": short})
        outs = {}
        async with RolloutWorker(cfg) as w:
            async def conv(i):
                rng = random.Random(i)
                o = await w.generate(rand_ids(rng, 40 + 30 * (i % 3)), SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                                     ignore_eos=True))
                toks = [o.token_ids]
                for _ in range(1 + i % 3):
                    await asyncio.sleep(0.01 * (i % 2))
                    o = await w.continue_(o.trajectory_id, rand_ids(rng, 9), SamplingParams(max_new_tokens=4,
                                                                                        temperature=0.0,
                                                                                        ignore_eos=True))
                    toks.append(o.token_ids)
                await w.release(o.trajectory_id)
                outs[i] = toks
            async with asyncio.TaskGroup() as tg:
                for i in range(8):
                    tg.create_task(conv(i))
            learnt = w.engine.book.history.mean(w.engine.book.history.turns, "*")
            assert w.kv_leak_free()
        return outs, learnt
    fifo, _ = await run("fifo")
    cp, learnt = await run("critical-path")
    assert cp == fifo
    assert learnt is not None and learnt > 1
    short, _ = await run("critical-path", short=16)      # the 9-token observations go first
    assert short == fifo


def test_short_prefill_turns_go_ahead_of_a_burst_of_first_turns():
    """A continuation with 40 tokens left to prefill arrives behind a burst of long first turns
    (every one of them over the first-token bound already): with short_prefill_tokens 256 it goes
    right after the started chunk, ahead of the burst; off (0), it waits for the burst."""
    h = History()
    burst = [Work(f"b{i}", f"g{i}", 0, 3000, 2.0, 5000, False, 3000) for i in range(4)]
    chunk = Work("c", "gc", 0, 3000, 2.0, 5000, True, 1200)
    cont = Work("k", "g0", 1, 900, 0.3, 5000, False, 40)
    items = [chunk, *burst, cont]
    on = PriorityConfig("critical-path", 2.0, ttft_bound_tokens=1000, short_prefill_tokens=256)
    assert [w.key for w in order(items, h, on)] == ["c", "k", "b0", "b1", "b2", "b3"]
    off = PriorityConfig("critical-path", 2.0, ttft_bound_tokens=1000)
    assert [w.key for w in order(items, h, off)] == ["c", "b0", "b1", "b2", "b3", "k"]
    assert order(items, h, PriorityConfig("fifo", short_prefill_tokens=256)) == items    # fifo: unchanged


def test_short_prefill_tokens_is_checked():
    assert tiny_cfg().scheduler.short_prefill_tokens == 0
    with pytest.raises(ConfigError, match="short_prefill_tokens"):
        tiny_cfg(**{"scheduler.short_prefill_tokens": -1})


def test_fifo_under_kv_pressure_serves_short_prefills_first():
    """When the first turn to admit needs more blocks than are free (its admission evicts cached
    prefixes), waiting continuations with little left to prefill go ahead of the other waiting
    turns, in their order; admitted turns keep their place. Otherwise nothing moves."""
    from ainfer_pd.sched.planner import PendingPrefill as P
    from ainfer_pd.sched.priority import short_first_under_pressure as sf
    pend = [P("chunk", 300, True, 0), P("head", 900, False, 60), P("obs1", 40, False, 4), P("first", 700, False, 50),
            P("obs2", 200, False, 15)]
    ids = lambda v: [p.request_id for p in v]                                            # noqa: E731
    assert ids(sf(pend, 10, 256, False)) == ["chunk", "obs1", "obs2", "head", "first"]
    assert sf(pend, 60, 256, False) is pend                 # the head fits in the free blocks
    assert sf(pend, 10, 0, False) is pend                   # off
    assert sf(pend, 10, 256, True) is pend                  # the head is past the first-token bound
    assert sf(pend, 10, 30, False) is pend                  # nothing short
    short_head = [P("obs0", 10, False, 20)] + pend[1:]
    assert sf(short_head, 10, 256, False) is short_head     # the head is short itself
