"""Report math on hand-built inputs, tables, and plot files."""
import math

import pytest

from ainfer_pd.tools import plots, report
from ainfer_pd.tools.replay import ReplayResult, RequestRecord, TrajectoryRecord


def hand_result(metrics=None):
    recs = []
    # conversation 0: two turns; conversation 1: one turn; conversation 2: one failed turn
    recs.append(RequestRecord(0, 0, submit_s=0.0, done_s=1.0, ttft_s=0.1, latency_s=1.0, gen_tokens=10,
                              num_output_tokens=10, num_prompt_tokens=100, num_cached_tokens=0))
    recs.append(RequestRecord(0, 1, submit_s=3.0, done_s=4.0, ttft_s=0.3, latency_s=1.0, wait_s=2.0, gen_tokens=10,
                              num_output_tokens=10, num_prompt_tokens=130, num_cached_tokens=110))
    recs.append(RequestRecord(1, 0, submit_s=0.0, done_s=2.0, ttft_s=0.2, latency_s=2.0, gen_tokens=20,
                              num_output_tokens=20, num_prompt_tokens=50, num_cached_tokens=0))
    recs.append(RequestRecord(2, 0, submit_s=0.0, error="InvalidRequestError: x", gen_tokens=5))
    trajs = [TrajectoryRecord(0, "a", 0.0, 4.0, 2, 2, total_wait_s=2.0),
             TrajectoryRecord(1, "b", 0.0, 2.0, 1, 1),
             TrajectoryRecord(2, "", 0.0, float("nan"), 0, 1, failed=True)]
    return ReplayResult(records=recs, trajectories=trajs, outputs={}, metrics=metrics or {},
                        makespan_s=5.0, failures=1, planned_requests=4)


def test_summarize_hand_built():
    m = {"d_wait_s_mean": 0.02, "p_wait_permit_s_sum": 1.5, "d_boundary_wait_s_sum": 0.5,
         "p_enqueue_s_sum": 0.25, "rendezvous": 40, "rendezvous_s_mean": 0.001, "busy_fraction": 0.9,
         "concurrent_fraction": 0.4, "failures": 0, "p_work_s_sum": 2.5, "d_work_s_sum": 1.0,
         "policy": "fine-grained"}
    s = report.summarize(hand_result(m))
    assert s["makespan_s"] == 5.0
    assert s["completed_requests"] == 3 and s["requests"] == 4 and s["failures"] == 1
    assert s["requests_per_s"] == pytest.approx(3 / 5)
    assert s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["ttft_p99_s"] == pytest.approx(0.2 + 0.98 * 0.1)            # numpy linear interpolation
    assert s["request_completion_p99_s"] == pytest.approx(1.0 + 0.98 * 1.0)
    assert s["trajectory_completion_p99_s"] == pytest.approx(2.0 + 0.99 * 2.0)   # failed trajectory excluded
    assert s["d_wait_mean_s"] == 0.02 and s["rendezvous"] == 40 and s["rendezvous_cost_mean_s"] == 0.001
    assert s["p_wait_permit_s"] == 1.5 and s["d_boundary_wait_s"] == 0.5 and s["p_enqueue_s"] == 0.25
    assert s["concurrent_fraction"] == 0.4
    assert s["input_tokens"] == 280 and s["output_tokens"] == 40 and s["cached_tokens"] == 110
    # bound = max(P work 2.5, D work 1.0, chain = tool waits 2.0) -> 2.5; ratio 5 / 2.5
    assert s["chain_s"] == 2.0 and s["bound_s"] == 2.5 and s["bound_ratio"] == pytest.approx(2.0)
    # with a decode-alone iteration time the chain grows: 2.0 + 0.2 * 20 tokens
    s2 = report.summarize(hand_result({**m, "d_iter_alone_s": 0.2}))
    assert s2["chain_s"] == pytest.approx(6.0) and s2["bound_ratio"] == pytest.approx(5 / 6)


def test_the_last_trajectory_s_chain_is_its_time_less_tool_waits_and_ttfts_per_token():
    """Conversation 0 finishes last (at 4.0 s; the failed one does not count): 4.0 s less 2.0 s of
    tool wait and 0.1 + 0.3 s of TTFT is 1.6 s of decode for its 20 - 2 tokens after each turn's first."""
    s = report.summarize(hand_result({}))
    assert s["last_traj_tokens"] == 20
    assert s["last_traj_decode_s"] == pytest.approx(1.6)
    assert s["last_traj_token_ms"] == pytest.approx(1600 / 18)
    empty = report.last_chain(ReplayResult(records=[], trajectories=[], outputs={}, metrics={}, makespan_s=0.0))
    assert all(math.isnan(v) for v in empty.values())


