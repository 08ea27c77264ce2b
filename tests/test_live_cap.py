"""``scheduler.max_live_trajectories``: a new trajectory's first turn waits while the cap's worth of
trajectories are in progress (a turn decoding, prefilling, or waiting after an earlier turn);
continuations are never held, a trajectory between turns does not count, and outputs are the
same as without the cap."""
import asyncio

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import ConfigError
from ainfer_pd.engine.loop.state import Trajectory
from ainfer_pd.sched.planner import AUTO_LIVE_MIN_FINISHED, auto_live_cap, within_live_cap
from tests.conftest import rand_ids, tiny_cfg
from tests.test_turn_book import Book, loop  # noqa: F401  (the fixture)


def test_first_turns_are_kept_only_while_the_active_ones_stay_under_the_cap():
    assert within_live_cap([True, False, True, True], active=1, cap=3) == [True, True, True, False]
    assert within_live_cap([True, True], active=3, cap=3) == [False, False]
    assert within_live_cap([False, False], active=9, cap=3) == [True, True]      # continuations: never held
    assert within_live_cap([True] * 4, active=9, cap=0) == [True] * 4          # 0: no limit
    with pytest.raises(ConfigError, match="max_live_trajectories"):
        tiny_cfg(**{"scheduler.max_live_trajectories": -1})


def test_auto_caps_at_what_the_pool_holds_of_the_finished_trajectories_mean_context():
    assert auto_live_cap(71_392, 4_500.0, finished=64) == 15
    assert auto_live_cap(1_000, 4_500.0, finished=64) == 1                     # at least one
    assert auto_live_cap(71_392, 4_500.0, finished=AUTO_LIVE_MIN_FINISHED - 1) == 0   # too few finished: no cap
    assert auto_live_cap(71_392, None, finished=0) == 0
    assert tiny_cfg(**{"scheduler.max_live_trajectories": "auto"}).scheduler.max_live_trajectories == "auto"
    for bad in ("many", True, 2.5):
        with pytest.raises(ConfigError, match="max_live_trajectories"):
            tiny_cfg(**{"scheduler.max_live_trajectories": bad})


def test_an_auto_book_caps_once_enough_trajectories_finished(loop):  # noqa: F811
    b = Book(loop, num_blocks=64)                                              # 1,024 tokens
    b.book.live.cap = "auto"
    a, c = b.turn("a"), b.turn("c")
    assert [w[0] for w in b.admit()] == [a, c]                                 # nothing finished: no cap
    for i in range(AUTO_LIVE_MIN_FINISHED):
        b.book.record_trajectory(f"done{i}", 2, 600)                           # the pool holds one of them
    d = b.turn("d")
    assert d.request_id not in [p.request_id for p in b.book.pending_view()]   # a, c in progress: d waits


def test_the_book_holds_first_turns_at_the_cap_and_admits_continuations(loop):  # noqa: F811
    b = Book(loop, num_blocks=64)
    b.book.live.cap = 2
    a, c, d = b.turn("a"), b.turn("c"), b.turn("d")
    work = b.admit()
    assert [w[0] for w in work] == [a, c] and not d.lifetime                   # d: a third trajectory
    b.prefill(work, [7, 9])
    assert not b.book.p_admissible()
    later = Trajectory("x")
    later.tokens, later.num_turns = rand_ids(b.rng, 20), 1                      # x had a turn before: not new
    x = b.turn("x", traj=later)
    assert [w[0] for w in b.admit()] == [x]                                    # a continuation past the cap
    b.book.abort(c)                                                            # c, x between turns: still live
    b.book.abort(x)
    assert not b.book.p_admissible()
    b.book.live.released("c")
    b.book.live.released("x")                                                       # released: d's turn
    assert [w[0] for w in b.admit()] == [d]


def test_first_turns_go_ahead_when_no_trajectory_has_a_turn(loop):  # noqa: F811
    """Trajectories between turns hold the cap only while some trajectory had a turn within
    LIVE_IDLE_S: a caller that runs every first turn before any second one is served in waves,
    never held for good."""
    b = Book(loop, num_blocks=64)
    b.book.live.cap = 1
    a, c = b.turn("a"), b.turn("c")
    assert [w[0] for w in b.admit()] == [a]
    b.book.abort(a)                                                            # a between turns, unreleased
    assert not b.book.p_admissible()                                           # its continuation may come
    b.book.live.idle_s = 0.0                                                   # no turn for that long
    assert [w[0] for w in b.admit()] == [c]


async def _run(cap: int, active_seen: list[int]) -> dict[str, list[list[int]]]:
    cfg = tiny_cfg(**{"scheduler.max_live_trajectories": cap, "cache.num_blocks": 256})
    p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        book = w.engine.book
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                running = {t.tid for t in book.decoding} | {t.tid for t in book.waiting if t.lifetime}
                active_seen.append(len(running))
                await asyncio.sleep(0)

        async def traj(i: int) -> list[list[int]]:
            tid = f"t{i}"
            out = [(await w.generate(list(range(3 + i, 40 + 3 * i)), p, trajectory_id=tid)).token_ids]
            out.append((await w.continue_(tid, [5, 6, 7, 8 + i], p)).token_ids)
            await w.release(tid)
            return out
        async with asyncio.TaskGroup() as tg:
            tg.create_task(watch())
            runs = [tg.create_task(traj(i)) for i in range(6)]
            await asyncio.gather(*runs)
            stop.set()
    return {f"t{i}": r.result() for i, r in enumerate(runs)}


async def test_a_capped_worker_runs_every_trajectory_with_the_same_outputs():
    seen_capped, seen_free = [], []
    capped = await _run(2, seen_capped)
    free = await _run(0, seen_free)
    assert capped == free
    assert max(seen_capped) <= 2 < max(seen_free)          # trajectories with a turn admitted at once
