"""Topology: coordinates and group lists from (g, d, e); validation; real gloo groups."""
from __future__ import annotations

import pytest

from ainfer_pd.comm.topology import (ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, CONTROL, EP_D, EP_P, ETP_D, ETP_P, REPLICA, WORLD,
                                     Topology, build_process_groups, dp_groups, ep_groups, etp_groups,
                                     group_specs, groups_cross, tp_groups, validate_dims)
from ainfer_pd.config import ParallelConfig
from ainfer_pd.errors import ConfigError, TopologyError

try:
    from tests._dist_util import run_ranks
except ImportError:  # tests/ on sys.path instead of the repo root
    from _dist_util import run_ranks


def topo(g, d, e, rank=0):
    return Topology.from_config(ParallelConfig(world_size=g, attn_dp=d, expert_parallel=e), rank)


def _partition(groups, g):
    flat = sorted(r for grp in groups for r in grp)
    return flat == list(range(g))


def test_g4_d2_crossed():
    t = topo(4, 2, 1)
    assert (t.atp, t.adp, t.etp, t.ep) == (2, 2, 4, 1)
    assert t.crossed
    assert t.all_tp_groups() == [(0, 1), (2, 3)]
    assert t.all_dp_groups() == [(0, 2), (1, 3)]
    assert t.all_ep_groups() == [(0,), (1,), (2,), (3,)]
    assert t.all_etp_groups() == [(0, 1, 2, 3)]
    assert groups_cross(t.all_tp_groups(), t.all_dp_groups())
    expect = {0: (0, (0, 1), (0, 2)), 1: (0, (0, 1), (1, 3)), 2: (1, (2, 3), (0, 2)), 3: (1, (2, 3), (1, 3))}
    for r, (dp_rank, tp, dp) in expect.items():
        tr = t.for_rank(r)
        assert (tr.dp_rank, tr.tp_group, tr.dp_group) == (dp_rank, tp, dp)
        assert tr.tp_rank == r % 2 and tr.rank in tr.tp_group and tr.rank in tr.dp_group


def test_g8_d2_e8():
    t = topo(8, 2, 8, rank=5)
    assert (t.atp, t.adp, t.etp, t.ep, t.crossed) == (4, 2, 1, 8, True)
    assert t.all_tp_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert t.all_dp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert t.all_ep_groups() == [tuple(range(8))]
    assert t.all_etp_groups() == [(r,) for r in range(8)]
    assert (t.dp_rank, t.tp_rank, t.ep_rank, t.etp_rank) == (1, 1, 5, 0)
    assert (t.tp_group, t.dp_group, t.ep_group, t.etp_group) == ((4, 5, 6, 7), (1, 5), tuple(range(8)), (5,))


def test_g16_d8_e16():
    t = topo(16, 8, 16, rank=11)
    assert (t.atp, t.adp, t.etp, t.ep, t.crossed) == (2, 8, 1, 16, True)
    assert t.all_tp_groups() == [(2 * k, 2 * k + 1) for k in range(8)]
    assert t.all_dp_groups() == [tuple(range(0, 16, 2)), tuple(range(1, 16, 2))]
    assert t.ep_group == tuple(range(16)) and t.etp_group == (11,)
    assert (t.dp_rank, t.tp_rank, t.tp_group, t.dp_group) == (5, 1, (10, 11), tuple(range(1, 16, 2)))


@pytest.mark.parametrize("g,d,e", [(1, 1, 1), (4, 1, 4), (4, 4, 4), (4, 2, 2), (8, 2, 8), (8, 8, 8),
                                   (16, 8, 16), (6, 3, 2), (12, 4, 6)])
