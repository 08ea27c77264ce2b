"""The ladder of record's tooling (benchmarks/ladder.py): rows owed, device-call packing, rebuilding
a cut part from its log or runs.jsonl, and the span sweep's variants."""
import json
from pathlib import Path

from ainfer_pd.tools.report import aggregate
from benchmarks import ladder


def _row(cell, policy, priority, span=None, n=3, makespan=40.0, variant=None):
    fig = {"median": makespan, "iqr": 0.1, "n": n}
    return {"cell": cell, "policy": policy, "priority": priority, "span": span, "variant": variant,
            "makespan_s": fig, "p99_ttft_s": fig, "mean_d_wait_ms": fig, "bound_ratio": fig, "rendezvous": fig}


def test_missing_runs_counts_what_each_issue_row_still_owes():
    rows = [_row("P1", "normal", "fifo"), _row("P1", "fine-grained", "fifo", n=2),
            _row("P1", "fine-grained", "critical-path", variant="lever"),       # a lever row does not count
            _row("P1", "fine-grained", "critical-path", span="2", n=3)]
    owed = {(c, p, q, s): k for c, p, q, s, k in ladder.missing_runs(rows, workloads=["paper"])}
    assert ("P1", "normal", "fifo", None) not in owed
    assert owed[("P1", "fine-grained", "fifo", None)] == 1
    assert owed[("P1", "fine-grained", "critical-path", None)] == 3
    assert ("P1", "fine-grained", "critical-path", "2") not in owed
    assert owed[("P1", "fine-grained", "critical-path", "auto")] == 3
    assert len(owed) == 2 * 5 * 2 - 1 + len(ladder.SPANS) - 1


def test_missing_runs_with_a_commit_counts_only_that_commits_rows():
    rows = [{**_row("P1", "normal", "fifo"), "commit": "old"},
            {**_row("P1", "fine-grained", "fifo", n=2), "commit": "new"}]
    owed = {(c, p, q, s): k for c, p, q, s, k in ladder.missing_runs(rows, commit="new")}
    assert owed[("P1", "normal", "fifo", None)] == 3          # measured, but under another commit
    assert owed[("P1", "fine-grained", "fifo", None)] == 1
    assert ("P1", "normal", "fifo", None) not in {k[:4] for k in ladder.missing_runs(rows)}


def test_plan_calls_fit_the_budget_and_cover_every_owed_run():
    rows = [_row("P1", "normal", "fifo")]
    owed = ladder.missing_runs(rows)
    calls = ladder.plan_calls(owed, budget_s=520, run_s=60)
    assert all(sum(p["est_s"] for p in c) <= 520 for c in calls)
    assert sum(p["runs"] for c in calls for p in c) == sum(k for *_, k in owed)
    covered = set()
    for c in calls:
        for p in c:
            names = p["env"].get("POLICIES") or p["env"]["SPANS"]
            for n in names.split(","):
                covered.add((p["part"], p["env"]["PRIORITIES"], n))
    assert ("p1", "critical-path", "normal") in covered and ("trace", "fifo", "mixed-chunked") in covered
    assert ("spans", "critical-path", "auto") in covered
    suffixes = [(p["part"], p["env"]["SUFFIX"]) for c in calls for p in c]
    assert len(set(suffixes)) == len(suffixes)          # no two parts overwrite one another's file


def test_plan_prices_each_policy_at_its_measured_run_and_splits_a_part_that_would_not_fit():
    rows = [_row(c, p, q) for c in ("P1", "trace") for p in ladder.POLICIES for q in ladder.PRIORITIES
            if not (c == "P1" and q == "fifo" and p in ("global-complete", "mixed-chunked"))]
    rows += [_row("P1", "fine-grained", "critical-path", span=k) for k in ladder.SPANS]
    (call,) = ladder.plan_calls(ladder.missing_runs(rows, workloads=["paper"]), budget_s=520)
    (part,) = call
    assert part["env"]["POLICIES"] == "global-complete,mixed-chunked" and part["runs"] == 6
    assert part["est_s"] == ladder.WARMUP_S + ladder.PART_S + 3 * (ladder.RUN_S["global-complete"]
                                                                    + ladder.RUN_S["mixed-chunked"])
    # every policy owed on P1 critical-path: more than one call's worth, split by policy in order
    owed = [("P1", p, "critical-path", None, 3) for p in ladder.POLICIES]
    parts = [p for c in ladder.plan_calls(owed, budget_s=520) for p in c]
    assert all(p["est_s"] <= 520 for p in parts) and len(parts) >= 2
    assert sorted(n for p in parts for n in p["env"]["POLICIES"].split(",")) == sorted(ladder.POLICIES)
    assert {p["est_s"] for p in ladder.plan_calls(owed, budget_s=520, run_s=10.0)[0]} == {
        ladder.WARMUP_S + ladder.PART_S + 3 * 10.0 * len(ladder.POLICIES)}


def test_the_call_driver_takes_off_the_warm_up_the_plan_put_in():
    sh = (Path(ladder.__file__).parent / "ladder_call.sh").read_text()
    assert f"${{WARMUP_S:-{ladder.WARMUP_S:.0f}}}" in sh


def test_parts_of_one_priority_with_different_repeats_owed_do_not_share_a_file():
    rows = [_row("P1", "normal", "critical-path", n=2), _row("P1", "global-complete", "critical-path", n=1)]
    calls = ladder.plan_calls(ladder.missing_runs(rows), budget_s=520, run_s=60)
    names = [(p["part"], p["env"]["SUFFIX"]) for c in calls for p in c]
    assert len(set(names)) == len(names)


