"""Distributed rendezvous: gloo and same-host shared memory, with real processes (gloo on
127.0.0.1), plus fast in-process checks of the shared-memory protocol."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import datetime as dt
import os
import threading
import time
import uuid

import pytest

from ainfer_pd.comm.topology import CONTROL, Topology
from ainfer_pd.config import ParallelConfig
from ainfer_pd.errors import DistributedError, RankFailedError, RendezvousMismatch, RendezvousTimeout
from ainfer_pd.launch import get_store
from ainfer_pd.turnstile.dist_rendezvous import (GlooRendezvous, LocalRendezvous, Rendezvous, ShmRendezvous,
                                                 assert_agree, make_rendezvous)

try:
    from tests._dist_util import rendezvous_threads, run_ranks, shm_entries
except ImportError:  # tests/ on sys.path instead of the repo root
    from _dist_util import rendezvous_threads, run_ranks, shm_entries

ROUNDS = 200


# ====================================================================== helpers (run in ranks)
async def _ticking(coro, period: float = 0.01):
    """Run ``coro`` while a ticker task counts loop ticks; return (result or exception, ticks)."""
    ticks = 0
    stop = False

    async def ticker():
        nonlocal ticks
        while not stop:
            await asyncio.sleep(period)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        try:
            res = await coro
        except Exception as exc:  # noqa: BLE001
            res = exc
    finally:
        stop = True
        await task
    return res, ticks


async def _rounds(rdv, rank: int, world_size: int, n: int) -> None:
    for i in range(n):
        b = i // 2
        tag = "rdv1" if i % 2 == 0 else "rdv2"
        payload = (7, b, b + 3) if i % 2 == 0 else (7, b, b + 3, rank)   # rdv2 carries the rank
        res = await rdv.arrive(tag, payload, epoch=7, boundary=b)
        assert len(res) == world_size
        if i % 2 == 0:
            assert assert_agree(res, tag, 7, b) == (7, b, b + 3)
        else:
            assert res == [(7, b, b + 3, r) for r in range(world_size)]


async def _mismatch_detected(rdv, rank: int) -> bool:
    res = await rdv.arrive("rdv1", (9, 1, 1 + (rank == 1)), epoch=9, boundary=1)
    try:
        assert_agree(res, "rdv1", 9, 1)
    except RendezvousMismatch as exc:
        return "ranks [1]" in str(exc) or "ranks [0]" in str(exc)
    return False


async def _slow_peer_wait(rdv, rank: int, delay: float):
    """Rank 1 arrives ``delay`` late; the others must keep their loop ticking meanwhile."""
    if rank == 1:
        await asyncio.sleep(delay)
        res = await rdv.arrive("slow", (rank,), epoch=3, boundary=4)
        return res, None
    t0 = time.perf_counter()
    res, ticks = await _ticking(rdv.arrive("slow", (rank,), epoch=3, boundary=4))
    return res, (ticks, time.perf_counter() - t0)


def _make(kind: str, rank: int, world_size: int, timeout_s: float, group=None):
    if kind == "shm":
        return ShmRendezvous(rank, world_size, timeout_s, store=get_store())
    mode = "poll" if kind == "gloo-poll" else "thread"
    collective = "all_reduce" if kind == "gloo-allreduce" else "all_gather"
    return GlooRendezvous(group, timeout_s, mode=mode, collective=collective)


async def _healthy_rank(rank: int, world_size: int, kinds: tuple[str, ...], rounds: int, slow_delay: float):
    import torch.distributed as dist

    ctrl = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=30))
    out = {}
    for kind in kinds:
        rdv = _make(kind, rank, world_size, 20.0, ctrl)
        assert isinstance(rdv, Rendezvous)
        t0 = time.perf_counter()
        await _rounds(rdv, rank, world_size, rounds)
        per_round_ms = (time.perf_counter() - t0) / rounds * 1e3
        mismatch = await _mismatch_detected(rdv, rank)
        slow = await _slow_peer_wait(rdv, rank, slow_delay) if slow_delay else (None, None)
        stats = rdv.stats()
        path = getattr(rdv, "path", "")
        await rdv.close()
        await rdv.close()                                   # idempotent
        closed_err = None
        try:
            await rdv.arrive("after-close", ())
        except DistributedError as exc:
            closed_err = type(exc).__name__
        out[kind] = {"per_round_ms": per_round_ms, "mismatch": mismatch, "slow": slow, "stats": stats,
                     "threads": rendezvous_threads(), "board_exists": bool(path) and os.path.exists(path),
                     "closed_err": closed_err}
    out["shm_entries"] = sorted(shm_entries("ainfer_pd_rdzv"))
    return out


def _check_healthy(results, world_size, kinds, slow_delay):
    for rank, out in enumerate(results):
        for kind in kinds:
            o = out[kind]
            assert o["mismatch"], (rank, kind)
            assert o["stats"]["rounds"] == ROUNDS + 1 + (1 if slow_delay else 0), (rank, kind, o["stats"])
            assert o["threads"] == [], (rank, kind, o["threads"])      # no leaked waiter/worker threads
            assert not o["board_exists"], (rank, kind)
            assert o["closed_err"] == "DistributedError"
            if slow_delay:
                res, info = o["slow"]
                assert res == [(r,) for r in range(world_size)]
                if rank != 1:
                    ticks, waited = info
                    assert waited >= slow_delay * 0.8, (rank, kind, waited)
                    # the loop kept running: a 10 ms ticker ticked through the wait
                    assert ticks >= 0.3 * slow_delay / 0.01, (rank, kind, ticks)
        assert out["shm_entries"] == [], out["shm_entries"]                   # no leaked segments


# ====================================================================== real processes
def test_two_ranks_gloo_thread_poll_and_shm():
    kinds = ("gloo", "gloo-poll", "gloo-allreduce", "shm")
    before = shm_entries("ainfer_pd_rdzv")
    res = run_ranks(_healthy_rank, 2, kinds, ROUNDS, 0.4, timeout_s=90)
    _check_healthy(res, 2, kinds, 0.4)
    assert shm_entries("ainfer_pd_rdzv") <= before


def _four_rank_main(rank: int, world_size: int, rounds: int):
    async def main():
        out = await _healthy_rank(rank, world_size, ("gloo", "shm"), rounds, 0.0)
        # the factory, for the crossed topology (g=4, ATP2/ADP2), on a gloo control group
        import torch.distributed as dist
        cfg = ParallelConfig(world_size=4, attn_dp=2, rendezvous_timeout_s=20.0)
        topo = Topology.from_config(cfg, rank)
        groups = {CONTROL: dist.new_group(backend="gloo")}
        picked = []
        # the same name re-used (as a harness does per run): keys are scoped per instance
        for same_host, fast in ((True, True), (False, True), (True, False), (True, True)):
            c = ParallelConfig(world_size=4, attn_dp=2, rendezvous_timeout_s=20.0, fast_rendezvous=fast)
            rdv = make_rendezvous(c, topo, same_host=same_host, group=groups[CONTROL], name="factory")
            picked.append(rdv.kind)
            res = await rdv.arrive("factory", (topo.dp_rank, topo.tp_rank), epoch=0, boundary=0)
            assert res == [(r // 2, r % 2) for r in range(4)]
            await rdv.close()
        out["picked"] = picked
        return out
    return asyncio.run(main())


def test_four_ranks_gloo_and_shm_and_factory():
    res = run_ranks(_four_rank_main, 4, ROUNDS, timeout_s=90)
    _check_healthy(res, 4, ("gloo", "shm"), 0.0)
    for out in res:
        assert out["picked"] == ["shm", "gloo", "gloo", "shm"]


async def _store_barrier(key: str, world_size: int, timeout_s: float = 30.0) -> None:
    store = get_store()
    store.add(key, 1)
    end = time.monotonic() + timeout_s
    while store.add(key, 0) < world_size:
        assert time.monotonic() < end, f"store barrier {key} timed out"
        await asyncio.sleep(0.005)


async def _timed_failure(rdv, epoch: int):
    """Arrive once, expecting a failure; record what the error says and how long it took."""
    t0 = time.perf_counter()
    exc, ticks = await _ticking(rdv.arrive("rdv1", (epoch, epoch, epoch + 3), epoch=epoch, boundary=epoch))
    return (type(exc).__name__, getattr(exc, "missing_ranks", None), getattr(exc, "epoch", None),
            getattr(exc, "boundary", None), time.perf_counter() - t0, ticks, str(exc))


async def _failing_peer_rank(rank: int, world_size: int, timeout_s: float):
    """Phase 1: rank 2 stays alive but stops arriving. Phase 2 (fresh rendezvous objects): rank 2
    is killed (SIGKILL). In both, ranks 0 and 1 must raise RendezvousTimeout naming rank 2, the
    epoch and the boundary, within about the timeout, with their event loop still ticking."""
    import signal

    import torch.distributed as dist

    objs = []
    for _ in range(2):
        ctrl = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=timeout_s + 0.5))
        objs.append((ShmRendezvous(rank, world_size, timeout_s, store=get_store()),
                     GlooRendezvous(ctrl, timeout_s)))
    out = {}
    for phase, (shm, gloo) in enumerate(objs, start=1):
        for rdv in (shm, gloo):
            await _rounds(rdv, rank, world_size, 6)
        if rank == 2:
            if phase == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            await _store_barrier("phase1-done", world_size)     # silent until the others gave up
            continue
        for name, rdv in (("shm", shm), ("gloo", gloo)):
            out[(phase, name)] = await _timed_failure(rdv, 3 * phase)
            try:
                await rdv.arrive("rdv2", ())
            except DistributedError as e:
                out[(phase, name, "after")] = type(e).__name__
        if phase == 1:
            await _store_barrier("phase1-done", world_size)
    for shm, _ in objs:
        await shm.close()
    return out


def test_silent_or_killed_rank_fails_others_within_timeout():
    timeout = 1.0
    res = run_ranks(_failing_peer_rank, 3, timeout, timeout_s=60, return_exceptions=True)
    assert isinstance(res[2], RankFailedError) and "signal 9" in str(res[2]), res[2]
    for rank in (0, 1):
        for phase in (1, 2):                      # 1: stopped arriving, 2: process killed
            for name in ("shm", "gloo"):
                typ, missing, epoch, boundary, waited, ticks, msg = res[rank][(phase, name)]
                e = 3 * phase
                assert typ == "RendezvousTimeout", (rank, phase, name, msg)
                assert missing == (2,), (rank, phase, name, msg)
                assert (epoch, boundary) == (e, e)
                assert "missing ranks [2]" in msg and f"epoch={e}" in msg and f"boundary={e}" in msg
                lo = 0.9 * timeout if phase == 1 else 0.0   # a dead gloo peer may fail fast
                assert lo <= waited <= timeout + 2.5, (rank, phase, name, waited)
                if waited > 0.5:
                    assert ticks >= 15, (rank, phase, name, ticks)   # loop responsive while waiting
                assert res[rank][(phase, name, "after")] == "DistributedError"   # broken afterwards


def _launcher_rank(rank: int, world_size: int):
    if rank == 0:
        raise RendezvousTimeout("boom", missing_ranks=(3,), epoch=1, boundary=2)
    time.sleep(120)                                   # a straggler: must be killed, not waited for


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_spawn_reports_typed_errors_and_kills_stragglers(start, monkeypatch):
    monkeypatch.setenv("AINFER_PD_START_METHOD", start)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as ei:
        run_ranks(_launcher_rank, 2, timeout_s=30, init=False, return_exceptions=True, fail_grace_s=1.0)
    err = ei.value
    assert time.monotonic() - t0 < 20
    assert err.unfinished == (1,) and "rank 1" in str(err) and "killed" in str(err)
    exc0 = err.results[0]
    assert isinstance(exc0, RendezvousTimeout)                  # re-created with its attributes
    assert (str(exc0), exc0.missing_ranks, exc0.epoch, exc0.boundary) == ("boom", (3,), 1, 2)
    assert "_launcher_rank" in exc0.remote_traceback


# ====================================================================== in process (fast)
def _shm_pair(world_size: int = 2, timeout_s: float = 5.0, **kw):
    name = uuid.uuid4().hex[:12]
    with cf.ThreadPoolExecutor(world_size) as ex:
        futs = [ex.submit(ShmRendezvous, r, world_size, timeout_s, name=name, **kw) for r in range(world_size)]
        return [f.result(timeout=10) for f in futs]


async def test_shm_in_process_rounds_tags_and_timeout():
    before = shm_entries("ainfer_pd_rdzv")
    a, b = _shm_pair(2, timeout_s=0.5)
    assert shm_entries("ainfer_pd_rdzv") <= before            # unlinked once both mapped
    await asyncio.gather(_rounds(a, 0, 2, ROUNDS), _rounds(b, 1, 2, ROUNDS))
    # ranks at different tags in the same round: a typed mismatch on both
    r = await asyncio.gather(a.arrive("rdv1", (1,)), b.arrive("rdv2", (1,)), return_exceptions=True)
    assert all(isinstance(x, RendezvousMismatch) for x in r), r
    for x in (a, b):
        await x.close()

    a, b = _shm_pair(2, timeout_s=0.5)
    await asyncio.gather(a.arrive("x", (1,)), b.arrive("x", (2,)))
    t0 = time.perf_counter()
    exc, ticks = await _ticking(a.arrive("x", (3,), epoch=11, boundary=12))
    assert isinstance(exc, RendezvousTimeout)
    assert (exc.missing_ranks, exc.epoch, exc.boundary) == ((1,), 11, 12)
    assert 0.45 <= time.perf_counter() - t0 < 2.0
    assert ticks >= 10
    with pytest.raises(DistributedError):
        await a.arrive("x", (4,))
    for x in (a, b):
        await x.close()
    assert rendezvous_threads() == []


async def test_shm_in_process_slow_peer_uses_waiter_thread():
    a, b = _shm_pair(2, timeout_s=5.0)

    async def late():
        await asyncio.sleep(0.2)
        return await b.arrive("t", (2,), epoch=1, boundary=1)

    (ra, ticks), rb = await asyncio.gather(_ticking(a.arrive("t", (1,), epoch=1, boundary=1)), late())
    assert ra == rb == [(1,), (2,)]
    assert ticks >= 5
    assert any(n.startswith("ainfer-pd-rdzv-shm") for n in rendezvous_threads())
    for x in (a, b):
        await x.close()
    assert rendezvous_threads() == []


async def test_shm_cancelled_arrive_keeps_sequence():
    a, b = _shm_pair(2, timeout_s=5.0)
    t = asyncio.create_task(a.arrive("c", (1,)))
    await asyncio.sleep(0.05)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    # b completes the round a already joined; both continue in step
    assert await b.arrive("c", (2,)) == [(1,), (2,)]
    assert await asyncio.gather(a.arrive("d", (3,)), b.arrive("d", (4,))) == [[(3,), (4,)]] * 2
    for x in (a, b):
        await x.close()


async def test_payload_validation_and_single_rank():
    s = LocalRendezvous(1.0, max_payload=3)
    assert await s.arrive("x", (1, -2, 2 ** 62), epoch=None, boundary=None) == [(1, -2, 2 ** 62)]
    assert await s.arrive("x", ()) == [()]
    for bad in ((1, 2, 3, 4), (1.5,), (True,), (2 ** 63,)):
        with pytest.raises(DistributedError):
            await s.arrive("x", bad)
    await s.close()
    cfg = ParallelConfig(world_size=1)
    assert make_rendezvous(cfg, Topology.from_config(cfg, 0), same_host=True).kind == "single"
    assert s.arrivals == 2                      # the refused arrivals did not count
    with pytest.raises(DistributedError, match="closed"):
        await s.arrive("x", (1,))
    with pytest.raises(RendezvousMismatch, match=r"ranks \[1\]"):
        assert_agree([(1, 2), (1, 3)], "t", 1, 2)
    assert assert_agree([(1, 2)] * 3, "t", None, None) == (1, 2)


def test_shm_setup_without_peer_times_out():
    with pytest.raises(RendezvousTimeout) as ei:
        ShmRendezvous(0, 2, 0.3, name=uuid.uuid4().hex[:12])
    assert ei.value.missing_ranks == (1,)
    assert threading.active_count() >= 1


def test_an_unknown_start_method_is_refused_before_any_rank_starts(monkeypatch):
    from ainfer_pd.errors import DistributedError
    monkeypatch.setenv("AINFER_PD_START_METHOD", "fork")
    with pytest.raises(DistributedError, match="AINFER_PD_START_METHOD='fork'"):
        run_ranks(_launcher_rank, 2, timeout_s=30, init=False)


def _env_rank(rank, world_size):
    return os.environ.get("AINFER_PD_TEST_MARK"), os.environ.get("OMP_NUM_THREADS")


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_ranks_see_the_parent_s_environment_as_it_is_at_the_call(start, monkeypatch):
    """Under forkserver too, a variable set after the server started reaches the ranks."""
    monkeypatch.setenv("AINFER_PD_START_METHOD", start)
    if start == "forkserver":
        run_ranks(_env_rank, 1, timeout_s=60, init=False)      # the server starts here, before the mark
    monkeypatch.setenv("AINFER_PD_TEST_MARK", "later")
    assert run_ranks(_env_rank, 2, timeout_s=60, init=False) == [("later", "1")] * 2