def test_invariants(g, d, e):
    t = topo(g, d, e)
    for fam in (t.all_tp_groups(), t.all_dp_groups(), t.all_ep_groups(), t.all_etp_groups()):
        assert _partition(fam, g)
    assert all(len(x) == g // d for x in t.all_tp_groups())
    assert all(len(x) == d for x in t.all_dp_groups())
    assert all(len(x) == e for x in t.all_ep_groups())
    assert all(len(x) == g // e for x in t.all_etp_groups())
    # every TP group meets every DP-attention group in exactly one rank
    for tp in t.all_tp_groups():
        for dp in t.all_dp_groups():
            assert len(set(tp) & set(dp)) == 1
    assert t.crossed == (t.atp > 1 and t.adp > 1) == groups_cross(t.all_tp_groups(), t.all_dp_groups())
    assert t.crossed == ParallelConfig(world_size=g, attn_dp=d, expert_parallel=e).crossed
    for r in range(g):
        tr = t.for_rank(r)
        assert tr.tp_group[tr.tp_rank] == r and tr.dp_group[tr.dp_rank] == r
        assert tr.ep_group[tr.ep_rank] == r and tr.etp_group[tr.etp_rank] == r
        assert tr.replica_ranks(tr.dp_rank) == tr.tp_group
    # the global creation order does not depend on the rank
    assert group_specs(t) == group_specs(t.for_rank(g - 1))


def test_not_crossed_when_an_axis_is_one():
    assert not topo(4, 1, 1).crossed       # ADP1
    assert not topo(4, 4, 4).crossed       # ATP1
    assert not topo(8, 8, 8).crossed


@pytest.mark.parametrize("g,d,e,rank", [
    (4, 3, 1, 0),      # d does not divide g
    (8, 2, 3, 0),      # e does not divide g
    (0, 1, 1, 0), (4, 0, 1, 0), (4, 2, 0, 0), (-4, 2, 1, 0),
    (4, 8, 1, 0),      # d > g
    (4, 2, 1, 4), (4, 2, 1, -1),            # rank out of range
    (4.0, 2, 1, 0), (4, True, 1, 0),        # not ints
])
def test_invalid_raises_topology_error(g, d, e, rank):
    with pytest.raises(TopologyError):
        Topology(world_size=g, attn_dp=d, expert_parallel=e, rank=rank)


def test_invalid_via_config_and_pure_functions():
    with pytest.raises(TopologyError, match="attn_dp"):
        Topology.from_config(ParallelConfig(world_size=6, attn_dp=4), 0)
    with pytest.raises(TopologyError):
        tp_groups(6, 4)
    with pytest.raises(TopologyError):
        ep_groups(6, 4)
    with pytest.raises(TopologyError):
        validate_dims(4, 2, 3)
    assert issubclass(TopologyError, ConfigError)
    assert etp_groups(4, 2) == [(0, 1), (2, 3)] and ep_groups(4, 2) == [(0, 2), (1, 3)]
    assert dp_groups(4, 2) == [(0, 2), (1, 3)]


def test_group_specs_order():
    specs = group_specs(topo(4, 2, 2))
    names = [s.name for s in specs]
    assert names == [CONTROL, REPLICA, REPLICA, ATTN_TP_P, ATTN_TP_P, ATTN_TP_D, ATTN_TP_D, ATTN_DP_D, ATTN_DP_D,
                     EP_P, EP_P, EP_D, EP_D, ETP_P, ETP_P, ETP_D, ETP_D]
    assert [s.kind for s in specs[:3]] == ["ctrl"] * 3 and all(s.kind == "data" for s in specs[3:])
    assert [s.ranks for s in specs if s.name == REPLICA] == [(0, 1), (2, 3)]
    assert [s.ranks for s in specs if s.name == ATTN_DP_D] == [(0, 2), (1, 3)]


def test_build_process_groups_requires_init():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("default group initialised in this process")
    with pytest.raises(TopologyError, match="not initialised"):
        build_process_groups(topo(4, 2, 1))


# ---------------------------------------------------------------- real processes
def _groups_rank(rank: int, world_size: int):
    import os

    import torch
    import torch.distributed as dist

    from ainfer_pd.launch import init_distributed
    # the torchrun path: everything from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    assert not dist.is_initialized() and os.environ["RANK"] == str(rank)
    ctx = init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.master_addr) == (rank, world_size, rank, "127.0.0.1")
    t = Topology(world_size=world_size, attn_dp=2, expert_parallel=2, rank=rank)
    groups = build_process_groups(t, "gloo", control_timeout_s=20)
    out = {"names": sorted(groups)}
    for name in (ATTN_TP_P, ATTN_TP_D, REPLICA, ATTN_DP_D, EP_P, EP_D, ETP_P, ETP_D, CONTROL, WORLD):
        x = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(x, group=groups[name])
        out[name] = int(x)
    out["control_backend"] = str(dist.get_backend(groups[CONTROL]))
    return out


def test_build_process_groups_real_gloo_g4_d2_e2():
    res = run_ranks(_groups_rank, 4, timeout_s=60, init=False)
    mask = lambda ranks: sum(1 << r for r in ranks)  # noqa: E731
    t = Topology(world_size=4, attn_dp=2, expert_parallel=2, rank=0)
    for r, out in enumerate(res):
        tr = t.for_rank(r)
        assert out["names"] == sorted([CONTROL, REPLICA, ATTN_TP_P, ATTN_TP_D, ATTN_DP_D, EP_P, EP_D, ETP_P, ETP_D,
                                       WORLD])
        assert out[ATTN_TP_P] == out[ATTN_TP_D] == out[REPLICA] == mask(tr.tp_group)         # {0,1},{2,3}
        assert out[ATTN_DP_D] == mask(tr.dp_group)         # {0,2},{1,3}
        assert out[EP_P] == out[EP_D] == mask(tr.ep_group)
        assert out[ETP_P] == out[ETP_D] == mask(tr.etp_group)
        assert out[CONTROL] == out[WORLD] == 0b1111
        assert out["control_backend"] == "gloo"