def test_the_bound_s_work_terms_leave_out_the_engine_s_set_up_items():
    """Each phase's graph capture, the prefill warm-up and speculation's cost tables run on the D / P
    streams before the first turn: the engine's work sums (``work_s``) leave them out (on the H200 the capture alone was
    3-5 s of a 34-39 s run, and the D term was the bound)."""
    timeline = [("D.capture", "D", 0.0, 4.0, {}), ("P.capture", "P", 4.0, 4.6, {}), ("P.warmup", "P", 4.6, 4.8, {}),
                ("D.verify_costs", "D", 4.0, 4.9, {}), ("D.draft_costs", "D", 4.9, 5.0, {}),
                ("D.iter", "D", 5.0, 6.0, {}), ("P.attn0", "P", 6.0, 6.5, {}), ("P.experts0", "P", 7.0, 7.25, {})]
    assert report.work_s(timeline, "D") == pytest.approx(1.0)
    assert report.work_s(timeline, "P") == pytest.approx(0.75)
    assert report.work_s([], "D") == 0
    s = report.summarize(hand_result({"p_work_s_sum": 0.75, "d_work_s_sum": 9.0}))
    assert s["d_work_s"] == 9.0 and s["bound_s"] == 9.0 and s["bound_ratio"] == pytest.approx(5 / 9)


def test_summarize_missing_worker_keys():
    s = report.summarize(hand_result({}))
    assert math.isnan(s["d_wait_mean_s"]) and math.isnan(s["p_work_s"])
    assert s["rendezvous"] == 0
    assert s["bound_s"] == 2.0                                    # only the chain term
    assert s["bound_ratio"] == pytest.approx(2.5)


def test_aggregate_median_iqr():
    sums = [{"makespan_s": v, "x": 1.0, "policy": "p"} for v in (1.0, 2.0, 3.0, 4.0, 100.0)]
    sums.append({"makespan_s": float("nan"), "x": 1.0})
    a = report.aggregate(sums)
    assert "policy" not in a
    assert a["makespan_s"]["median"] == 3.0
    assert a["makespan_s"]["q1"] == 2.0 and a["makespan_s"]["q3"] == 4.0
    assert a["makespan_s"]["iqr"] == 2.0 and a["makespan_s"]["n"] == 5
    assert a["x"]["iqr"] == 0.0 and a["x"]["n"] == 6
    b = report.aggregate([{"m": 1.0}, {"m": 2.0}])
    assert b["m"]["median"] == 1.5 and b["m"]["iqr"] == pytest.approx(0.5)


def test_ratios_and_table():
    aggs = {"normal": report.aggregate([{"makespan_s": 10.0, "requests_per_s": 2.0},
                                        {"makespan_s": 12.0, "requests_per_s": 1.8}]),
            "fine-grained": report.aggregate([{"makespan_s": 8.0, "requests_per_s": 2.5},
                                              {"makespan_s": 9.0, "requests_per_s": 2.3}])}
    r = report.ratios(aggs, "normal")
    assert r["fine-grained"]["makespan_s"] == pytest.approx(8.5 / 11.0)
    assert r["normal"]["makespan_s"] == 1.0
    assert math.isnan(r["fine-grained"]["ttft_p99_s"])
    t = report.format_table(aggs, title="cell P1")
    lines = t.splitlines()
    assert lines[0] == "cell P1" and "makespan s" in lines[1]
    assert "11.00 ±1.00" in t and f"({8.5 / 11:.3f}x)" in t
    # plain summaries work too (no IQR)
    t2 = report.format_table({"normal": {"makespan_s": 4.0}, "x": {"makespan_s": 2.0}})
    assert "(0.500x)" in t2
    assert report.compare_outputs({(0, 0): [1, 2]}, {(0, 0): [1, 2], (1, 0): [3]}) == [(1, 0)]
    assert report.compare_outputs({(0, 0): [1]}, {(0, 0): [2]}) == [(0, 0)]


def test_plots_written(tmp_path):
    aggs = {"normal": report.aggregate([{"makespan_s": 10.0}, {"makespan_s": 12.0}]),
            "fine-grained": {"makespan_s": 8.0}}
    assert plots.plot_makespan_bars(aggs, tmp_path / "bars.png").stat().st_size > 1000
    r = hand_result({"d_wait_s_samples": [0.001, 0.002, 0.01]})
    r.timeline = [("prefill_seg0", "P", 0.0, 1.0, {}), ("decode", "D", 0.2, 0.3, {}),
                  ("decode", "D", 0.5, 0.6, {}), ("rendezvous", "D", 0.3, 0.31, {})]
    assert plots.plot_ttft_cdf({"normal": [r]}, tmp_path / "ttft.png").exists()
    assert plots.plot_d_wait_cdf({"normal": [r]}, tmp_path / "dwait.png").exists()
    assert plots.plot_d_wait_cdf({"normal": [hand_result()]}, tmp_path / "none.png") is None   # no samples
    assert plots.plot_timeline(r.timeline, tmp_path / "tl.png").exists()
    assert plots.plot_timeline([], tmp_path / "tl2.png") is None
    files = plots.plot_all(tmp_path / "all", aggs, {"normal": [r]}, prefix="P1")
    assert {p.name for p in files} == {"P1_makespan.png", "P1_ttft_cdf.png", "P1_d_wait_cdf.png",
                                       "P1_timeline_normal.png", "P1_timeline_normal_zoom.png"}
    assert plots.overlap_window(r.timeline, 0.1) == pytest.approx((0.19, 0.29))
