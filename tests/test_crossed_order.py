"""The crossed-order hazard of SPEC 2 and its fix (SPEC 3.3), with real processes (gloo).

Issue 4 "Must be shown": isolation only stalls on the crossed topology (the watchdog names
the frontier), any axis set to 1 completes, selective ordering completes under 20 ms rank
skew x 5 seeds with a clean trace-check, delayed-P ACK rounds > 0, and killing a rank makes
every other rank fail with a clear error within the rendezvous timeout.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ainfer_pd.errors import DistributedError, PeerLostError, RendezvousTimeout, StallError
from ainfer_pd.metrics.tracecheck import check_run_dir
from ainfer_pd.multirank.harness import HarnessSpec, expected_rounds, run_harness
from ainfer_pd.selftest import selective_specs, stall_spec

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_crossed_isolation_only_stalls_and_watchdog_names_the_frontier(tmp_path):
    t0 = time.monotonic()
    o = run_harness(stall_spec(run_dir=str(tmp_path / "none")), timeout_s=120)
    assert time.monotonic() - t0 < 120
    errs = o.errors
    assert set(errs) == {0, 1, 2, 3}, o.results
    assert all(isinstance(e, StallError) for e in errs.values()), {r: repr(e)[:300] for r, e in errs.items()}
    # every rank that assembled the report names a P all-reduce and a D all-gather, the peers
    # that have not joined, and the device-progress cycle through all four ranks
    reported = [e for e in errs.values() if getattr(e, "cycle", None)]
    assert reported, "no rank reported the wait cycle"
    e = reported[0]
    msg = str(e)
    assert "device-progress cycle" in msg and "peers not joined" in msg
    assert "P all_reduce attn_tp.P" in msg and "D all_gather attn_dp.D" in msg
    assert sorted(set(e.cycle)) == [0, 1, 2, 3]
    fr = e.frontier
    assert set(fr) == {"0", "1", "2", "3"}
    for f in fr.values():
        assert f["d_done"] < 200                                     # stopped short of the workload
        running = [c for c in f["colls"]["inflight"] if c["state"] == "running"]
        assert len(running) == 1                                     # the one residency slot
    # the isolation-only trace has no device order for the registered pairs
    rep = check_run_dir(tmp_path / "none")
    assert not rep["ok"] and rep["violations"]


@pytest.mark.slow
@pytest.mark.parametrize("attn_dp", [4, 1], ids=["ATP1", "ADP1"])
def test_any_axis_one_completes_under_isolation_only(tmp_path, attn_dp):
    spec = stall_spec(attn_dp=attn_dp, run_dir=str(tmp_path / "run"))
    o = run_harness(spec, timeout_s=120)
    assert o.completed, {r: repr(e)[:300] for r, e in o.errors.items()}
    for res in o.runs(0):
        assert res["d_done"] == spec.d_iters and res["p_done"] == spec.epochs * spec.segments
    rep = check_run_dir(tmp_path / "run")
    assert rep["ok"] and rep["pairs_checked"] == 0          # nothing crosses: no registered pair


@pytest.mark.slow
def test_selective_under_skew_delayed_ack_and_trace_check(tmp_path):
    seeds = 5
    specs = selective_specs(tmp_path, seeds=seeds, skew_ms=20.0)
    o = run_harness(specs, timeout_s=180)
    assert o.completed, {r: repr(e)[:500] for r, e in o.errors.items()}
    total = 0
    for i, s in enumerate(specs[:seeds]):
        res = o.runs(i)
        assert {r["rounds"] for r in res} == {expected_rounds(s)}, [r["rounds"] for r in res]
        assert all(r["d_done"] >= s.d_iters for r in res)
        assert all(r["p_done"] == s.epochs * s.segments for r in res)
        total += expected_rounds(s)
        rep = check_run_dir(s.run_dir)
        assert rep["ok"], rep["violations"]
        assert rep["pairs_checked"] == 4 * s.epochs * s.segments
        assert rep["rounds_per_rank"] == expected_rounds(s)
        assert rep["registered_pair_overlap_ms"] == 0.0
    assert total == sum(expected_rounds(s) for s in specs[:seeds]) >= 5 * 20
    # delayed P completion, two residency slots: P compute overlaps D, registered pairs never do,
    # and some rounds were acknowledged while P work was still running
    d = specs[seeds]
    dres = o.runs(seeds)
    assert all(r["delayed_ack_rounds"] > 0 for r in dres), [r["delayed_ack_rounds"] for r in dres]
    rep = check_run_dir(d.run_dir)
    assert rep["ok"], rep["violations"]
    assert rep["delayed_ack_rounds"] > 0
    assert rep["registered_pair_overlap_ms"] == 0.0
    assert rep["other_p_vs_d_overlap_ms"] > 0.0
    assert all(r["overlap"]["registered_p_vs_any_d_s"] == 0.0 for r in dres)
    # global-implicit: one total order of all collectives
    g = specs[seeds + 1]
    assert {r["rounds"] for r in o.runs(seeds + 1)} == {expected_rounds(g)}
    rep = check_run_dir(g.run_dir)
    assert rep["ok"], rep["violations"]
    # every collective of both phases went onto the one collective stream
    evs = [json.loads(x) for x in (Path(g.run_dir) / "rank0.jsonl").read_text().splitlines()]
    assert {e["stream"] for e in evs if e["ev"] == "coll_enqueue"} == {"C"}


@pytest.mark.slow
def test_killing_a_rank_fails_every_other_rank_clearly_and_quickly(tmp_path):
    timeout = 4.0
    spec = HarnessSpec(ordering="selective", epochs=30, segments=4, d_iters=200, kill_rank=3, kill_after_d=6,
                       rendezvous_timeout_s=timeout, stall_s=2.5, run_dir=str(tmp_path / "kill"), tag="kill")
    t0 = time.monotonic()
    o = run_harness(spec, timeout_s=120, fail_grace_s=timeout + 10)
    assert time.monotonic() - t0 < 90
    errs = o.errors
    assert "died" in str(errs[3]) and "signal 9" in str(errs[3])
    for r in (0, 1, 2):
        e = errs[r]
        assert isinstance(e, (RendezvousTimeout, StallError, PeerLostError)), (r, repr(e))
        assert isinstance(e, DistributedError)
        assert "rank 3" in str(e) or 3 in getattr(e, "missing_ranks", ()) or 3 in getattr(e, "ranks", ()), (r, str(e))
    # bounded: every survivor gave up within the rendezvous timeout
    run_dir = tmp_path / "kill"
    def abs_time(rank: int, ev: str) -> float:
        evs = [json.loads(x) for x in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        base = next(e["t0_mono"] for e in evs if e["ev"] == "run_begin")
        return base + next(e["t"] for e in evs if e["ev"] == ev)
    killed = abs_time(3, "killed")
    for r in (0, 1, 2):
        lat = abs_time(r, "run_end") - killed
        assert 0 <= lat <= timeout, (r, lat)
