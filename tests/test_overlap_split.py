"""metrics.overlap: a run's device time split into P beside D, each alone and idle, P alone by cause."""
import asyncio
import json

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.tools.cli import main
from ainfer_pd.metrics.overlap import d_launches, epoch_windows, format_d_launches, intersect, split, subtract, union
from ainfer_pd.tools.tracecheck import load_traces
from tests.conftest import tiny_cfg


def test_span_algebra():
    u = union([(3, 4), (0, 1), (0.5, 2), (5, 5)])
    assert u == [(0, 2), (3, 4)]
    assert intersect(u, [(1, 3.5)]) == [(1, 2), (3, 3.5)]
    assert subtract(u, [(0.5, 1), (1.5, 3.2)]) == [(0, 0.5), (1, 1.5), (3.2, 4)]
    assert subtract([(0, 1)], []) == [(0, 1)]


def test_split_attributes_p_alone_to_its_epochs_cause():
    ivs = [("D.capture", "D", -9.0, -1.0),            # set-up: outside the window
           ("P.attn0", "P", 0.0, 2.0),                # epoch 1 (exclusive, backlog): alone 0-2
           ("D.iter", "D", 2.0, 3.0),                 # D alone 2-3
           ("P.attn0", "P", 3.0, 5.0), ("D.iter", "D", 4.0, 6.0),   # epoch 2 (gated): alone 3-4, both 4-5
           ("P.attn0", "P", 7.0, 8.0)]                # epoch 3 (gated): alone 7-8; idle 6-7
    events = [{"ev": "p_epoch", "epoch": 1, "t": 0.0, "gated": False, "why": "backlog"},
              {"ev": "p_epoch_done", "epoch": 1, "t": 2.0},
              {"ev": "p_epoch", "epoch": 2, "t": 3.0, "gated": True, "why": None},
              {"ev": "p_epoch_done", "epoch": 2, "t": 5.0},
              {"ev": "p_epoch", "epoch": 3, "t": 7.0, "gated": True},
              {"ev": "p_epoch_done", "epoch": 3, "t": 8.0}]
    s = split(ivs, events)
    assert s["window_s"] == 8.0 and s["both_s"] == 1.0 and s["d_alone_s"] == 2.0 and s["idle_s"] == 1.0
    assert s["p_alone_s"] == {"backlog": 2.0, "gated": 2.0}
    assert s["epochs"] == {"backlog": {"n": 1, "s": 2.0}, "gated": {"n": 2, "s": 3.0}}
    assert epoch_windows(events[:1]) == []            # an epoch never done has no window


@pytest.mark.parametrize("policy,extra,cause", [
    ("normal", {}, "policy"), ("fine-grained", {}, "gated"),
    ("fine-grained", {"mux.exclusive_backlog_tokens": 1}, "backlog"),
    ("fine-grained", {"mux.activation_threshold": 1000}, "inactive")])
async def test_a_traced_run_splits_and_names_each_epochs_cause(tmp_path, policy, extra, cause):
    cfg = tiny_cfg(**{"trace_dir": str(tmp_path), "scheduler.policy": policy, "mux.activation_threshold": 1,
                      **extra})
    async with RolloutWorker(cfg) as w:
        long = asyncio.create_task(w.generate([5] * 12, SamplingParams(max_new_tokens=200, temperature=0.0)))
        while not w.engine.book.decoding:
            await asyncio.sleep(0.001)
        # prompts while the first decodes: their epochs have decode rows beside them
        outs = [await w.generate([9 + i] * 30, SamplingParams(max_new_tokens=4)) for i in range(3)]
        for o in (await long, *outs):
            await w.release(o.trajectory_id)
    events = load_traces(tmp_path)[0]
    causes = {("gated" if e["gated"] else e["why"]) for e in events if e["ev"] == "p_epoch"}
    assert "no-d" in causes and cause in causes and None not in causes
    assert causes <= {"no-d", cause}
    ivs = json.loads((tmp_path / "timeline_rank0.json").read_text())["intervals"]
    s = split(ivs, events)
    parts = s["both_s"] + s["d_alone_s"] + sum(s["p_alone_s"].values()) + s["idle_s"]
    assert s["window_s"] > 0 and parts == pytest.approx(s["window_s"])
    assert sum(e["n"] for e in s["epochs"].values()) == sum(e["ev"] == "p_epoch_done" for e in events)
    works = [e for e in events if e["ev"] == "work"]
    assert works and all(isinstance(e["launch_s"], float) and e["launch_s"] >= 0 for e in works)
    assert main(["timeline", str(tmp_path), "--split", "--items"]) == 0
    launches = d_launches(ivs, events)
    assert launches["free"]["n"] + launches["round"]["n"] == sum(e["ev"] == "d_launch" for e in events) > 0
    if cause == "gated":      # every round's launch follows its rendezvous 1
        assert len(launches["round"]["rdv_to_launch_s"]) == launches["round"]["n"] > 0


