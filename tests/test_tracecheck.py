"""trace-check on hand-written traces: a clean run passes, planted violations are found."""
from __future__ import annotations

import json
from pathlib import Path

from ainfer_pd.tools.tracecheck import check_run_dir, check_traces, format_report, run, setup_parser


def _coll(phase, epoch, boundary, stream, cseq, registered=True):
    comm = "attn_tp.P" if phase == "P" else "attn_dp.D"
    return {"ev": "coll_enqueue", "phase": phase, "comm": comm, "cseq": cseq, "stream": stream, "epoch": epoch,
            "boundary": boundary, "registered": registered}


def _rank_trace(order: str, stream_p: str = "D") -> list[dict]:
    """Epoch 0, two segments, span 1: rounds at boundaries 0, 1, 2 (the last one final)."""
    ev = []
    for b in range(3):
        ev.append({"ev": "rdv1", "epoch": 0, "boundary": b, "permit": b, "rdv_s": 0.001})
        g = _coll("D", 0, b, "D", b + 1)
        p = _coll("P", 0, b, stream_p, b + 1) if b < 2 else None
        if order == "DP" or p is None:
            ev.append(g)
            ev.append({"ev": "rdv2", "epoch": 0, "boundary": b, "permit": b, "rdv_s": 0.002})
            if p:
                ev.append(p)
        else:  # P collective enqueued before the round's D launch
            if p:
                ev.append(p)
            ev.append(g)
            ev.append({"ev": "rdv2", "epoch": 0, "boundary": b, "permit": b, "rdv_s": 0.002})
        ev.append({"ev": "ack", "epoch": 0, "boundary": b, "p_running": 1 if b == 1 else 0})
    # intervals: P compute overlaps D compute; registered P all-reduce after the D all-gather
    ev += [{"ev": "work", "phase": "D", "kind": "compute", "registered": False, "t0": 0.0, "t1": 1.0},
           {"ev": "work", "phase": "P", "kind": "compute", "registered": False, "t0": 0.5, "t1": 1.5},
           {"ev": "work", "phase": "D", "kind": "coll", "registered": True, "t0": 1.0, "t1": 2.0},
           {"ev": "work", "phase": "P", "kind": "coll", "registered": True, "t0": 2.0, "t1": 3.0}]
    for i, e in enumerate(ev):
        e["seq"] = i + 1
    return ev


def _write(run_dir: Path, traces: dict[int, list[dict]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for r, evs in traces.items():
        (run_dir / f"rank{r}.jsonl").write_text("".join(json.dumps({**e, "rank": r}) + "\n" for e in evs))


def test_clean_trace_passes(tmp_path):
    _write(tmp_path, {r: _rank_trace("DP") for r in range(4)})
    rep = check_run_dir(tmp_path)
    assert rep["ok"], rep["violations"]
    assert rep["pairs_checked"] == 8
    assert rep["rendezvous_per_rank"] == 6 and rep["rounds_per_rank"] == 3
    assert abs(rep["rendezvous_mean_ms"] - 1.5) < 1e-9
    assert rep["delayed_ack_rounds"] == 4
    assert rep["registered_pair_overlap_ms"] == 0.0
    assert rep["other_p_vs_d_overlap_ms"] == 4 * 1000.0     # P compute vs D compute + D all-gather
    assert "OK" in format_report(rep)


def test_planted_opposite_direction_is_a_violation(tmp_path):
    traces = {r: _rank_trace("DP") for r in range(4)}
    traces[2] = _rank_trace("PD")            # rank 2 enqueues the P all-reduce before the D launch
    _write(tmp_path, traces)
    rep = check_run_dir(tmp_path)
    assert not rep["ok"]
    assert any("disagree" in v and "rank 2: P->D" in v for v in rep["violations"]), rep["violations"]
    p = __import__("argparse").ArgumentParser()
    setup_parser(p)
    assert run(p.parse_args([str(tmp_path)])) == 1


def test_registered_pair_on_separate_streams_has_no_device_order():
    traces = {r: _rank_trace("DP", stream_p="P") for r in range(2)}
    rep = check_traces(traces)
    assert not rep["ok"]
    assert any("unordered" in v for v in rep["violations"])


def test_isolation_only_trace_and_missing_participation_and_rdv_mismatch():
    none = [_coll("D", None, None, "D", 1), _coll("P", 0, 0, "P", 1)]
    rep = check_traces({0: none, 1: list(none)})
    assert any("no-round" in v for v in rep["violations"])
    t = {r: _rank_trace("DP") for r in range(2)}
    t[1] = [e for e in t[1] if not (e["ev"] == "coll_enqueue" and e["phase"] == "P" and e["boundary"] == 1)]
    rep = check_traces(t)
    assert any("missing on ranks [1]" in v for v in rep["violations"])
    t = {r: _rank_trace("DP") for r in range(2)}
    next(e for e in t[1] if e["ev"] == "rdv2" and e["boundary"] == 1)["permit"] = 7
    rep = check_traces(t)
    assert any("rendezvous sequences differ" in v for v in rep["violations"])


def test_cli_exit_codes(tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    setup_parser(p)
    assert run(p.parse_args([str(tmp_path / "empty")])) == 2
    _write(tmp_path / "ok", {r: _rank_trace("DP") for r in range(2)})
    assert run(p.parse_args([str(tmp_path / "ok"), "--json"])) == 0


def test_load_traces_reads_a_compressed_trace_where_a_rank_has_no_plain_one(tmp_path):
    import gzip

    from ainfer_pd.tools.tracecheck import load_traces

    with gzip.open(tmp_path / "rank1.jsonl.gz", "wt") as f:
        f.write('{"ev": "p_epoch", "epoch": 1}\n\nnot json\n')
    (tmp_path / "rank0.jsonl").write_text('{"ev": "plain"}\n')
    with gzip.open(tmp_path / "rank0.jsonl.gz", "wt") as f:     # rank 0's plain trace wins
        f.write('{"ev": "compressed"}\n')
    (tmp_path / "rankx.jsonl.gz").write_bytes(b"")              # no rank number: skipped
    traces = load_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    assert traces[0] == [{"ev": "plain"}]
    assert traces[1] == [{"ev": "p_epoch", "epoch": 1}, {"ev": "_corrupt", "raw": "not json"}]
