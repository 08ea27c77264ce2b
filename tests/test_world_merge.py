"""Per-rank metrics of a multi-rank world merged into one (issue 36 item 4; pure, no processes).

A lockstep world of 4 ranks with attention TP 2: ranks 0 and 2 lead a replica and serve its
conversations (they hold the D-wait / TTFT samples), ranks 1 and 3 follow (no request samples,
but the same rendezvous, steps, epochs and D iterations, and their own device work).
"""
from __future__ import annotations

import math

from ainfer_pd.tools.report import summarize
from ainfer_pd.tools.replay import ReplayResult
from ainfer_pd.tools.world import merge, merge_metrics


def _rank(*, leader: bool, rdv: int = 30, d_waits=(0.002, 0.004), conc: float = 0.4, p_permit: float = 0.5,
          work: bool = True) -> dict:
    m = {"rendezvous": rdv, "rendezvous_s_count": rdv, "rendezvous_s_sum": rdv * 0.001, "rendezvous_s_mean": 0.001,
         "step_sync_s_count": 100, "step_sync_s_sum": 0.5, "step_sync_s_mean": 0.005, "num_epochs": 6,
         "busy_fraction": 0.8 if work else 0.0, "concurrent_fraction": conc if work else 0.0,
         "p_wait_permit_s_count": 10, "p_wait_permit_s_sum": p_permit, "p_wait_permit_s_mean": p_permit / 10,
         "p_work_s_sum": 1.0 if work else 0, "d_work_s_sum": 2.0 if work else 0, "policy": "fine-grained",
         "finished": 5 if leader else 0, "failures": 0, "prefill_tokens": 100 if leader else 0,
         "d_wait_s_samples": list(d_waits) if leader else [], "ttft_s_samples": [0.1] if leader else []}
    if leader:
        m.update({"d_wait_s_count": len(d_waits), "d_wait_s_sum": sum(d_waits),
                  "d_wait_s_mean": sum(d_waits) / len(d_waits),
                  "ttft_s_count": 1, "ttft_s_sum": 0.1, "ttft_s_mean": 0.1})
    return m


def test_followers_do_not_hide_leader_metrics_and_rendezvous_are_one_ranks():
    ranks = [_rank(leader=True, d_waits=(0.002, 0.004), conc=0.4), _rank(leader=False, conc=0.2),
             _rank(leader=True, d_waits=(0.006,), conc=0.6), _rank(leader=False, conc=0.2)]
    m = merge_metrics(ranks)
    assert m["rendezvous"] == 30 and m["rendezvous_s_count"] == 30          # one rank's, not 4 x 30
    assert m["rendezvous_per_rank"] == [30, 30, 30, 30] and m["world_events_agree"]
    assert m["step_sync_s_count"] == 100 and m["num_epochs"] == 6
    assert math.isclose(m["d_wait_s_mean"], (0.002 + 0.004 + 0.006) / 3)     # pooled over the leaders
    assert m["d_wait_s_count"] == 3 and m["ttft_s_count"] == 2
    assert math.isclose(m["concurrent_fraction"], (0.4 + 0.2 + 0.6 + 0.2) / 4)
    assert math.isclose(m["rendezvous_s_mean"], 0.001)
    assert math.isclose(m["p_wait_permit_s_sum"], 0.5)                     # one rank's time, not the sum
    assert m["finished"] == 10 and m["prefill_tokens"] == 200
    assert sorted(m["d_wait_s_samples"]) == [0.002, 0.004, 0.006]
    assert m["policy"] == "fine-grained"


def test_a_rank_without_device_work_does_not_count_as_zero_concurrency_and_disagreement_is_flagged():
    ranks = [_rank(leader=True, conc=0.5), _rank(leader=False, work=False, rdv=29)]
    m = merge_metrics(ranks)
    assert math.isclose(m["concurrent_fraction"], 0.5)
    assert m["rendezvous"] == 30 and m["rendezvous_per_rank"] == [30, 29] and not m["world_events_agree"]


def test_the_table_of_a_merged_world_shows_d_wait_rendezvous_and_concurrency():
    ranks = [_rank(leader=True), _rank(leader=False), _rank(leader=True), _rank(leader=False)]
    res = [ReplayResult(records=[], trajectories=[], outputs={}, metrics=m, makespan_s=2.0 + i, cell="P1",
                        seed=0, time_scale=1.0, label=f"rank{i}") for i, m in enumerate(ranks)]
    s = summarize(merge(res))
    assert s["makespan_s"] == 5.0
    assert s["rendezvous"] == 30.0
    assert math.isclose(s["d_wait_mean_s"], 0.003)
    assert math.isclose(s["concurrent_fraction"], 0.4)


def test_the_p_epoch_split_reads_one_ranks_times_and_counts():
    from ainfer_pd.tools.report import aggregate
    from ainfer_pd.tools.world import epoch_split, format_split
    ranks = [_rank(leader=True, p_permit=0.4), _rank(leader=False, p_permit=0.6)]
    for m in ranks:
        m.update({"p_epoch_s_count": 6, "p_epoch_s_sum": 1.2, "p_epoch_s_mean": 0.2,
                  "p_counts_wait_s_count": 24, "p_counts_wait_s_sum": 0.3, "p_counts_wait_s_mean": 0.0125})
    sp = epoch_split(merge_metrics(ranks))
    assert sp["split_p_epochs"] == 6 and math.isclose(sp["split_p_epoch_ms"], 200.0)
    assert math.isclose(sp["split_p_permit_wait_s"], 0.5) and math.isclose(sp["split_p_counts_wait_s"], 0.3)
    assert math.isclose(sp["split_rendezvous_s"], 0.03)
    text = format_split({"fine-grained": aggregate([sp | {"rendezvous": 30.0}])})
    assert "fine-grained: 6  200.0  0.500  0.300  0.030  30" in text