def test_d_launches_tells_a_launch_at_an_idle_d_stream_in_rounds_and_outside():
    ivs = [("D.capture", "D", -5.0, -4.0),                      # set-up: not an item of the run
           ("D.iter", "D", 0.0, 1.0), ("D.iter", "D", 1.00001, 2.0),   # queued behind: starts at once
           ("D.mtp", "D", 2.0, 2.2),                            # another D item (no launch event)
           ("D.iter", "D", 2.5, 3.5), ("D.iter", "D", 3.5, 3.6), ("D.iter", "D", 3.85, 4.0),
           ("P.attn0", "P", 1.5, 2.35), ("P.attn8", "P", 2.35, 3.0)]
    events = [{"ev": "d_launch", "t": -0.1, "round": False},    # the run's first item: no gap before it
              {"ev": "d_launch", "t": 0.5, "round": False},     # queued behind the running item
              {"ev": "rdv1", "t": 2.1}, {"ev": "d_launch", "t": 2.4, "round": True}, {"ev": "rdv2", "t": 2.41},
              {"ev": "rdv1", "t": 3.0}, {"ev": "d_launch", "t": 3.1, "round": True}, {"ev": "rdv2", "t": 3.11},
              {"ev": "d_settle", "t": 3.65, "why": "no-d-step"},  # the loop read its iteration in flight
              {"ev": "d_launch", "t": 3.8, "round": False},     # the stream idle since 3.6
              {"ev": "d_launch", "t": 4.5, "round": False}]     # cut: its item never recorded
    s = d_launches(ivs, events)
    assert s["round"]["n"] == 2 and s["round"]["idle"] == 1 and s["round"]["idle_s"] == pytest.approx(0.3)
    assert s["round"]["rdv_to_launch_s"] == pytest.approx([0.1, 0.3])
    # both rounds waited past STALL_S; in the first P.attn0 completed inside the wait, 0.05 s before the launch;
    # in the second none did (P.attn8 completed at its rendezvous 1, not after it)
    assert s["round"]["stalls"] == 2 and s["round"]["after_p_end_s"] == pytest.approx([0.05])
    assert s["free"]["n"] == 4 and s["free"]["idle"] == 1 and s["free"]["idle_s"] == pytest.approx(0.25)
    line = format_d_launches(s)
    assert "2 in rounds, 1 at an idle D stream (0.30 s" in line and "p50 200.0 ms, p90 280.0 ms" in line
    assert "2 waits over 5 ms, 1 of them went on after a P item completed inside the wait (50.00 ms after" in line
    assert s["settles"] == {"no-d-step": 1} and (s["round"]["after_settle"], s["free"]["after_settle"]) == (0, 1)
    assert "1 reads gave up the overlap (no-d-step 1), before 0 of the idle launches in rounds and 1 outside" in line
    empty = d_launches([], [])
    assert empty["round"]["n"] == 0 and "rendezvous" not in format_d_launches(empty)
    assert "gave up" not in format_d_launches(empty)


