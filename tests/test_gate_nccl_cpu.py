"""The GPU gate's ``nccl`` section (``benchmarks/_gate_nccl.py``, issue 36 item 5) run on CPU: the same
module's logic over gloo in real rank processes (``ainfer_pd.launch.spawn``), so its code path (the phase
collectives on their own communicators, the expert dispatch, the multi-rank engine with D's
DP-attention collectives issued over one rank) is exercised where there is no GPU. On the H200 it runs
on NCCL (``python benchmarks/gpu_gate.py --only nccl``)."""
from __future__ import annotations

import json

import pytest

from ainfer_pd.comm.collectives import ONE_RANK_ENV, RankCollectives, one_rank_comms
from ainfer_pd.comm.ordering import D_ADP_ALL_GATHER, D_ATP_REDUCE_SCATTER, P_ATP_ALL_REDUCE
from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, Topology
from ainfer_pd.errors import TopologyError
from benchmarks import _gate_nccl

pytestmark = pytest.mark.timeout(120)

CHECKS = ("world", "groups_phase_owned", "d_dp_attention_all_gather", "d_dp_attention_reduce_scatter",
          "d_attn_tp_reduce_scatter_all_gather", "p_attn_tp_all_reduce", "collectives_on_phase_communicators",
          "cross_phase_refused", "p_expert_dispatch", "d_expert_dispatch", "engine_tokens_equal_single_rank",
          "engine_d_dp_attention_issued", "engine_one_rank_collectives_change_no_token")


def _failed(res: dict) -> dict:
    return {k: v[1] for k, v in res["checks"].items() if not v[0]}


def test_gate_nccl_section_on_gloo_at_world_size_one():
    res = _gate_nccl.run("cpu", 1, timeout_s=100)
    assert not _failed(res), _failed(res)
    assert set(res["checks"]) == {f"gloo_{c}" for c in CHECKS}
    eng = res["figures"]["gloo_engine"]
    # D's DP-attention collectives really ran in the engine: two per MoE layer per D iteration
    assert eng["issued"][ATTN_DP_D] == eng["completed"][ATTN_DP_D] == 2 * eng["moe_layers"] * eng["d_iters"] > 0
    assert res["figures"]["gloo_collectives_issued"]["D"][ATTN_DP_D] == 8      # 2 ops x 2 dtypes x 2 modes


def test_gate_nccl_collectives_on_gloo_at_world_size_two():
    """Two ranks (ADP 2): the gathers and reduce-scatters move real values between the replicas."""
    res = _gate_nccl.run("cpu", 2, parts=("collectives",), timeout_s=60)
    assert not _failed(res), _failed(res)
    assert "gloo_d_dp_attention_reduce_scatter" in res["checks"] and "gloo_engine_d_dp_attention_issued" not in res["checks"]


def test_gate_section_records_through_the_gates_check_and_fig(tmp_path):
    """The gate's side: the subprocess's json becomes check() / fig() calls, plus nccl_section_completes."""
    checks, figs = {}, {}

    def fake_sub(name, cmd, timeout, log):
        js = cmd[cmd.index("--json") + 1]
        with open(js, "w") as f:
            json.dump({"checks": {"nccl_world": [True, "ok"], "nccl_engine_d_dp_attention_issued": [False, "0"]},
                       "figures": {"nccl_engine": {"d_iters": 3}}}, f)
        log.write_text("done\n")
        return 0

    _gate_nccl.section(tmp_path, fake_sub, lambda n, ok, d="": checks.__setitem__(n, ok),
                       lambda n, v, d="": figs.__setitem__(n, v))
    assert checks == {"nccl_world": True, "nccl_engine_d_dp_attention_issued": False, "nccl_section_completes": True}
    assert figs == {"nccl_engine": {"d_iters": 3}}
    checks.clear()
    _gate_nccl.section(tmp_path, lambda *a: 124, lambda n, ok, d="": checks.__setitem__(n, ok), lambda *a: None)
    assert checks == {"nccl_section_completes": False}


def test_one_rank_collectives_are_opt_in_by_communicator(monkeypatch):
    topo = Topology(1, 1, 1, 0)
    groups = {ATTN_TP_P: object(), ATTN_TP_D: object(), ATTN_DP_D: object()}
    monkeypatch.delenv(ONE_RANK_ENV, raising=False)
    c = RankCollectives(topo, groups, backend="gloo", recorder=None)
    assert not c.D.active(D_ADP_ALL_GATHER) and not c.P.active(P_ATP_ALL_REDUCE)     # one rank: nothing issued
    monkeypatch.setenv(ONE_RANK_ENV, "attn_dp.D")
    c = RankCollectives(topo, groups, backend="gloo", recorder=None)
    assert c.D.active(D_ADP_ALL_GATHER) and not c.D.active(D_ATP_REDUCE_SCATTER) and not c.P.active(P_ATP_ALL_REDUCE)
    assert c.D.issued == {ATTN_TP_D: 0, ATTN_DP_D: 0} and c.P.issued == {ATTN_TP_P: 0}
    monkeypatch.setenv(ONE_RANK_ENV, "all")
    assert one_rank_comms() == {ATTN_TP_P, ATTN_TP_D, ATTN_DP_D}
    monkeypatch.setenv(ONE_RANK_ENV, "attn_dp.P")
    with pytest.raises(TopologyError, match="attn_dp.P"):
        one_rank_comms()
