"""The crossed topology (g = 4, ATP2 / ADP2, EP4) inside the real lockstep engine (issues 14, 36).

Real processes, gloo, the tiny model of ``configs/tiny-crossed-cpu.yaml`` on the CPU stand-in's
device model (ARCHITECTURE.md):

* under ``selective`` the multi-rank replay's greedy tokens equal world size 1 on the Table 4 trace
  (twin conversations on the two replicas), with the ranks out of phase (30 ms by rank parity) and
  random D launch skew (5 ms), multiplexing happened (turnstile rounds, P work overlapping D) and
  ``trace-check`` finds the registered pairs in device order and never overlapping;
* the paper's Table 4 under ``none`` (communicator isolation only), ranks out of phase: ATP2 x ADP2
  stalls and the watchdog names the four-rank cycle (P's attention-TP all-reduce on two ranks, D's
  DP-attention collective on the other two), bounded (the test never hangs); ATP2 x ADP1 and
  ATP1 x ADP2 complete with tokens equal to world size 1;
* a rank killed mid-run makes every other rank fail with a typed error naming it.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
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
from ainfer_pd.tools.selftest import crossed_config, single_rank_outputs
from ainfer_pd.tools.selftest_grid import GRID_TOPOLOGIES, grid_cell
from ainfer_pd.tools.selftest_scenarios import table4_trace
from ainfer_pd.tools.world import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIME_SCALE = 0.1


@functools.lru_cache(maxsize=None)
def _table4_reference() -> dict:
    """World size 1's greedy tokens of :func:`table4_trace` (once per module; every run here uses the
    selftest's own trace: twins of 3 x 2 seed 8, 12 requests)."""
    return single_rank_outputs(table4_trace())


def _crossed(run_dir: Path, **over):
    return crossed_config(run_dir, **over)


def test_crossed_selective_replay_under_skew_equals_world_size_one_and_trace_check_is_clean(tmp_path):
    trace = table4_trace()          # the trace on which isolation only stalls (below)
    # the ranks out of phase by parity (Table 4's schedule) plus random D launch skew: one launch checks
    # both (more seeds: `ainfer-pd selftest --seeds N`)
    faults = {"phase_skew_ms": 30.0, "d_skew_random_ms": 5.0, "seed": 1}
    # every epoch that starts beside decode rows is gated (the config's mux.activation_threshold 1: at 16,
    # above every replica's own continuation, 6 / 12 / 35 tokens with the carried token, only twin
    # continuations landing in the same step switched it on, and twins a step apart, as under CPU load,
    # left every epoch exclusive and the run with no turnstile round). Gated epochs are then certain: the
    # 12-token continuations of conversations 2 / 3 arrive ~0.34 s (tool wait x TIME_SCALE) after the first
    # epoch, while conversations 4 / 5 decode 101 more tokens at >= 30 ms an iteration (the phase skew)
    res = run_world(_crossed(tmp_path / "sel", faults=faults), trace, 4,
                    cell="trace", seed=0, time_scale=TIME_SCALE, timeout_s=200)
    assert res.failures == 0 and res.completed == res.planned_requests == trace.num_requests
    ref = _table4_reference()
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


def test_table4_under_isolation_only_the_crossed_world_stalls_on_the_four_rank_cycle(tmp_path):
    """The paper's Table 4, communicator isolation only (``none``), ranks out of phase (30 ms by rank
    parity): ATP2 x ADP2 stalls at a frontier and the watchdog names the four-rank cycle; a topology
    with an axis at 1 completes (ATP2 x ADP1: P's and D's attention-TP collectives are resident
    together; ATP1 x ADP2: P issues no attention collective). The grid's three cells, each the
    ``grid_cell`` that ``run_grid`` (the selftest's loop) runs: the crossed world alone, then the two
    2-rank worlds side by side (~8 s less than in turn on 2 cores): they have no crossed pair, so
    nothing can stall them, and nothing in them is timed."""
    trace, ref = table4_trace(), _table4_reference()
    topologies = {name: (ws, d) for name, ws, d in GRID_TOPOLOGIES}

    def cell(topology: str) -> dict:
        return grid_cell(tmp_path, topology, *topologies[topology], "none", trace, ref, skew_ms=30.0, timeout_s=150)

    t0 = time.monotonic()
    cells = {"ATP2 x ADP2": cell("ATP2 x ADP2")}
    with ThreadPoolExecutor(2) as pool:
        cells.update(zip(("ATP2 x ADP1", "ATP1 x ADP2"), pool.map(cell, ("ATP2 x ADP1", "ATP1 x ADP2"))))
    assert time.monotonic() - t0 < 240
    crossed = cells["ATP2 x ADP2"]
    assert crossed["outcome"] == "stall", crossed.get("detail")
    assert 0 <= crossed["frontier_requests"] < crossed["requests"]
    cycle, held = crossed["cycle"], dict(h.split(": ", 1) for h in crossed["held"])
    assert cycle[0] == cycle[-1] and sorted(set(cycle)) == [0, 1, 2, 3], crossed["detail"]
    p_ranks = {int(r.split()[1]) for r, c in held.items() if c.startswith("P all_reduce attn_tp.P")}
    d_ranks = {int(r.split()[1]) for r, c in held.items() if c.startswith("D ") and "attn_dp.D" in c}
    # one TP peer of each replica in P's all-reduce, the other in D's DP-attention collective
    assert len(p_ranks) == len(d_ranks) == 2 and {r // 2 for r in p_ranks} == {r // 2 for r in d_ranks} == {0, 1}
    for topology in ("ATP2 x ADP1", "ATP1 x ADP2"):
        c = cells[topology]
        assert c["outcome"] == "complete" and c["tokens_equal"], (topology, c.get("detail"))
        assert c["pairs_checked"] == 0                   # nothing registered: no pair conflicts there


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