def test_a_cut_part_is_rebuilt_from_its_printed_per_run_lines(tmp_path):
    log = tmp_path / "ladder.log"
    log.write_text("\n".join([
        "+ (warm-up) python -m ainfer_pd.cli bench --repeats 1",
        "[1/1] P1 normal #1: makespan 9.0 s, 0.89 req/s, p99 TTFT 0.1 s, D wait 0.6 ms, failures 0",
        "+ python -m ainfer_pd.cli bench --cells P1 --policies normal,fine-grained --repeats 2",
        "[1/4] P1 normal #1: makespan 50.0 s, 5.0 req/s, p99 TTFT 2.0 s, D wait 5.0 ms, failures 0",
        "    D iters 2505: build 1.12 ms",
        "[2/4] P1 fine-grained+critical-path #1: makespan 44.0 s, 5.5 req/s, p99 TTFT 2.4 s, D wait 1.5 ms, failures 0",
        "[3/4] P1 normal #2: makespan 52.0 s, 4.8 req/s, p99 TTFT 2.2 s, D wait 5.4 ms, failures 0",
        "[4/4] P1 fine-grained+critical-path #2: makespan 46.0 s, 5.3 req/s, p99 TTFT 2.6 s, D wait 1.7 ms, failures 0",
    ]))
    assert ladder.main(["from-log", str(log), "--commit", "abc", "--part", "cut", "--out", str(tmp_path)]) == 0
    part = json.loads((tmp_path / "ladder_cut.json").read_text())
    rows = {(r["policy"], r["priority"]): r for r in part["rows"]}
    assert rows[("normal", "fifo")]["makespan_s"] == {"median": 51.0, "iqr": 1.0, "n": 2}   # the warm-up is skipped
    assert abs(rows[("fine-grained", "critical-path")]["mean_d_wait_ms"]["median"] - 1.6) < 1e-9
    assert rows[("normal", "fifo")]["bound_ratio"]["median"] is None                      # not printed
    assert part["command"].startswith("python -m ainfer_pd.cli bench --cells P1")
    names = {t["name"] for t in part["targets"]}
    assert "P1: fine-grained (critical-path) / normal-fifo makespan" in names


def test_the_span_sweep_runs_under_every_requested_priority():
    from ainfer_pd.tools import bench
    vs = bench.make_variants(["fine-grained"], spans=["1", "measured"], priorities=["critical-path"])
    assert [v.name for v in vs] == ["fine-grained+critical-path", "fine-grained/K=1+critical-path",
                                    "fine-grained/K=measured+critical-path"]
    assert [ladder.parse_variant(v.name) for v in vs][1:] == [("fine-grained", "critical-path", "1"),
                                                              ("fine-grained", "critical-path", "measured")]


def test_the_span_targets_judge_auto_and_the_ladder_s_measured_span_against_the_best_fixed_span():
    rows = [_row("P1", "fine-grained", "critical-path", span=k, makespan=m)
            for k, m in (("1", 50.0), ("2", 46.0), ("3", 47.0), ("4", 48.0), ("auto", 47.0))]
    rows.append(_row("P1", "fine-grained", "critical-path", makespan=44.0))          # mux.span=measured
    t = {x["name"]: x for x in ladder.targets(rows)}
    assert t["P1: span auto / best fixed span makespan"]["value"] == round(47.0 / 46.0, 4)
    assert not t["P1: span auto / best fixed span makespan"]["met"]
    assert t["P1: span measured (critical-path) / best fixed span makespan"]["met"]


def _merged(tmp_path, rows_a: list, rows_b: list) -> dict:
    """``ladder.py merge`` of part a (commit aaa) then part b (commit bbb); the merged document."""
    a = {"commit": "aaa", "config": "c", "machine": "m", "part": "a", "command": "x", "rc": 0, "wall_s": 1,
         "workload": None, "rows": rows_a}
    b = {**a, "commit": "bbb", "part": "b", "rows": rows_b}
    for d in (a, b):
        (tmp_path / f"{d['part']}.json").write_text(json.dumps(d))
    out = tmp_path / "latest.json"
    assert ladder.main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_merge_keeps_each_row_s_commit(tmp_path):
    doc = _merged(tmp_path, [_row("P1", "normal", "fifo")], [_row("P1", "fine-grained", "critical-path", makespan=30.0)])
    assert doc["commit"] == ["aaa", "bbb"] and [r["commit"] for r in doc["rows"]] == ["aaa", "bbb"]
    assert [p["commit"] for p in doc["parts"]] == ["aaa", "bbb"]


def test_merge_a_later_part_supersedes_the_same_row(tmp_path):
    doc = _merged(tmp_path, [_row("trace", "normal", "fifo", makespan=53.0), _row("P1", "normal", "fifo")],
                  [_row("trace", "normal", "fifo", makespan=51.0)])
    trace = [r for r in doc["rows"] if r["cell"] == "trace"]
    assert len(trace) == 1 and trace[0]["commit"] == "bbb" and trace[0]["makespan_s"]["median"] == 51.0
    assert [r["cell"] for r in doc["rows"]].count("P1") == 1
    assert [(r["commit"], r["superseded_by"]) for r in doc["superseded"]] == [("aaa", "bbb")]


