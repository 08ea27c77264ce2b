"""The CPU stand-in's device model (ARCHITECTURE.md, issue 36 item 2): collective residency in units, and
the conflicting pairs it implies (pure and threaded; no rank processes).

On ``configs/tiny-crossed-cpu.yaml`` (2 units; D's DP-attention collectives take 2) P's and D's
attention-TP collectives are resident together, P's all-reduce and D's DP collective are not: only
the crossed pair is registered. On a one-unit device every pair excludes the other, and the
same-group pair is registered too. The grid runs that show the stall and the completions are in
tests/test_crossed_engine.py.
"""
from __future__ import annotations

import threading
import time

import pytest

from ainfer_pd.comm.collectives import RankCollectives
from ainfer_pd.comm.ordering import (D_ADP_ALL_GATHER, D_ATP_REDUCE_SCATTER, P_ATP_ALL_REDUCE, ConflictRegistry,
                                     collective_stream)
from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, Topology
from ainfer_pd.config import WorkerConfig
from ainfer_pd.config_files import config_path
from ainfer_pd.engine.runtime.collective_residency import CollectiveResidency
from ainfer_pd.engine.runtime.device import make_device
from ainfer_pd.errors import ConfigError, DistributedError
from ainfer_pd.metrics.recorder import Recorder


def _crossed_device(**over):
    dc = WorkerConfig.from_yaml(config_path("tiny-crossed-cpu")).device
    kw = {"collective_slots": dc.collective_slots, "dp_collective_slots": dc.dp_collective_slots, **over}
    return make_device("cpu", Recorder(), **kw)


def test_the_crossed_config_holds_the_same_group_pair_together_but_not_the_crossed_pair():
    dev = _crossed_device()
    assert dev.coresident(ATTN_TP_P, ATTN_TP_D)          # a two-rank same-group pair closes no cycle
    assert not dev.coresident(ATTN_TP_P, ATTN_DP_D)      # the crossed pair can: the four-rank cycle
    assert dev.coresident(ATTN_DP_D)
    one = _crossed_device(collective_slots=1, dp_collective_slots=1)
    assert not one.coresident(ATTN_TP_P, ATTN_TP_D)      # one unit: every pair excludes the other
    limited = _crossed_device(dp_collective_slots=1)     # the paper's limited residency: all fit
    assert limited.coresident(ATTN_TP_P, ATTN_DP_D)
    assert make_device("cpu", Recorder()).coresident(ATTN_TP_P, ATTN_DP_D)    # no model: unlimited


def _holder(res: CollectiveResidency, comm: str, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with res.hold(comm):
            entered.set()
            leave.wait(5)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_collective_waits_for_admission_while_what_it_cannot_sit_beside_is_resident():
    res = CollectiveResidency(2, {ATTN_DP_D: 2})
    dp_in, dp_out = threading.Event(), threading.Event()
    t = _holder(res, ATTN_DP_D, dp_in, dp_out)
    assert dp_in.wait(5)
    p_in, p_out = threading.Event(), threading.Event()
    t2 = _holder(res, ATTN_TP_P, p_in, p_out)
    assert not p_in.wait(0.2)                            # P's all-reduce is not admitted beside D's gather
    dp_out.set()                                         # D's gather's peers joined: it leaves
    assert p_in.wait(5)
    d_in, d_out = threading.Event(), threading.Event()
    t3 = _holder(res, ATTN_TP_D, d_in, d_out)
    assert d_in.wait(5)                                  # D's attention-TP collective fits beside P's
    assert sorted(res.resident.values()) == [ATTN_TP_D, ATTN_TP_P]
    p_out.set(), d_out.set()
    for th in (t, t2, t3):
        th.join(5)
    assert res.resident == {}


def test_an_admission_wait_ends_at_its_timeout_naming_what_stays_resident():
    res = CollectiveResidency(2, {ATTN_DP_D: 2}, wait_s=0.2)
    entered, leave = threading.Event(), threading.Event()
    t = _holder(res, ATTN_DP_D, entered, leave)
    assert entered.wait(5)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="attn_tp.P collective was not admitted.*resident attn_dp.D"):
        with res.hold(ATTN_TP_P):
            pass
    assert time.monotonic() - t0 < 2
    leave.set()
    t.join(5)


def test_a_footprint_the_device_cannot_hold_is_refused():
    with pytest.raises(ConfigError):
        CollectiveResidency(1, {ATTN_DP_D: 2})
    with pytest.raises(ConfigError):
        WorkerConfig.from_yaml(config_path("tiny-crossed-cpu")).replace(**{"device.dp_collective_slots": 3})


def test_the_registry_holds_the_crossed_pair_and_the_same_group_pair_only_where_the_device_needs_it():
    crossed = Topology(4, 2, 4, 0)
    reg = ConflictRegistry.for_topology(crossed)
    assert reg.describe() == ["P:all_reduce@attn_tp.P x D:all_gather@attn_dp.D",
                              "P:all_reduce@attn_tp.P x D:reduce_scatter@attn_dp.D"]
    assert collective_stream("selective", P_ATP_ALL_REDUCE, reg) == "D"
    assert not reg.is_registered(D_ATP_REDUCE_SCATTER) and reg.is_registered(D_ADP_ALL_GATHER)
    adp1 = Topology(2, 1, 2, 0)
    assert not ConflictRegistry.for_topology(adp1)       # nothing crosses: selective routes nothing
    assert collective_stream("selective", P_ATP_ALL_REDUCE, ConflictRegistry.for_topology(adp1)) == "P"
    assert ConflictRegistry.for_topology(adp1, same_group=True).is_registered(D_ATP_REDUCE_SCATTER)


@pytest.mark.parametrize("slots,same_group", [((2, 2), False), ((1, 1), True)], ids=["crossed-config", "one-unit"])
def test_set_device_registers_the_same_group_pair_where_the_device_cannot_hold_both(slots, same_group):
    topo = Topology(2, 1, 2, 0)                          # ATP2 x ADP1: the same-group pair only
    groups = {ATTN_TP_P: None, ATTN_TP_D: None, ATTN_DP_D: None}
    colls = RankCollectives(topo, groups, backend="gloo", recorder=None)
    dev = _crossed_device(collective_slots=slots[0], dp_collective_slots=slots[1])
    colls.set_device(dev)
    assert colls.registry.is_registered(D_ATP_REDUCE_SCATTER) is same_group
    assert colls.P.registry is colls.registry and colls.D.gate == dev.collective_slot