def test_item_kinds_add_each_streams_device_time_by_label_without_its_layer_number():
    from ainfer_pd.tools.timeline_cli import item_kinds, item_lines
    ivs = [("P.attn3", "P", 0.0, 0.002), ("P.attn12", "P", 0.002, 0.005), ("P.head", "P", 0.005, 0.006),
           ("D.iter", "D", 0.0, 0.010), ("D.iter", "D", 0.010, 0.030)]
    k = item_kinds(ivs)
    assert set(k) == {("P", "P.attn"), ("P", "P.head"), ("D", "D.iter")}
    assert k[("P", "P.attn")][0] == 2 and k[("P", "P.attn")][1] == pytest.approx(0.005)
    lines = item_lines(ivs)
    assert lines[0] == "D: 30.0 ms in 2 items" and "D D.iter: 2 items, 30.0 ms, 15.000 ms each" in lines[1]
    assert lines[2] == "P: 6.0 ms in 3 items" and lines[3].strip().startswith("P P.attn: 2 items, 5.0 ms")
    assert "host launch" not in lines[3]
    events = [{"ev": "work", "what": "P.attn3", "stream": "P", "launch_s": 0.001},
              {"ev": "work", "what": "P.attn7", "stream": "P", "launch_s": 0.003},
              {"ev": "work", "what": "P.head", "stream": "P", "launch_s": None}, {"ev": "p_epoch"}]
    lines = item_lines(ivs, events)
    assert lines[3].endswith("; host launch 2.000 ms each (2)") and "host launch" not in lines[4]


def test_summarize_splits_a_runs_window_and_leaves_it_unknown_without_a_timeline():
    import math
    from types import SimpleNamespace
    from ainfer_pd.tools.report import summarize
    ivs = [("P.attn0", "P", 0.0, 2.0, {}), ("D.iter", "D", 1.0, 3.0, {}), ("D.iter", "D", 4.0, 5.0, {})]
    s = summarize(SimpleNamespace(makespan_s=5.0, timeline=ivs))
    assert (s["both_s"], s["p_alone_s"], s["d_alone_s"], s["idle_s"]) == (1.0, 1.0, 2.0, 1.0)
    s = summarize(SimpleNamespace(makespan_s=5.0))
    assert all(math.isnan(s[k]) for k in ("both_s", "p_alone_s", "d_alone_s", "idle_s"))


async def test_a_run_cut_before_its_timeline_dump_is_split_from_its_trace_not_an_earlier_runs_timeline(tmp_path, capsys):
    # an earlier run in the same trace_dir left its timeline; this run is killed before it writes its own
    (tmp_path / "timeline_rank0.json").write_text(json.dumps(
        {"rank": 0, "failed": False, "intervals": [["P.body", "P", 100.0, 200.0]]}))
    cfg = tiny_cfg(**{"trace_dir": str(tmp_path), "scheduler.policy": "normal"})
    w = RolloutWorker(cfg)
    assert not (tmp_path / "timeline_rank0.json").exists()      # the earlier run's file is gone at start
    async with w:
        await w.generate([5] * 12, SamplingParams(max_new_tokens=6, temperature=0.0))
    (tmp_path / "timeline_rank0.json").unlink()                  # as if killed before its dump
    capsys.readouterr()
    assert main(["timeline", str(tmp_path), "--split"]) == 0
    out = capsys.readouterr().out
    assert "cut before its dump" in out and "split: window" in out and "epochs: no-d 1" in out
    assert "D launches: 0 in rounds" in out
    events = load_traces(tmp_path)[0]
    n_work = sum(e["ev"] == "work" for e in events)
    assert n_work and f"{n_work} intervals" in out
    (tmp_path / "rank0.jsonl").write_text("")
    assert main(["timeline", str(tmp_path)]) == 2                # nothing to draw


@pytest.mark.parametrize("threshold,cause", [(40, "gated"), (41, "inactive")])
async def test_the_activation_counts_an_epochs_tokens_once(tmp_path, threshold, cause):
    # a 40-token continuation (39 new and the re-fed last token) beside a decoding row: multiplexed up to a
    # threshold of 40 tokens, exclusive above it (d8f52c0 counted them twice: multiplexed up to 80)
    cfg = tiny_cfg(**{"trace_dir": str(tmp_path), "scheduler.policy": "fine-grained",
                      "mux.activation_threshold": threshold})
    async with RolloutWorker(cfg) as w:
        first = await w.generate([7] * 20, SamplingParams(max_new_tokens=2, temperature=0.0))
        long = asyncio.create_task(w.generate([5] * 12, SamplingParams(max_new_tokens=400, temperature=0.0)))
        while not w.engine.book.decoding:
            await asyncio.sleep(0.001)
        await w.continue_(first.trajectory_id, [9] * 39, SamplingParams(max_new_tokens=2, temperature=0.0))
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
    epochs = [e for e in load_traces(tmp_path)[0] if e["ev"] == "p_epoch"]
    last = epochs[-1]
    assert last["tokens"] == 40 and ("gated" if last["gated"] else last["why"]) == cause