def test_merged_targets_do_not_compare_rows_of_different_commits(tmp_path):
    """A merge of parts holds rows of several commits: a ratio across two of them says nothing of
    either data path, so it is reported with its commits and neither met nor missed."""
    doc = _merged(tmp_path, [_row("trace", "mixed-chunked", "fifo", makespan=47.0)],
                  [_row("trace", "normal", "fifo", makespan=48.0),
                   _row("trace", "fine-grained", "critical-path", makespan=41.0)])
    t = {x["name"]: x for x in doc["targets"]}
    same = t["trace: fine-grained (critical-path) / normal-fifo makespan"]
    assert same["met"] is False and "commits" not in same
    across = t["trace: fine-grained (critical-path) / mixed-chunked-fifo makespan"]
    assert across["met"] is None and across["commits"] == ["aaa", "bbb"] and across["value"] == round(41 / 47, 4)


def _part(tmp_path, name, commit, rows):
    path = tmp_path / f"ladder_{name}.json"
    path.write_text(json.dumps({"commit": commit, "config": "c.yaml", "machine": "m", "part": name, "rows": rows}))
    return str(path)


def _run_row(policy, priority, makespans, variant=None, bound=1.0):
    runs = [{"makespan_s": m, "ttft_p99_s": 1.0, "d_wait_mean_s": 0.001, "bound_ratio": bound, "rendezvous": 0}
            for m in makespans]
    name = policy if priority == "fifo" else f"{policy}+{priority}"
    res = {"aggregates": {"trace": {name: aggregate(runs)}}, "summaries": {"trace": {name: runs}}}
    return ladder.rows_of(res, variant=variant)


