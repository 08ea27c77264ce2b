"""TP-sharded attention over real gloo ranks equals the single-rank forward (issue 4 item 2),
and the phase-identified collectives use their own phase's group."""
from __future__ import annotations

from pathlib import Path

import torch


try:
    from tests._dist_util import run_ranks
except ImportError:  # tests/ on sys.path instead of the repo root
    from _dist_util import run_ranks

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"


def _tp_prefill_rank(rank: int, world_size: int, cfg_path: str) -> dict:
    from ainfer_pd.comm.topology import Topology, build_process_groups
    from ainfer_pd.config import WorkerConfig
    from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
    from ainfer_pd.engine.model.model import build_model
    from ainfer_pd.comm.collectives import PhaseCollectives
    from ainfer_pd.engine.runtime.tensor_parallel import PrefillHooks, shard_attention_

    mc = WorkerConfig.from_yaml(cfg_path).model
    topo = Topology(world_size=world_size, attn_dp=1, expert_parallel=1, rank=rank)   # ATP = world_size
    groups = build_process_groups(topo, "gloo", control_timeout_s=30, data_timeout_s=30)
    from ainfer_pd.phase import Phase
    colls = PhaseCollectives(topo, groups, phase=Phase.PREFILL, backend="gloo", recorder=None)
    model = build_model(mc)
    shard = shard_attention_(build_model(mc), topo.tp_rank, topo.atp)     # the engine's sharding, in place
    g = torch.Generator().manual_seed(7)
    T = 37
    ids = torch.randint(2, mc.vocab_size, (T,), generator=g)
    slots = torch.arange(T)

    def fb() -> ForwardBatch:
        return ForwardBatch(ids, torch.arange(T), slots, [PrefillSeq(0, T, T, slots)], None, torch.arange(T))

    with torch.inference_mode():
        kv_full = torch.zeros(mc.num_layers, 2, T, mc.num_kv_heads, mc.head_dim)
        ref = model.forward_batch(fb(), kv_full)
        kv_shard = torch.zeros(mc.num_layers, 2, T, mc.num_kv_heads // topo.atp, mc.head_dim)
        out = shard.forward_batch(fb(), kv_shard, attn_reduce=PrefillHooks(colls, None, None).hooks().attn_reduce)
    # the shard's KV cache holds exactly this rank's slice of the KV heads
    hk = mc.num_kv_heads // topo.atp
    kv_ok = torch.allclose(kv_shard, kv_full[:, :, :, rank * hk:(rank + 1) * hk], atol=1e-5, rtol=1e-5)
    return {"max_abs": float((out - ref).abs().max()), "ref_tok": ref.argmax(-1).tolist(),
            "tp_tok": out.argmax(-1).tolist(), "kv_ok": kv_ok,
            "shard_heads": (shard.cfg.num_heads, shard.cfg.num_kv_heads), "p_allreduces": colls.completed["attn_tp.P"]}


def test_tp_sharded_prefill_matches_single_rank():
    res = run_ranks(_tp_prefill_rank, 2, str(TINY), timeout_s=90)
    for r, x in enumerate(res):
        assert x["shard_heads"] == (2, 1), x
        assert x["max_abs"] < 1e-4, (r, x["max_abs"])
        assert x["tp_tok"] == x["ref_tok"], r
        assert x["kv_ok"], r
        assert x["p_allreduces"] == 4                  # one P attention all-reduce per layer, booked
    assert res[0]["tp_tok"] == res[1]["tp_tok"]


def _phase_colls_rank(rank: int, world_size: int) -> dict:
    from ainfer_pd.comm.collectives import PhaseCollectives
    from ainfer_pd.comm.ordering import D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, P_ATP_ALL_REDUCE
    from ainfer_pd.comm.topology import Topology, build_process_groups
    from ainfer_pd.errors import DistributedError

    topo = Topology(world_size=world_size, attn_dp=world_size, expert_parallel=1, rank=rank)   # ADP = 2, ATP = 1
    groups = build_process_groups(topo, "gloo", control_timeout_s=30, data_timeout_s=30)
    from ainfer_pd.phase import Phase
    colls = PhaseCollectives(topo, groups, phase=Phase.DECODE, backend="gloo", recorder=None)
    x = torch.full((2, 3), float(rank + 1))
    colls.enqueue_schedule([D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER], stream="D", epoch=None, boundary=None)
    ag = colls.run(D_ADP_ALL_GATHER, x)
    rs = colls.run(D_ADP_REDUCE_SCATTER, torch.arange(8, dtype=torch.float32).view(4, 2) * (rank + 1))
    wrong = []
    try:                                    # a device half without its host enqueue
        colls.run(D_ADP_ALL_GATHER, x)
    except DistributedError as exc:
        wrong.append(str(exc))
    try:                                    # the other phase's collective: not D's state
        colls.enqueue(P_ATP_ALL_REDUCE, stream="P")
    except DistributedError as exc:
        wrong.append(str(exc))
    try:
        colls.run(P_ATP_ALL_REDUCE, x)
    except DistributedError as exc:
        wrong.append(str(exc))
    # the device half by hand, as a device whose completion comes later does it (the NCCL
    # harness's CUDA item): take, mark_started, apply, mark_completed
    info = colls.enqueue(D_ADP_ALL_GATHER, stream="D", epoch=3, boundary=1)
    taken = colls.take(D_ADP_ALL_GATHER) is info
    t0 = colls.mark_started(info)
    by_hand = colls.apply(D_ADP_ALL_GATHER, x)
    colls.mark_completed(info, t0, t0 + 1.0)
    halves = {"taken": taken, "ag": by_hand.tolist(), "state": info["state"], "span": info["t1"] - info["t0"],
              "failure": str(colls.failure(dict(info), RuntimeError("peer gone")))}
    from ainfer_pd.comm.experts.ownership import OwnershipRegistry
    reg = OwnershipRegistry()
    colls.register_owned(reg)
    owners = {o.owner for o in reg.objects}
    return {"ag": ag.tolist(), "rs": rs.tolist(), "wrong": wrong, "active_p": colls.active(P_ATP_ALL_REDUCE),
            "halves": halves,
            "registered": colls.registry.describe(), "frontier": colls.frontier(),
            "owners": [o.value for o in owners], "owned": sorted(o.name for o in reg.objects)}


def test_phase_collectives_use_their_own_group_and_reject_the_other_phase():
    res = run_ranks(_phase_colls_rank, 2, timeout_s=90)
    full = (torch.arange(8, dtype=torch.float32).view(4, 2) * 3)
    for r, x in enumerate(res):
        assert x["ag"] == [[1.0] * 3] * 2 + [[2.0] * 3] * 2
        assert x["rs"] == full.chunk(2, 0)[r].tolist()
        assert not x["active_p"]              # ATP1: P's attention group has one rank, nothing issued
        assert len(x["wrong"]) == 3 and "without its host enqueue" in x["wrong"][0]
        assert all("D's phase-owned collective state" in w for w in x["wrong"][1:])     # P's kind refused
        assert x["owners"] == ["D"] and "attn_dp.D.group" in x["owned"] and "D.attn_colls.completed" in x["owned"]
        assert not any(n.startswith("attn_tp.P") for n in x["owned"])              # no P communicator here
        assert x["registered"] == []          # ATP1: nothing crosses, nothing registered
        h = x["halves"]
        assert h["taken"] and h["ag"] == x["ag"] and h["state"] == "done" and h["span"] == 1.0
        assert "D:all_gather@attn_dp.D #3 over group (0, 1) failed (epoch 3, boundary 1): peer gone" in h["failure"]
        assert x["frontier"]["completed"]["attn_dp.D"] == 3


def test_decode_schedule_has_the_dp_attention_pair_on_moe_layers_only():
    """D's schedule (what its iteration enqueues at launch, in run order): per layer the attention-TP
    reduce-scatter, the DP-attention all-gather / reduce-scatter around a MoE layer's experts (not a
    dense layer's: its MLP is whole on every rank), the attention-TP all-gather (issue 36 item 1)."""
    from types import SimpleNamespace

    from ainfer_pd.comm.ordering import D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_GATHER, D_ATP_REDUCE_SCATTER
    from ainfer_pd.comm.topology import Topology
    from ainfer_pd.engine.runtime.tensor_parallel import DecodeHooks, decode_dispatch_rows

    topo = Topology(world_size=4, attn_dp=2, expert_parallel=4, rank=3)          # tp (2, 3), dp (1, 3)
    sizes = {"attn_tp.D": 2, "attn_dp.D": 2}
    colls = SimpleNamespace(topology=topo, members={"attn_tp.D": topo.tp_group, "attn_dp.D": topo.dp_group},
                            size=lambda c: sizes[c], active=lambda k: sizes[k.comm] > 1)
    layers = [SimpleNamespace(is_moe=False), SimpleNamespace(is_moe=True)]
    model = SimpleNamespace(layers=layers, tp_shard=(1, 2))
    hooks = DecodeHooks(colls, model, ep=object(), ctx=None)
    assert hooks.dp and hooks.dp_index == 1 and hooks.adp == 2
    assert hooks.schedule() == [D_ATP_REDUCE_SCATTER, D_ATP_ALL_GATHER,
                                D_ATP_REDUCE_SCATTER, D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_GATHER]
    assert hooks.hooks().experts == hooks.experts_dp
    assert not DecodeHooks(colls, model, ep=None, ctx=None).dp          # no expert parallelism: no gather
    assert decode_dispatch_rows(63, topo) == 64                          # ceil(63 / ATP2) x ADP2
    assert decode_dispatch_rows(64, Topology(world_size=2, attn_dp=1, expert_parallel=2, rank=0)) == 64
