"""The Table 4 grid of the self-test (issue 36 items 2, 3): its pure parts (no rank processes).

The grid's cells themselves run real gloo ranks (``ainfer-pd selftest``; one cell of each kind runs in
tests/test_crossed_engine.py).
"""
from __future__ import annotations

import pytest

from ainfer_pd.errors import ConfigError, RankFailedError, StallError
from ainfer_pd.faults import Faults
from ainfer_pd.tools.selftest_grid import (GRID_ORDERINGS, GRID_TOPOLOGIES, _cycle_of, _stalled_cell, format_grid,
                                           table4_expect)


def test_phase_skew_by_rank_parity_or_by_replica():
    by_rank = Faults.load({"phase_skew_ms": 30.0})
    # g = 4, ATP2: (dp_rank, tp_rank) of ranks 0..3; (D delay, P collective delay)
    assert [by_rank.phase_skew_s(d, t) for d, t in ((0, 0), (0, 1), (1, 0), (1, 1))] == [
        (0.03, 0.0), (0.0, 0.03), (0.0, 0.03), (0.03, 0.0)]          # TP peers in opposite orders
    by_replica = Faults.load({"phase_skew_ms": 30.0, "phase_skew_by": "replica"})
    assert [by_replica.phase_skew_s(d, t) for d, t in ((0, 0), (0, 1), (1, 0), (1, 1))] == [
        (0.03, 0.0), (0.03, 0.0), (0.0, 0.03), (0.0, 0.03)]          # TP peers alike, replicas opposite
    assert not Faults.load({"phase_skew_by": "replica"}).active       # the mode alone injects nothing
    with pytest.raises(ConfigError):
        Faults.load({"phase_skew_ms": 30.0, "phase_skew_by": "peer"})


def test_the_grid_is_the_papers_three_topologies_by_three_orderings():
    assert [(ws, d) for _, ws, d in GRID_TOPOLOGIES] == [(4, 2), (2, 1), (2, 2)]
    assert GRID_ORDERINGS == ("none", "global-implicit", "selective")
    expect = {(t, o): table4_expect(t, o) for t, _, _ in GRID_TOPOLOGIES for o in GRID_ORDERINGS}
    assert [k for k, v in expect.items() if v == "stall"] == [("ATP2 x ADP2", "none")]


def test_a_stall_cell_names_its_cycle_and_the_table_marks_deviations_from_the_paper():
    msg = ("rank 2: no progress for 3.0 s (watchdog 3 s): device-progress stall.\n"
           "  rank 0: completed D iterations 3, P segments 20, completed requests 1\n"
           "  device-progress cycle: rank 0 [D all_gather attn_dp.D#7] waits for rank 2 -> rank 2 "
           "[P all_reduce attn_tp.P#5] waits for rank 3 -> rank 3 [D all_gather attn_dp.D#7] waits for rank 1 -> "
           "rank 1 [P all_reduce attn_tp.P#5] waits for rank 0")
    cycle, held = _cycle_of(StallError(msg))
    assert cycle == [0, 2, 3, 1, 0] and held[0] == "rank 0: D all_gather attn_dp.D#7"
    assert held[1] == "rank 2: P all_reduce attn_tp.P#5"
    cells = [{"topology": "ATP2 x ADP2", "ordering": "none", "expect": "stall", "outcome": "stall",
              "frontier_requests": 3, "requests": 12, "cycle_ranks": 4, "wall_s": 14.2, "ok": True},
             {"topology": "ATP2 x ADP1", "ordering": "none", "expect": "complete", "outcome": "stall",
              "frontier_requests": 1, "requests": 12, "cycle_ranks": 2, "wall_s": 14.0, "ok": False}]
    text = format_grid(cells, markdown=True)
    assert "| ATP2 x ADP2 | stall @3/12, 4-rank cycle, 14.2 s |" in text
    assert "stall @1/12, 2-rank cycle, 14.0 s (paper: complete)" in text


def test_a_stalled_cell_takes_the_rank_report_that_names_the_whole_cycle():
    cycle = ("  device-progress cycle: rank 0 [P all_reduce attn_tp.P#5] waits for rank 1 -> rank 1 [D all_gather "
             "attn_dp.D#25] waits for rank 3 -> rank 3 [P all_reduce attn_tp.P#5] waits for rank 2 -> rank 2 "
             "[D all_gather attn_dp.D#25] waits for rank 0")
    partial = StallError("rank 0: device-progress stall.\n  no wait cycle found among the reported ranks")
    partial.frontier = {"0": {"requests_done": 1}}
    whole = StallError(f"rank 2: device-progress stall.\n{cycle}")
    whole.frontier = {str(r): {"requests_done": r % 2} for r in range(4)}
    cell = {"requests": 12}
    _stalled_cell(cell, RankFailedError("stalled", results=[partial, None, whole, partial]), type("T", (), {
        "num_requests": 12})())
    assert cell["outcome"] == "stall" and cell["cycle"] == [0, 1, 3, 2, 0] and cell["cycle_ranks"] == 4
    assert cell["frontier_requests"] == 2 and "rank 1: D all_gather attn_dp.D#25" in cell["held"]
    _stalled_cell(cell, RankFailedError("died", results=[ValueError("boom")]), type("T", (), {"num_requests": 12})())
    assert cell["outcome"] == "failed" and "ValueError: boom" in cell["detail"]
