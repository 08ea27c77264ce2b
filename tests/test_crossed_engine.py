"""The crossed topology (g = 4, ATP2 / ADP2, EP4) inside the real lockstep engine (issue 14).

Real processes, gloo, the tiny model of ``configs/tiny-crossed-cpu.yaml``:

* under ``selective`` the multi-rank replay's greedy tokens equal world size 1 on the same trace,
  multiplexing happened (turnstile rounds, P work overlapping D) and ``trace-check`` finds the
  registered pairs in device order and never overlapping; the same under 20 ms phase skew x seeds;
* under ``none`` with the replicas out of phase the run stops making progress and the watchdog
  turns it into a :class:`StallError` naming the frontier (bounded: the test never hangs);
  ATP1 and ADP1 variants complete under ``none``;
* a rank killed mid-run makes every other rank fail with a typed error naming it.
"""
from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from pathlib import Path

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import AInferPDError, DistributedError, PeerLostError, RankFailedError, RendezvousTimeout, \
    StallError
from ainfer_pd.launch import spawn
from ainfer_pd.tools.tracecheck import check_run_dir
from ainfer_pd.tools.selftest import crossed_config, single_rank_outputs, small_trace
from ainfer_pd.tools.world import rank_replay, run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIME_SCALE = 0.1
_trace = small_trace
_single_outputs = single_rank_outputs

# The traces' seeds are picked for a short longest conversation (the lockstep world's D iterations follow
# its chain of decode steps, ~0.1 s each over 4 ranks on the 2-core VM) at the same shape and about the
# same total tokens as the selftest's: 6 x 3 seed 11 (longest chain 186 decode tokens, 681 in all) for
# seed 0 (305, 682), 4 x 3 seed 8 (146, 433) for seed 3 (207, 448), 4 x 2 seed 7 (112, 278) for seed 5
# (152, 302).
SEL_TRACE = (6, 3, 11)
SKEW_TRACE = (4, 3, 8)
AXIS_ONE_TRACE = (4, 2, 7)


def _trace_of(shape: tuple[int, int, int]):
    n, turns, seed = shape
    return _trace(n, turns, seed=seed)


@functools.lru_cache(maxsize=None)
def _reference(shape: tuple[int, int, int]) -> dict:
    """World size 1's greedy tokens of the trace ``shape`` (computed once per module: ATP1 and ADP1
    compare with the same one)."""
    return _single_outputs(_trace_of(shape))


def _crossed(run_dir: Path, **over):
    return crossed_config(run_dir, **over)


def test_crossed_selective_replay_equals_world_size_one_and_trace_check_is_clean(tmp_path):
    trace = _trace_of(SEL_TRACE)
    res = run_world(_crossed(tmp_path / "sel"), trace, 4, cell="trace", seed=0, time_scale=TIME_SCALE,
                    timeout_s=200)
    assert res.failures == 0 and res.completed == res.planned_requests == trace.num_requests
    ref = _reference(SEL_TRACE)
    assert res.outputs == ref                                    # greedy tokens of every turn
    rep = check_run_dir(tmp_path / "sel")
    assert rep["ok"], rep["violations"][:5]
    assert rep["ranks"] == [0, 1, 2, 3]
    assert rep["rounds_per_rank"] > 0 and rep["pairs_checked"] > 0     # multiplexed, registered pairs ordered
    assert rep["registered_pair_overlap_ms"] == 0.0
    assert rep["other_p_vs_d_overlap_ms"] > 0.0                         # other P work overlapped D
    # D's DP-attention path ran: its all-gather / reduce-scatter on attn_dp.D, groups (0, 2) and (1, 3)
    dp = _coll_launches(tmp_path / "sel", "attn_dp.D")
    assert set(dp) == {0, 1, 2, 3} and min(dp.values()) > 0, dp
    assert len(set(dp.values())) == 1                                   # every rank joined every one
    # the merged metrics (issue 36 item 4): one rank's rendezvous count, D wait and concurrency held
    m = res.metrics
    assert m["rendezvous"] == rep["rendezvous_per_rank"] > 0 and m["world_events_agree"]
    assert m["d_wait_s_count"] > 0 and m["d_wait_s_mean"] > 0.0
    assert 0.0 < m["concurrent_fraction"] <= 1.0


def _coll_launches(run_dir: Path, comm: str) -> dict[int, int]:
    """Per rank: how many collectives of communicator family ``comm`` it joined (``coll_launch``)."""
    import json
    out: dict[int, int] = {}
    for p in sorted(run_dir.glob("rank*.jsonl")):
        rank = int(p.stem[4:])
        out[rank] = sum(1 for line in p.read_text().splitlines()
                        if '"coll_launch"' in line and json.loads(line).get("comm") == comm)
    return out


def test_crossed_selective_under_phase_skew_completes_with_a_clean_trace(tmp_path):
    trace = _trace_of(SKEW_TRACE)
    ref = _reference(SKEW_TRACE)
    for seed in (1,):                       # more seeds: `ainfer-pd selftest --seeds N`
        d = tmp_path / f"skew{seed}"
        cfg = _crossed(d, faults={"phase_skew_ms": 20.0, "d_skew_random_ms": 5.0, "seed": seed})
        res = run_world(cfg, trace, 4, cell="trace", seed=0, time_scale=TIME_SCALE, timeout_s=200)
        assert res.failures == 0 and res.outputs == ref, seed
        rep = check_run_dir(d)
        assert rep["ok"], (seed, rep["violations"][:5])
        assert rep["registered_pair_overlap_ms"] == 0.0