def test_merge_pools_the_repeats_of_one_row_from_two_parts_of_one_commit(tmp_path):
    a = _part(tmp_path, "a", "c1", _run_row("normal", "fifo", [36.0]))
    b = _part(tmp_path, "b", "c1", _run_row("normal", "fifo", [40.0, 38.0]))
    c = _part(tmp_path, "c", "c2", _run_row("fine-grained", "fifo", [30.0]))
    out = tmp_path / "latest.json"
    assert ladder.main(["merge", a, b, c, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    row = next(r for r in doc["rows"] if r["policy"] == "normal")
    assert row["makespan_s"]["median"] == 38.0 and row["makespan_s"]["n"] == 3
    assert row["makespan_s"]["iqr"] == 2.0 and not doc["superseded"]
    # another commit's row of the same key supersedes instead of pooling
    d = _part(tmp_path, "d", "c3", _run_row("normal", "fifo", [50.0]))
    assert ladder.main(["merge", a, b, d, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert next(r for r in doc["rows"] if r["policy"] == "normal")["makespan_s"]["median"] == 50.0
    assert len(doc["superseded"]) == 1


def test_targets_on_a_data_path_judge_its_rows_and_name_the_stand_ins():
    dp = "scheduler.overlap_decode=true"
    rows = [*_run_row("normal", "fifo", [40.0], variant=dp, bound=1.25),
            *_run_row("normal", "fifo", [50.0]),                                    # plain: not on the path
            *_run_row("mixed-chunked", "fifo", [45.0]),                             # refuses the path: stands in
            *_run_row("fine-grained", "critical-path", [34.0], variant=dp, bound=1.0),
            *_run_row("fine-grained", "critical-path", [33.0], variant=f"{dp}+mux.exclusive_backlog_tokens=16384",
                      bound=1.1),
            *_run_row("fine-grained", "critical-path", [20.0], variant="mux.span=1")]  # another path: ignored
    for r in rows:
        r["commit"] = "c1"
    got = {t["name"]: t for t in ladder.targets(rows, data_path=dp)}
    t = got[f"[{dp}] trace: fine-grained (critical-path) / normal-fifo makespan"]
    assert t["value"] == 0.85 and t["met"] is False and t["floor"] == 0.85      # its bound ratio is 1: at the floor
    lever = f"[{dp}] trace: fine-grained (critical-path, mux.exclusive_backlog_tokens=16384) / normal-fifo makespan"
    assert got[lever]["value"] == 0.825 and got[lever]["floor"] == 0.75
    mixed = got[f"[{dp}] trace: fine-grained (critical-path) / mixed-chunked-fifo makespan"]
    assert round(mixed["value"], 4) == round(34 / 45, 4) and mixed["stand_ins"] == [
        f"mixed-chunked-fifo: its plain row (no {dp} row)"]
    assert not t["stand_ins"]
    # without the data path, the plain rows are judged (here: none of fine-grained's)
    assert not any("fine-grained" in t["name"] for t in ladder.targets(rows))


def test_merge_drops_the_commit_s_defaults_from_a_variant_and_judges_the_default_path(tmp_path):
    """A row run with a setting that is its commit's default (``scheduler.overlap_decode=auto`` after
    it became one) is a plain row once ``--defaults`` names it; ``--data-path default`` judges the
    plain rows and fine-grained's lever rows on top of them."""
    auto = "scheduler.overlap_decode=auto"
    lever = "mux.exclusive_wait_s=1.0"
    a = _part(tmp_path, "a", "c1", _run_row("normal", "fifo", [40.0, 38.0], variant=auto))
    b = _part(tmp_path, "b", "c1", _run_row("normal", "fifo", [39.0]))
    c = _part(tmp_path, "c", "c1", _run_row("fine-grained", "critical-path", [34.0], variant=f"{auto}+{lever}"))
    out = tmp_path / "latest.json"
    assert ladder.main(["merge", a, b, c, "--out", str(out), "--defaults", auto, "--data-path", "default"]) == 0
    doc = json.loads(out.read_text())
    normal = next(r for r in doc["rows"] if r["policy"] == "normal")
    assert normal["variant"] is None and normal["makespan_s"]["n"] == 3 and normal["makespan_s"]["median"] == 39.0
    assert next(r for r in doc["rows"] if r["policy"] == "fine-grained")["variant"] == lever
    got = {t["name"]: t for t in doc["targets_data_path"]}
    t = got[f"[default] trace: fine-grained (critical-path, {lever}) / normal-fifo makespan"]
    assert t["value"] == round(34 / 39, 4) and t["met"] is False and not t["stand_ins"]
    # the plain targets still judge plain rows only: the lever row is not among them
    assert not any("fine-grained" in x["name"] for x in doc["targets"])
    # without --defaults the auto row is a lever row of normal, which the default path does not take
    assert ladder.main(["merge", a, c, "--out", str(out), "--data-path", "default"]) == 0
    doc = json.loads(out.read_text())
    assert not any("normal-fifo" in x["name"] for x in doc["targets_data_path"])
    # a fine-grained row of another lever set is judged on the default path as well; the plain path's
    # rows (variant None) are the base
    rows = [*_run_row("normal", "fifo", [40.0]),
            *_run_row("fine-grained", "critical-path", [30.0], variant="mux.span=1")]
    for r in rows:
        r["commit"] = "c1"
    names = [x["name"] for x in ladder.targets(rows, data_path="default")]
    assert "[default] trace: fine-grained (critical-path, mux.span=1) / normal-fifo makespan" in names


def test_rebound_from_log_leaves_the_set_up_items_out_of_the_work_terms(tmp_path, capsys):
    from benchmarks import rebound_from_log
    log = tmp_path / "l.out"
    log.write_text(
        "+ (warm-up) python -m ainfer_pd.cli bench --conversations 4\n"
        "[1/1] trace normal #1: makespan 5.714 s, 1.40 req/s, p99 TTFT 0.094 s, D wait 0.709 ms, failures 0\n"
        "    D.iter n=25 mean 11.25 max 22.0 sum 0.28 s | slowest: D.iter at 1.87 s 22.0 ms\n"
        "+ python -m ainfer_pd.cli bench --conversations 64\n"
        "[1/1] trace normal #1: makespan 38.502 s, 6.49 req/s, p99 TTFT 1.760 s, D wait 4.009 ms, failures 0\n"
        "    D iters 2570: build 0.43 ms | P epochs 167: 68.62 ms mean | busy 0.96, concurrent 0.01\n"
        "    D.iter n=2570 mean 11.25 max 22.0 sum 28.91 s; D.capture n=1 mean 5143.09 max 5143.1 sum 5.14 s; "
        "P.attn n=8016 mean 0.54 max 13.0 sum 4.30 s; P.experts n=8016 mean 0.41 max 4.3 sum 3.25 s; "
        "P.warmup n=1 mean 3208.59 max 3208.6 sum 3.21 s | slowest: D.iter at 12.87 s 22.0 ms\n")
    got = list(rebound_from_log.runs(log.read_text().splitlines()))
    assert got == [("trace normal", 1, 38.502, 4.30 + 3.25, 28.91, 5.14 + 3.21)]
    assert rebound_from_log.main([str(log), "--chain-s", "30"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.split()[-2:] == ["30.00", f"{38.502 / 30:.3f}"]


def test_a_ladder_part_runs_bench_and_keeps_each_run_s_bound_terms_records_and_plots(tmp_path):
    """``ladder.py run`` end to end on the tiny CPU model: the part's rows keep, per run, the bound's
    terms and the device fractions besides the figures; runs.jsonl and bench's plots (the first
    repeat's timeline per variant) land beside the part, where a device call's tarball finds them."""
    out, work = tmp_path / "out", tmp_path / "work"
    rc = ladder.main(["run", "--config", "configs/tiny-cpu.yaml", "--cells", "P1", "--policies", "normal,fine-grained",
                      "--priorities", "fifo", "--repeats", "1", "--conversations", "2", "--max-turns", "2",
                      "--token-scale", "0.05", "--no-warmup", "--commit", "abc", "--part", "t",
                      "--out", str(out), "--work", str(work)])
    assert rc == 0
    part = json.loads((out / "ladder_t.json").read_text())
    assert {(r["policy"], r["priority"]) for r in part["rows"]} == {("normal", "fifo"), ("fine-grained", "fifo")}
    for row in part["rows"]:
        (run,) = row["runs"]
        assert run["d_work_s"] > 0 and run["p_work_s"] > 0 and 0 < run["busy_fraction"] <= 1
        assert run["bound_s"] == max(run["p_work_s"], run["d_work_s"], run["chain_s"])
        assert abs(run["makespan_s"] / run["bound_s"] - run["bound_ratio"]) < 1e-9
    lines = (out / "runs_t.jsonl").read_text().splitlines()
    assert [json.loads(x)["variant"] for x in lines] == ["normal", "fine-grained"]
    assert (out / "t_P1_timeline_fine-grained.png").stat().st_size > 0


def test_a_ladder_call_runs_parts_while_its_budget_lasts_and_keeps_a_cut_parts_runs(tmp_path):
    """benchmarks/ladder_call.sh with a stand-in for h200_ladder.sh: the parts that fit run in order
    (the first with the warm-up, the rest NO_WARMUP=1), one that no longer fits is skipped, one cut
    by the budget keeps its runs.jsonl, and everything comes back in one r.tgz."""
    import subprocess
    import tarfile
    stub = tmp_path / "stub.sh"
    stub.write_text('echo "part $2 commit $1 nw=${NO_WARMUP:-}"\n'
                    'mkdir -p "$WORK"; echo "{}" > "$WORK/runs.jsonl"\n'
                    'sleep "${SLEEP:-0}"\n')
    out = tmp_path / "out"
    out.mkdir()
    # budget 4 s: a (est 1) runs; b (est 36 - 35 warm-up = 1) runs and is cut at the budget;
    # c (est 500) no longer fits
    specs = ["1|SUFFIX=a|p1", "36|SLEEP=30 SUFFIX=b|trace", "500|SUFFIX=c|p1"]
    res = subprocess.run(["bash", "benchmarks/ladder_call.sh", "abc", "4", *specs], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(out),
                                                     "LADDER_SH": str(stub), "WARMUP_S": "35"})
    assert res.returncode == 0, res.stderr
    assert [ln.split()[-1] for ln in res.stdout.splitlines() if ln.startswith("SKIP")] == ["p1"]
    assert "SUFFIX=c" in res.stdout.split("SKIP")[1]
    assert "rc 0" in res.stdout and "rc 124" in res.stdout
    with tarfile.open(out / "r.tgz") as tf:
        names = {n.split("/")[-1] for n in tf.getnames()}
        a_out = tf.extractfile("r/a.out").read().decode()
        b_out = tf.extractfile("r/b.out").read().decode()
    assert a_out.strip() == "part p1 commit abc nw=" and b_out.strip() == "part trace commit abc nw=1"
    assert "cut_b_runs.jsonl.gz" in names and "cut_a_runs.jsonl.gz" not in names and "c.out" not in names


def test_a_ladder_call_part_with_a_trace_dir_brings_back_its_timeline_split(tmp_path):
    """A part run with TRACE_DIR gets the timeline's split of its trace (through ``python -m
    ainfer_pd.tools``: the device has no ainfer-pd script) in r/SUFFIX_timeline.txt; a part without one
    gets none."""
    import subprocess
    import tarfile
    stub = tmp_path / "stub.sh"
    stub.write_text('echo "part $2"; if [ -n "${TRACE_DIR:-}" ]; then mkdir -p "$TRACE_DIR"; fi\n')
    py = tmp_path / "py.sh"
    py.write_text('#!/bin/bash\necho "python $*"\n')
    py.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    tr = tmp_path / "tr_fg"
    res = subprocess.run(["bash", "benchmarks/ladder_call.sh", "abc", "600", "1|SUFFIX=a|p1",
                          f"1|REPEATS=1 TRACE_DIR={tr} SUFFIX=fg|p1"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(out), "LADDER_SH": str(stub), "WARMUP_S": "0",
                              "PYTHON": str(py)})
    assert res.returncode == 0, res.stderr
    assert "timeline rc 0 -> fg_timeline.txt" in res.stdout
    with tarfile.open(out / "r.tgz") as tf:
        names = {n.split("/")[-1] for n in tf.getnames()}
        text = tf.extractfile("r/fg_timeline.txt").read().decode().strip()
    assert text == f"python -m ainfer_pd.tools timeline {tr} --split --items"
    assert "a_timeline.txt" not in names


def test_a_ladder_call_killed_mid_part_still_leaves_the_parts_before_it_packed(tmp_path):
    """The device kills a command at its limit with everything in it: the parts done by then are already in
    $OUT/r.tgz (packed after each part from a folder outside $OUT), and nothing else is left under $OUT."""
    import os
    import signal
    import subprocess
    import tarfile
    import time
    stub = tmp_path / "stub.sh"
    stub.write_text('echo "part $2"; sleep "${SLEEP:-0}"\n')
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(["bash", "benchmarks/ladder_call.sh", "abc", "600", "1|SUFFIX=a|p1",
                             "1|SLEEP=60 SUFFIX=b|trace"], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "OUT": str(out), "LADDER_SH": str(stub), "WARMUP_S": "0"})
    deadline = time.time() + 30
    while not (out / "r.tgz").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert sorted(p.name for p in out.iterdir()) == ["r.tgz"]
    with tarfile.open(out / "r.tgz") as tf:
        assert tf.extractfile("r/a.out").read().decode().strip() == "part p1"


def test_the_merged_table_shows_the_last_trajectory_s_chain_of_each_row(tmp_path, capsys):
    runs = [{"makespan_s": m, "ttft_p99_s": 1.0, "d_wait_mean_s": 0.001, "bound_ratio": 1.0, "rendezvous": 0}
            for m in (36.0, 37.0, 38.0)]
    for r, ms in zip(runs, (13.0, 11.0)):       # the third run predates report.last_chain
        r.update(last_traj_tokens=2488, last_traj_decode_s=ms * 2.488, last_traj_token_ms=ms)
    res = {"aggregates": {"trace": {"normal": aggregate(runs)}}, "summaries": {"trace": {"normal": runs}}}
    rows = ladder.rows_of(res)
    a = _part(tmp_path, "a", "c1", rows)
    b = _part(tmp_path, "b", "c1", _run_row("fine-grained", "fifo", [30.0]))
    assert ladder.main(["merge", a, b, "--out", str(tmp_path / "latest.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("chain ms/token")
    assert next(ln for ln in lines if "normal" in ln).endswith("12.00 (2/3)")
    assert next(ln for ln in lines if "fine-grained" in ln).endswith("-")


def test_a_ladder_call_gates_its_commit_first_and_a_failed_gate_ends_the_call(tmp_path):
    """PART ``gate`` runs the gate (a stand-in for gpu_gate.sh here) with its files under r/SUFFIX/;
    the ladder part after a passing gate still takes the warm-up; after a failing one nothing runs."""
    import subprocess
    import tarfile
    stub = tmp_path / "stub.sh"
    stub.write_text('echo "part $2 commit $1 nw=${NO_WARMUP:-}"\n')
    gate = tmp_path / "gate.sh"
    gate.write_text('mkdir -p "$OUT"; echo "{\\"commit\\": \\"$1\\"}" > "$OUT/latest.json"; exit "${GATE_RC:-0}"\n')

    def call(out, rc):
        out.mkdir()
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "LADDER_SH": str(stub), "GATE_SH": str(gate)}
        res = subprocess.run(["bash", "benchmarks/ladder_call.sh", "abc", "600", f"190|GATE_RC={rc} SUFFIX=g|gate",
                              "100|SUFFIX=a|p1"], capture_output=True, text=True, timeout=60, env=env)
        assert res.returncode == 0, res.stderr
        with tarfile.open(out / "r.tgz") as tf:
            files = {n: tf.extractfile(n).read().decode() for n in tf.getnames() if tf.getmember(n).isfile()}
        return res.stdout, files

    stdout, files = call(tmp_path / "pass", 0)
    assert "gate rc 0" in stdout and json.loads(files["r/g/latest.json"]) == {"commit": "abc"}
    assert files["r/a.out"].strip() == "part p1 commit abc nw="        # the first ladder part: warm-up
    stdout, files = call(tmp_path / "fail", 3)
    assert "gate rc 3" in stdout and "GATE FAILED" in stdout and "r/a.out" not in files


# --------------------------------------------------------------------------- the long-context workload (issue 33)
def test_the_long_context_workload_s_rows_are_owed_beside_the_trace_s():
    rows = [_row("P1", p, q) for p in ladder.POLICIES for q in ladder.PRIORITIES]
    rows += [_row("grpo-long/P1", "normal", "fifo"), _row("grpo-long/trace", "fine-grained", "critical-path", n=1)]
    owed = {(c, p, q, s): k for c, p, q, s, k in ladder.missing_runs(rows)}
    grpo = {k: v for k, v in owed.items() if k[0].startswith("grpo-long/")}
    assert len(grpo) == 2 * len(ladder.GRPO_ROWS) - 1
    assert ("grpo-long/P1", "normal", "fifo", None) not in grpo
    assert grpo[("grpo-long/trace", "fine-grained", "critical-path", None)] == 2
    assert grpo[("grpo-long/P1", "mixed-chunked", "fifo", None)] == 3
    assert ("grpo-long/P1", "mixed-chunked", "critical-path", None) not in grpo     # fifo only, but for two
    # a P1 row of the trace does not count for the long-context workload's P1, nor the reverse
    assert ("P1", "normal", "fifo", None) not in owed and ("trace", "normal", "fifo", None) in owed
    only = ladder.missing_runs(rows, workloads=["grpo-long"])
    assert {c for c, *_ in only} == set(ladder.GRPO_CELLS)
    assert not any(c.startswith("grpo-long/") for c, *_ in ladder.missing_runs(rows, workloads=["paper"]))
    import pytest
    with pytest.raises(ValueError):
        ladder.missing_runs(rows, workloads=["nope"])


def test_plan_packs_the_long_context_rows_into_its_own_parts():
    owed = ladder.missing_runs([], workloads=["grpo-long"])
    calls = ladder.plan_calls(owed, budget_s=520)
    parts = [p for c in calls for p in c]
    assert {p["part"] for p in parts} == {"grpo-long-p1", "grpo-long-trace"}
    assert all(sum(p["est_s"] for p in c) <= 520 for c in calls)
    assert sum(p["runs"] for p in parts) == 3 * 2 * len(ladder.GRPO_ROWS)
    for p in parts:             # priced at the long-context workload's run, not the trace's
        names = p["env"]["POLICIES"].split(",")
        assert p["est_s"] == ladder.WARMUP_S + ladder.PART_S + 3 * sum(ladder.GRPO_RUN_S[n] for n in names)
    sh = (Path(ladder.__file__).parent / "h200_ladder.sh").read_text()
    assert "grpo-long-p1|grpo-long-trace)" in sh and "--workload grpo-long" in sh


def test_plan_prints_the_long_context_parts(tmp_path, capsys):
    latest = tmp_path / "latest.json"
    rows = [_row(c, p, q) for c in ladder.CELLS for p in ladder.POLICIES for q in ladder.PRIORITIES]
    rows += [_row("P1", "fine-grained", "critical-path", span=k) for k in ladder.SPANS]
    latest.write_text(json.dumps({"rows": rows}))
    assert ladder.main(["plan", "--latest", str(latest)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{2 * len(ladder.GRPO_ROWS)} rows owed")
    assert "bash benchmarks/h200_ladder.sh COMMIT grpo-long-p1" in out and "grpo-long-trace" in out
    assert ladder.main(["plan", "--latest", str(latest), "--workloads", "paper"]) == 0
    assert capsys.readouterr().out.startswith("0 rows owed")


def test_rows_of_a_long_context_bench_and_its_targets():
    runs = {"normal": ([50.0, 52.0], 1.10), "fine-grained": ([38.0, 40.0], 1.25),
            "mixed-chunked": ([47.0], 1.15)}
    res = {"aggregates": {}, "summaries": {}}
    for cell in ("P1", "trace"):
        for name, (ms, bound) in runs.items():
            rr = [{"makespan_s": m, "ttft_p99_s": 1.0, "d_wait_mean_s": 0.001, "bound_ratio": bound, "rendezvous": 0}
                  for m in ms]
            res["summaries"].setdefault(cell, {})[name] = rr
            res["aggregates"].setdefault(cell, {})[name] = aggregate(rr)
    rows = ladder.rows_of(res, workload="grpo-long")
    assert {r["cell"] for r in rows} == {"grpo-long/P1", "grpo-long/trace"}
    assert {r["cell"] for r in ladder.rows_of(res)} == {"P1", "trace"}                   # the trace's as before
    assert {r["cell"] for r in ladder.rows_of(res, decode_only=True)} == {"decode-only/P1", "decode-only/trace"}
    for r in rows:
        r["commit"] = "c1"
    t = {x["name"]: x for x in ladder.targets(rows)}
    ratio = t["grpo-long/P1: fine-grained (fifo) / normal-fifo makespan"]
    assert ratio["value"] == round(39 / 51, 4) and ratio["met"] and ratio["target"] == 0.80
    for policy, (_, bound) in runs.items():
        b = t[f"grpo-long/trace: {policy} (fifo) makespan / optimistic bound"]
        assert b["value"] == bound and b["target"] == 1.2 and b["met"] == (bound <= 1.2)
    assert "grpo-long/P1: fine-grained (fifo) makespan / optimistic bound" in t
    assert not any(n.startswith("grpo-long/") and "1.3" in str(x["target"]) for n, x in t.items())
    # the same rows as the trace's: the trace's targets keep fine-grained's own bound (1.3) only
    plain = ladder.rows_of(res)
    for r in plain:
        r["commit"] = "c1"
    tp = {x["name"]: x for x in ladder.targets(plain)}
    assert tp["P1: fine-grained (fifo) makespan / optimistic bound"]["target"] == 1.3
    assert "P1: normal (fifo) makespan / optimistic bound" not in tp


def test_the_ladder_of_record_still_loads_and_keeps_its_rows_and_targets():
    doc = json.loads((Path(ladder.__file__).parents[1] / "docs/results/ladder/latest.json").read_text())
    rows = doc["rows"]
    assert not any(r["cell"].startswith("grpo-long/") for r in rows)
    got = {t["name"]: (t["value"], t["met"]) for t in ladder.targets(rows)}
    want = {t["name"]: (t["value"], t["met"]) for t in doc["targets"]}
    assert got == want
    owed = ladder.missing_runs(rows)
    assert {c for c, *_ in owed} >= set(ladder.GRPO_CELLS)
    assert ladder.missing_runs(rows, workloads=["paper"]) == [k for k in owed if not k[0].startswith("grpo-long/")]


def test_a_long_context_ladder_part_runs_bench_on_the_tiny_model(tmp_path, capsys):
    """``ladder.py run --workload grpo-long`` end to end at a tiny size: the bench (and its warm-up,
    with the part's settings and its response budget) gets the workload, the part's rows are
    grpo-long/P1 and its workload is recorded."""
    out, work = tmp_path / "out", tmp_path / "work"
    rc = ladder.main(["run", "--config", "configs/tiny-cpu.yaml", "--cells", "P1", "--policies", "normal",
                      "--priorities", "fifo", "--repeats", "1", "--conversations", "4", "--max-turns", "2",
                      "--token-scale", "0.02", "--commit", "abc", "--part", "g", "--set", "mux.span=1",
                      "--workload", "grpo-long", "--group-size", "2", "--out", str(out), "--work", str(work),
                      "--response-budget", "24", "--eos-every", "8"])
    assert rc == 0
    warm = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("+ (warm-up)"))
    assert warm.endswith("--workload grpo-long --group-size 2 --set mux.span=1 --response-budget 24 --eos-every 8")
    part = json.loads((out / "ladder_g.json").read_text())
    assert [(r["cell"], r["policy"]) for r in part["rows"]] == [("grpo-long/P1", "normal")]
    assert "--workload grpo-long --group-size 2" in part["command"]
    assert part["workload"]["workload"] == "grpo-long" and part["workload"]["group_size"] == 2
    assert part["workload"]["trace"]["meta"]["kind"] == "grpo-long"
    assert part["workload"]["trace"]["meta"]["response_budget"] == 24 and "--eos-every 8" in part["command"]
    assert any(t["name"] == "grpo-long/P1: normal (fifo) makespan / optimistic bound" for t in part["targets"])


def test_from_log_labels_a_long_context_part(tmp_path):
    log = tmp_path / "g.log"
    log.write_text("+ python -m ainfer_pd.cli bench --workload grpo-long --cells P1\n"
                   "[1/1] P1 normal #1: makespan 50.0 s, 5.0 req/s, p99 TTFT 2.0 s, D wait 5.0 ms, failures 0\n")
    assert ladder.main(["from-log", str(log), "--commit", "abc", "--part", "g", "--out", str(tmp_path),
                        "--workload", "grpo-long"]) == 0
    part = json.loads((tmp_path / "ladder_g.json").read_text())
    assert [r["cell"] for r in part["rows"]] == ["grpo-long/P1"] and part["workload"] == {"workload": "grpo-long"}


def test_h200_ladder_runs_the_long_context_parts_with_their_own_settings(tmp_path):
    """h200_ladder.sh's grpo-long parts (a stand-in python on PATH prints what it was given): the
    workload, its cell, 6 turns, graphs over the 16K context and the KV pool; p1 keeps its own."""
    import subprocess
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python").write_text('#!/bin/sh\necho "ARGS $*"\n')
    (bin_ / "python").chmod(0o755)

    def args(part, **env):
        res = subprocess.run(["bash", "benchmarks/h200_ladder.sh", "abc", part], capture_output=True, text=True,
                             timeout=60, env={"PATH": f"{bin_}:/usr/bin:/bin", "OUT": str(tmp_path / "o"), **env})
        assert res.returncode == 0, res.stderr
        (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("ARGS ")]
        return line.split()[1:]

    def last(a, flag, prefix=""):
        return [a[i + 1] for i, x in enumerate(a[:-1]) if x == flag and a[i + 1].startswith(prefix)][-1]

    g = args("grpo-long-trace", POLICIES="normal,fine-grained", PRIORITIES="fifo", SUFFIX="x")
    assert g[:2] == ["benchmarks/ladder.py", "run"]
    assert last(g, "--workload") == "grpo-long" and last(g, "--group-size") == "8" and last(g, "--cells") == "trace"
    assert last(g, "--max-turns") == "6" and last(g, "--conversations") == "64" and last(g, "--part") == "grpo-long-trace-x"
    assert last(g, "--set", "device.graph_max_context=") == "device.graph_max_context=16384"
    assert not [x for x in g if x.startswith("cache.gpu_memory_fraction=")]       # the config's own KV fraction
    assert last(g, "--policies") == "normal,fine-grained" and last(g, "--priorities") == "fifo"
    g = args("grpo-long-p1", GROUP="4", TURNS="3", GMEM="0.7")
    assert last(g, "--cells") == "P1" and last(g, "--group-size") == "4" and last(g, "--max-turns") == "3"
    assert last(g, "--set", "cache.gpu_memory_fraction=") == "cache.gpu_memory_fraction=0.7"
    p = args("p1")
    assert "--workload" not in p and last(p, "--max-turns") == "4"
    lv = args("lever", LEVER="model.quantization=fp8+cache.kv_dtype=fp8_e4m3", CELL="trace")   # ladder_call's specs
    assert last(lv, "--set", "model.") == "model.quantization=fp8"                    # split on spaces: + joins
    assert last(lv, "--set", "cache.") == "cache.kv_dtype=fp8_e4m3" and last(lv, "--cells") == "trace"
    assert last(p, "--set", "device.graph_max_context=") == "device.graph_max_context=8192"
    b = args("grpo-long-p1", BUDGET="2048", EOS_EVERY="150", SETS="cache.reserve_output=estimate")
    assert last(b, "--response-budget") == "2048" and last(b, "--eos-every") == "150"
    assert last(b, "--set", "cache.reserve_output=") == "cache.reserve_output=estimate"
    assert last(b, "--variant") == "cache.reserve_output=estimate+response_budget=2048+eos_every=150"
    assert last(args("p1", BUDGET="512"), "--variant") == "response_budget=512"
    assert "--variant" not in p and "--response-budget" not in p



def test_a_ladder_call_sweeps_kernels_after_its_gate(tmp_path):
    """PART ``sweep``: kernel_sweep.py (a stand-in here) with the spec's SECTIONS, its budget the
    estimate less 20 s, its output and JSON under r/; no warm-up is charged to it."""
    import subprocess
    import sys
    import tarfile
    gate = tmp_path / "gate.sh"
    gate.write_text('mkdir -p "$OUT"; exit 0\n')
    sweep = tmp_path / "sweep.py"
    sweep.write_text('import json, sys\nprint("args", " ".join(sys.argv[1:]))\n'
                     'open(sys.argv[sys.argv.index("--out") + 1], "w").write(json.dumps({"ok": 1}))\n')
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "GATE_SH": str(gate), "SWEEP_PY": str(sweep),
           "PYTHON": sys.executable, "WARMUP_S": "45"}
    res = subprocess.run(["bash", "benchmarks/ladder_call.sh", "abc", "600", "100|SUFFIX=g|gate",
                          "150|SECTIONS=prefilltma,moetma4096 SUFFIX=sw|sweep"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "sweep rc 0" in res.stdout and "(est 150," in res.stdout
    with tarfile.open(out / "r.tgz") as tf:
        sw_out = tf.extractfile("r/sw.out").read().decode()
        assert json.loads(tf.extractfile("r/sw.json").read()) == {"ok": 1}
    assert "--sections prefilltma,moetma4096 --budget-s 130 --out" in sw_out


def test_a_ladder_call_script_part_runs_its_script_with_its_args(tmp_path):
    """PART ``script``: ``python $SCRIPT $ARGS`` (+ for spaces) into r/SUFFIX.out, no warm-up charged."""
    import subprocess
    import sys
    import tarfile
    script = tmp_path / "bench.py"
    script.write_text('import sys\nprint("args", " ".join(sys.argv[1:]))\n')
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": sys.executable, "WARMUP_S": "45"}
    res = subprocess.run(["bash", "benchmarks/ladder_call.sh", "abc", "600",
                          f"80|SCRIPT={script} ARGS=--budget-s+50+--tiles SUFFIX=fd|script"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "script rc 0" in res.stdout and "(est 80," in res.stdout
    with tarfile.open(out / "r.tgz") as tf:
        assert tf.extractfile("r/fd.out").read().decode().strip() == "args --budget-s 50 --tiles"
