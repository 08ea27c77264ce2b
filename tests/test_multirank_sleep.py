"""Issue 34, item 13: a peer's turn while one rank of a multi-rank replica is asleep. On
``configs/tiny-2rank-cpu.yaml`` both ranks ``sleep(1)``, rank 0 wakes and generates: before, rank
1's lockstep engine joined the P epoch on its released KV pool (TypeError) and rank 0 got
PeerLostError. Now the turn waits until every rank is awake, then runs (tokens as at world size
1); a sleeping rank that closes instead fails the waiting turns with WorkerAsleepError. The replica
survives either way. Real processes over gloo; every wait bounded."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.errors import WorkerAsleepError
from tests._dist_util import run_ranks
from tests.conftest import ROOT, rand_ids

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 200, 201]
N = 6


def _cfg() -> WorkerConfig:
    return WorkerConfig.from_yaml(ROOT / "configs" / "tiny-2rank-cpu.yaml")


async def _flag(d: Path, name: str) -> None:
    (d / name).touch()


async def _await_flag(d: Path, name: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (d / name).exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"flag {name} not set within {timeout_s} s")
        await asyncio.sleep(0.02)


async def _rank(rank: int, world_size: int, d: str, peer_wakes: bool):
    d = Path(d)
    async with RolloutWorker(_cfg()) as w:
        await w.sleep(1)
        await _flag(d, f"asleep{rank}")
        await _await_flag(d, f"asleep{1 - rank}")
        if rank == 1:
            await _await_flag(d, "rank0-waiting")
            if peer_wakes:
                await asyncio.sleep(1.0)            # rank 0's turn must wait meanwhile
                await w.wake_up()
                await _flag(d, "awake1")
                await _await_flag(d, "done0")
            return "rank 1 ok"                      # closing asleep (peer_wakes False)
        await w.wake_up()
        task = asyncio.ensure_future(w.generate(PROMPT, SamplingParams(max_new_tokens=N, **GREEDY)))
        await asyncio.sleep(0.5)
        assert not task.done(), f"the turn ran while rank 1 was asleep: {task.result() if not task.exception() else task.exception()!r}"
        await _flag(d, "rank0-waiting")
        if peer_wakes:
            out = await asyncio.wait_for(task, 60)
            assert (d / "awake1").exists(), "the turn finished before rank 1 woke"
            await w.release(out.trajectory_id)
            leak_free = w.kv_leak_free()
            # and the replica keeps serving
            again = await asyncio.wait_for(w.generate(PROMPT, SamplingParams(max_new_tokens=N, **GREEDY)), 60)
            await w.release(again.trajectory_id)
            await _flag(d, "done0")
            return out.token_ids, again.token_ids, leak_free
        with pytest.raises(WorkerAsleepError, match="rank"):
            await asyncio.wait_for(task, 60)
        # the sleeping peer closed: nothing can run, and the exit still completes
        return "refused", w.kv_leak_free()


async def _single_rank_tokens():
    from tests.conftest import tiny_cfg
    async with RolloutWorker(tiny_cfg()) as w:
        out = await w.generate(PROMPT, SamplingParams(max_new_tokens=N, **GREEDY))
        return out.token_ids


@pytest.mark.timeout(240)
def test_a_turn_waits_for_a_sleeping_rank_and_then_runs(tmp_path):
    res = run_ranks(_rank, 2, str(tmp_path), True, timeout_s=180)
    toks, again, leak_free = res[0]
    assert res[1] == "rank 1 ok"
    expected = asyncio.run(_single_rank_tokens())
    assert toks == expected and again == expected and leak_free


@pytest.mark.timeout(240)
def test_a_turn_is_refused_when_the_sleeping_rank_closes(tmp_path):
    res = run_ranks(_rank, 2, str(tmp_path), False, timeout_s=180)
    assert res[0] == ("refused", True) and res[1] == "rank 1 ok"


LONG = 40


async def _rank_mid_turn(rank: int, world_size: int, d: str):
    """Rank 1 goes to sleep while rank 0's turn decodes (its epochs and D iterations need rank 1),
    then wakes: the turn pauses meanwhile and ends with the tokens of an uninterrupted run."""
    d = Path(d)
    async with RolloutWorker(_cfg()) as w:
        if rank == 1:
            await _await_flag(d, "decoding0")
            await w.sleep(1)
            await _flag(d, "asleep1")
            await asyncio.sleep(1.0)
            await w.wake_up()
            await _flag(d, "awake1")
            await _await_flag(d, "done0")
            return "rank 1 ok", w.kv_leak_free()
        task = asyncio.ensure_future(w.generate(PROMPT, SamplingParams(max_new_tokens=LONG, **GREEDY)))
        deadline = time.monotonic() + 60
        while not (w.engine.book.decoding and len(w.engine.book.decoding[0].out_tokens) >= 2):
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.001)
        await _flag(d, "decoding0")
        await _await_flag(d, "asleep1")
        n_asleep = len(w.engine.book.decoding[0].out_tokens) if w.engine.book.decoding else None
        await asyncio.sleep(0.5)
        n_later = len(w.engine.book.decoding[0].out_tokens) if w.engine.book.decoding else None
        out = await asyncio.wait_for(task, 60)
        await w.release(out.trajectory_id)
        await _flag(d, "done0")
        return out.token_ids, n_asleep, n_later, w.kv_leak_free()


async def _single_rank_long():
    from tests.conftest import tiny_cfg
    async with RolloutWorker(tiny_cfg()) as w:
        return (await w.generate(PROMPT, SamplingParams(max_new_tokens=LONG, **GREEDY))).token_ids


@pytest.mark.timeout(240)
def test_a_rank_that_sleeps_mid_turn_pauses_the_peers_turn_until_it_wakes(tmp_path):
    """Before: the sleeping rank released its KV pool while the agreed epochs and D iterations
    still needed it (TypeError on it, PeerLostError on the peer)."""
    res = run_ranks(_rank_mid_turn, 2, str(tmp_path), timeout_s=180)
    toks, n_asleep, n_later, leak_free = res[0]
    assert res[1] == ("rank 1 ok", True)
    assert n_asleep is not None and n_asleep == n_later, "the turn advanced while rank 1 was asleep"
    assert toks == asyncio.run(_single_rank_long()) and leak_free