def test_crossed_ordering_none_out_of_phase_stalls_and_the_watchdog_names_the_frontier(tmp_path):
    # the stalled collectives' threads end at the data groups' timeout (rendezvous_timeout_s): only
    # then do the ranks exit, so a shorter one than the default 30 s ends the test sooner
    cfg = _crossed(tmp_path / "none", **{"parallel.ordering": "none", "parallel.stall_timeout_s": 3.0,
                                         "parallel.rendezvous_timeout_s": 10.0,
                                         "faults": {"phase_skew_ms": 30.0}})
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as ei:
        spawn(rank_replay, 4, (cfg.to_dict(), _trace(), "trace", 0, TIME_SCALE), 150, fail_grace_s=20)
    assert time.monotonic() - t0 < 150
    errs = ei.value.results
    assert all(isinstance(e, StallError) for e in errs), [repr(e)[:200] for e in errs]
    msg = str(errs[0])
    assert "device-progress" in msg and "peers not joined" in msg
    assert "P all_reduce attn_tp.P" in msg                    # the registered pair, on the P stream
    assert "attn_dp.D" in msg or "attn_tp.D" in msg
    assert "completed requests" in msg and all(f"rank {r}:" in msg for r in range(4))


# ATP1: nothing to order (P has no attention collective): completes under ``none`` with the replicas
# out of phase. ADP1: nothing crosses, but P's and D's attention-TP all-reduces share both ranks on two
# communicators (a two-rank cycle under the one-slot stand-in, registered whenever ATP > 1): it
# completes under ``selective`` with the TP peers out of phase.
@pytest.mark.parametrize("world_size,attn_dp,ordering", [(2, 2, "none"), (2, 1, "selective")], ids=["ATP1", "ADP1"])
def test_any_axis_one_completes(tmp_path, world_size, attn_dp, ordering):
    trace = _trace_of(AXIS_ONE_TRACE)
    cfg = _crossed(tmp_path / "run", **{"parallel.world_size": world_size, "parallel.attn_dp": attn_dp,
                                        "parallel.expert_parallel": world_size, "parallel.ordering": ordering,
                                        "faults": {"phase_skew_ms": 30.0}})
    res = run_world(cfg, trace, world_size, cell="trace", seed=0, time_scale=TIME_SCALE, timeout_s=150)
    assert res.failures == 0 and res.outputs == _reference(AXIS_ONE_TRACE)
    rep = check_run_dir(tmp_path / "run")
    assert rep["ok"], rep["violations"][:5]
    assert rep["registered_pair_overlap_ms"] == 0.0
    if attn_dp == world_size:
        assert rep["pairs_checked"] == 0 and rep["per_rank"][0]["registered_p"] == 0    # nothing to order


async def _kill_rank(rank: int, world_size: int, cfg_dict: dict, kill_rank: int, kill_after_s: float, stamp: str):
    from ainfer_pd.config import WorkerConfig
    cfg = WorkerConfig.from_dict(cfg_dict)
    try:
        async with asyncio.timeout(60):
            async with RolloutWorker(cfg) as w:
                if rank == kill_rank:
                    await asyncio.sleep(kill_after_s)
                    Path(stamp).write_text(repr(time.time()))
                    os._exit(17)                             # the rank process dies mid-run
                if w.engine.dist.is_leader:
                    rng = random.Random(rank)
                    for _ in range(200):
                        ids = [rng.randrange(2, 500) for _ in range(40)]
                        await w.generate(ids, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
                # a TP follower leaves at once: its worker keeps stepping with the others until
                # every rank closes, or raises the engine's failure
    except BaseException as exc:                             # noqa: BLE001 - classified by the test
        e = exc
        while isinstance(e, BaseExceptionGroup):
            e = e.exceptions[0]
        return ("error", time.time(), type(e).__name__, str(e), isinstance(e, AInferPDError),
                isinstance(e, DistributedError), tuple(getattr(e, "ranks", ()) or getattr(e, "missing_ranks", ())))
    return ("finished", time.time(), "", "", False, False, ())


def test_killing_a_rank_mid_run_fails_the_others_naming_it(tmp_path):
    timeout = 4.0
    cfg = _crossed(tmp_path / "kill", **{"parallel.rendezvous_timeout_s": timeout, "parallel.stall_timeout_s": 3.0})
    kill_after = 3.0
    stamp = tmp_path / "killed_at"
    res = spawn(_kill_rank, 4, (cfg.to_dict(), 3, kill_after, str(stamp)), 120, return_exceptions=True,
                fail_grace_s=40)
    killed_at = float(stamp.read_text())
    assert isinstance(res[3], RankFailedError) and "died" in str(res[3])
    for r in (0, 1, 2):
        status, failed_at, name, msg, typed, dist_err, ranks = res[r]
        assert status == "error" and typed and dist_err, (r, name, msg[:300])
        assert name in (RendezvousTimeout.__name__, StallError.__name__, PeerLostError.__name__), (r, name)
        assert "rank 3" in msg or 3 in ranks, (r, msg[:300])
        assert 0 <= failed_at - killed_at <= 2 * timeout, (r, failed_at - killed_at)
