"""The GPU gate's ``nccl`` section (issue 36, item 5): the NCCL path of the crossed pair's collectives.

The crossed pair is P's attention-TP all-reduce (``attn_tp.P``) against D's DP-attention all-gather /
reduce-scatter across the replicas (``attn_dp.D``). On one GPU (world size 1, NCCL) this runs,
through the library's own code:

(a) ``collectives``: a real NCCL world from :func:`ainfer_pd.launch.spawn` (127.0.0.1, a free
    port), the crossed config's groups (:func:`~ainfer_pd.comm.topology.build_process_groups`),
    D's DP-attention and attention-TP collectives and P's attention-TP all-reduce through the
    rank's :class:`~ainfer_pd.comm.collectives.RankCollectives` (host enqueue, then the device half),
    and P's and D's expert dispatch (:class:`~ainfer_pd.comm.experts.torch_a2a.TorchAllToAllDispatcher`
    on ``ep.P`` / ``ep.D``), on CUDA tensors in float32 and bfloat16. At one rank a gather, a
    reduce-scatter and an all-reduce are the identity: the checks are the values, shapes, dtypes and
    device, and that every ``torch.distributed`` call of each phase went to that phase's own group
    object (the calls are recorded with the group they were given) as many times as the library
    counted (:attr:`~ainfer_pd.comm.collectives.PhaseCollectives.issued`).
(b) ``engine``: the multi-rank engine (``make_engine``'s lockstep path: process groups, NCCL data
    groups, the rendezvous, the phase-owned dispatchers) on ``configs/tiny-crossed-cpu.yaml`` shrunk to
    world size 1 (ADP 1, EP 1, the torch all-to-all; CUDA, eager decode) with D's attention-TP and
    DP-attention communicators issuing over their one rank (``AINFER_PD_ONE_RANK_COLLECTIVES``): a few
    concurrent two-turn conversations, greedy, whose tokens must equal the single-rank engine's and
    the same lockstep engine's without those (identity) collectives; D's DP-attention collectives must
    have been issued (the library's own counters: two per MoE layer per D iteration).

Run by ``benchmarks/gpu_gate.py --only nccl`` (a subprocess: ``python benchmarks/_gate_nccl.py --json
OUT``); ``--device cpu`` runs the same logic on gloo (``tests/test_gate_nccl_cpu.py``). Check names
start with the data backend (``nccl_...`` on the GPU, ``gloo_...`` on CPU).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

try:                                  # benchmarks/ on sys.path (the gate) or benchmarks as a package (tests)
    from _gate_section import finish, run_section
except ImportError:
    from benchmarks._gate_section import finish, run_section

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny-crossed-cpu.yaml"
ONE_RANK = "attn_tp.D,attn_dp.D"
"""D's communicators that issue over their one rank in the engine part."""
DIST_CALLS = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
              "reduce_scatter_tensor", "all_to_all_single")
"""The ``torch.distributed`` functions the recorder wraps (the ones the phase collectives and the
torch all-to-all dispatcher call)."""
CONVERSATIONS, MAX_NEW = 4, 8


def crossed_dims(world_size: int) -> tuple[int, int]:
    """(ADP, EP) of the crossed config shrunk to ``world_size``: two attention-DP replicas where
    there are ranks for them (ATP = g / 2; crossed from 4 ranks on), experts over every rank."""
    return (2 if world_size >= 2 and world_size % 2 == 0 else 1), world_size


# ====================================================================== results
class Results:
    """What one rank found: ``checks`` (name -> [ok, detail]) and ``figures``; names are prefixed
    with the data backend."""

    def __init__(self, backend: str) -> None:
        self.prefix = backend
        self.checks: dict[str, list] = {}
        self.figures: dict[str, Any] = {}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks[f"{self.prefix}_{name}"] = [bool(ok), detail]
        return bool(ok)

    def fig(self, name: str, value: Any) -> None:
        self.figures[f"{self.prefix}_{name}"] = value

    def guarded(self, name: str, fn, *a, **k):
        """``fn`` raising is a failed check ``name`` with its error (the later parts still run)."""
        try:
            return fn(*a, **k)
        except Exception as exc:  # noqa: BLE001 - a crashing part is a failed check
            traceback.print_exc()
            self.check(name, False, f"raised {type(exc).__name__}: {str(exc)[:400]}")
            return None

    def as_dict(self) -> dict:
        return {"checks": self.checks, "figures": self.figures}


@contextlib.contextmanager
def record_dist_calls():
    """Every call of :data:`DIST_CALLS` made through ``torch.distributed`` in the body, as
    ``(function name, group object)`` in call order (the library calls them through the module)."""
    import torch.distributed as dist
    calls: list[tuple[str, Any]] = []
    saved = {n: getattr(dist, n) for n in DIST_CALLS if hasattr(dist, n)}

    def wrap(name: str, fn):
        def recorded(*a, **k):
            calls.append((name, k.get("group")))
            return fn(*a, **k)
        return recorded
    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _rank_device(device: str):
    """This rank's torch device: its own GPU (``LOCAL_RANK``), made current before any NCCL call."""
    import torch
    if device != "cuda":
        return torch.device("cpu")
    from ainfer_pd.comm.backend import local_cuda_index
    idx = local_cuda_index()
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ====================================================================== (a) the collectives
def collectives_part(rank: int, world_size: int, dev, backend: str, R: Results) -> None:
    import torch
    import torch.distributed as dist

    from ainfer_pd.comm.backend import group_backend, warm_up_nccl
    from ainfer_pd.comm.collectives import RankCollectives
    from ainfer_pd.comm.ordering import (D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_GATHER, D_ATP_REDUCE_SCATTER,
                                         P_ATP_ALL_REDUCE)
    from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, CONTROL, EP_D, EP_P, Topology, build_process_groups
    from ainfer_pd.errors import DistributedError

    adp, ep = crossed_dims(world_size)
    topo = Topology(world_size, adp, ep, rank)
    t0 = time.perf_counter()
    groups = build_process_groups(topo, backend, control_timeout_s=120, data_timeout_s=120)
    warmed = warm_up_nccl(groups, dev.index) if dev.type == "cuda" else []
    R.fig("groups_build_s", round(time.perf_counter() - t0, 3))
    colls = RankCollectives(topo, groups, backend=backend, recorder=None)
    P, D = colls.P, colls.D
    data = (ATTN_TP_P, ATTN_TP_D, ATTN_DP_D, EP_P, EP_D)
    backends = {n: group_backend(groups[n]) for n in (*data, CONTROL)}
    distinct = len({id(groups[n]) for n in data}) == len(data)
    owned = (set(P.groups) == {ATTN_TP_P} and set(D.groups) == {ATTN_TP_D, ATTN_DP_D}
             and all(P.groups[c] is groups[c] for c in P.groups) and all(D.groups[c] is groups[c] for c in D.groups))
    R.check("groups_phase_owned",
            owned and distinct and all(backends[n] == backend for n in data) and backends[CONTROL] == "gloo"
            and str(dist.get_backend()) == backend and P.native == D.native == (backend == "nccl")
            and (dev.type != "cuda" or set(warmed) >= {ATTN_TP_P, ATTN_TP_D, ATTN_DP_D, EP_P, EP_D}),
            f"{topo.describe()}; P owns {sorted(P.groups)}, D owns {sorted(D.groups)}, "
            f"{'distinct' if distinct else 'SHARED'} group objects; backends {backends}; warmed {warmed}")

    def base(r: int, rows: int, dtype) -> torch.Tensor:
        """Rank r's rows: small integers (exact in bfloat16 and in every sum here)."""
        v = torch.arange(rows * 8, dtype=torch.float32, device=dev).view(rows, 8) % 13 + 16 * r
        return v.to(dtype)

    def one(phase, kind, x, stream):
        phase.enqueue(kind, stream=stream)          # the host half (numbers it on its communicator) ...
        return phase.run(kind, x)                   # ... then the device half

    # native: the tensor-native ops (NCCL's); gloo runs both its own and the native ones
    modes = (True,) if backend == "nccl" else (False, True)
    results: dict[str, list] = {"dp_all_gather": [], "dp_reduce_scatter": [], "tp_pair": [], "p_all_reduce": []}
    routed: dict[str, list] = {}
    before = {"P": dict(P.issued), "D": dict(D.issued)}
    with record_dist_calls() as calls:
        for native in modes:
            P.native = D.native = native
            for dtype in (torch.float32, torch.bfloat16):
                tag = f"{'native' if native else 'list'}-{str(dtype).split('.')[-1]}"
                # D's DP-attention all-gather: [B, D] per member -> [ADP B, D] in member order
                B = 3
                dpm = D.members[ATTN_DP_D]
                n0 = len(calls)
                g = one(D, D_ADP_ALL_GATHER, base(rank, B, dtype), "D")
                want = torch.cat([base(m, B, dtype) for m in dpm])
                results["dp_all_gather"].append((tag, _same(g, want, dev), g.shape == want.shape, g.dtype == dtype))
                routed.setdefault(D_ADP_ALL_GATHER.name, []).extend(calls[n0:])
                # D's DP-attention reduce-scatter: [ADP B, D] partials -> [B, D], own rows of the sum
                n0 = len(calls)
                y = one(D, D_ADP_REDUCE_SCATTER, base(rank, len(dpm) * B, dtype), "D")
                full = sum(base(m, len(dpm) * B, torch.float32) for m in dpm)
                want = full.chunk(len(dpm), 0)[dpm.index(rank)].to(dtype)
                results["dp_reduce_scatter"].append((tag, _same(y, want, dev), y.shape == want.shape, y.dtype == dtype))
                routed.setdefault(D_ADP_REDUCE_SCATTER.name, []).extend(calls[n0:])
                # D's attention-TP reduce-scatter then all-gather (the bytes of one all-reduce)
                tpm = D.members[ATTN_TP_D]
                n0 = len(calls)
                s = one(D, D_ATP_REDUCE_SCATTER, base(rank, len(tpm) * B, dtype), "D")
                h = one(D, D_ATP_ALL_GATHER, s, "D")
                want = sum(base(m, len(tpm) * B, torch.float32) for m in tpm).to(dtype)
                results["tp_pair"].append((tag, _same(h, want, dev), h.shape == want.shape, h.dtype == dtype))
                routed.setdefault("D:attn_tp.D", []).extend(calls[n0:])
                # P's attention-TP all-reduce (the crossed pair's other half)
                n0 = len(calls)
                o = one(P, P_ATP_ALL_REDUCE, base(rank, B, dtype), "P")
                want = sum(base(m, B, torch.float32) for m in P.members[ATTN_TP_P]).to(dtype)
                results["p_all_reduce"].append((tag, _same(o, want, dev), o.shape == want.shape, o.dtype == dtype))
                routed.setdefault(P_ATP_ALL_REDUCE.name, []).extend(calls[n0:])
        _sync(dev)
    for name, rows in results.items():
        bad = [r[0] for r in rows if not all(r[1:])]
        R.check({"dp_all_gather": "d_dp_attention_all_gather", "dp_reduce_scatter": "d_dp_attention_reduce_scatter",
                 "tp_pair": "d_attn_tp_reduce_scatter_all_gather", "p_all_reduce": "p_attn_tp_all_reduce"}[name],
                not bad, f"{len(rows) - len(bad)} of {len(rows)} cases equal (values, shape, dtype, device {dev})"
                + (f"; wrong: {bad}" if bad else ""))
    expect = {D_ADP_ALL_GATHER.name: groups[ATTN_DP_D], D_ADP_REDUCE_SCATTER.name: groups[ATTN_DP_D],
              "D:attn_tp.D": groups[ATTN_TP_D], P_ATP_ALL_REDUCE.name: groups[ATTN_TP_P]}
    wrong = {k: [n for n, pg in routed[k] if pg is not expect[k]] for k in expect}
    issued = {"P": {c: P.issued[c] - before["P"][c] for c in P.issued},
              "D": {c: D.issued[c] - before["D"][c] for c in D.issued}}
    n_calls = {c: sum(len(routed[k]) for k in expect if expect[k] is groups[c]) for c in (ATTN_TP_P, ATTN_TP_D, ATTN_DP_D)}
    counted = {ATTN_TP_P: issued["P"][ATTN_TP_P], ATTN_TP_D: issued["D"][ATTN_TP_D], ATTN_DP_D: issued["D"][ATTN_DP_D]}
    booked = all(pc.completed == pc.enqueued and not pc.inflight for pc in (P, D))
    R.check("collectives_on_phase_communicators",
            not any(wrong.values()) and all(routed[k] for k in expect) and n_calls == counted and booked,
            f"torch.distributed calls per collective {{{', '.join(f'{k}: {sorted({n for n, _ in routed[k]})} x{len(routed[k])}' for k in expect)}}}; "
            f"on another group: {wrong}; issued {counted} vs calls {n_calls}; "
            f"enqueued = completed: {booked}")
    R.fig("collectives_issued", issued)
    try:
        P.run(D_ADP_ALL_GATHER, base(rank, 2, torch.float32))
        refused = ""
    except DistributedError as exc:
        refused = str(exc)
    R.check("cross_phase_refused", "phase-owned" in refused, refused[:200] or "P ran a D collective")
    expert_dispatch(rank, topo, groups, dev, R)


def _same(out, want, dev) -> bool:
    import torch
    return out.device == dev and out.shape == want.shape and torch.equal(out.float(), want.float())


def expert_dispatch(rank: int, topo, groups: dict, dev, R: Results) -> None:
    """P's (split at the notification, as the P walk runs it) and D's (back to back) expert exchange
    over their own ``ep.P`` / ``ep.D``: expert ``e`` multiplies its rows by ``e + 1``, so a token's
    output is ``sum_j w_j (e_j + 1) x``."""
    import torch

    from ainfer_pd.comm.experts.torch_a2a import TorchAllToAllDispatcher
    from ainfer_pd.comm.topology import EP_D, EP_P
    from ainfer_pd.phase import Phase

    E, k, Dh, T = 8, 2, 64, 24
    gen = torch.Generator().manual_seed(100 + rank)
    for phase, comm in ((Phase.PREFILL, EP_P), (Phase.DECODE, EP_D)):
        disp = TorchAllToAllDispatcher(phase, groups[comm], topo.ep_rank, topo.ep, E, hidden=Dh, top_k=k,
                                       max_tokens=64, dtype=torch.float32, device=dev)
        lo, hi = disp.local_expert_range
        x = torch.randn(T, Dh, generator=gen).to(dev)
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
        idx[0, 1] = -1                                           # a slot sent nowhere
        w = torch.tensor([0.5, 0.25], device=dev).expand(T, k).contiguous()

        def expert_fn(xg, counts, lo=lo, hi=hi):
            eid = lo + torch.repeat_interleave(torch.arange(hi - lo, device=dev), counts, output_size=xg.shape[0])
            return xg * (eid + 1).to(xg.dtype)[:, None]
        with record_dist_calls() as calls:
            if phase is Phase.PREFILL:
                nt = disp.notify(idx)
                nt.wait_sync()                                   # P awaits the counts (then its permit)
                d = disp.dispatch(nt, x, idx, w)
                out = disp.combine(d, expert_fn(d.x, d.counts))
            else:
                out = disp.run_moe(x, idx, w, expert_fn)
            disp.quiesce()
            _sync(dev)
        valid = (idx >= 0).to(x.dtype)
        want = (x[:, None, :] * (w * (idx + 1).to(x.dtype) * valid)[:, :, None]).sum(1)
        err = float((out - want).abs().max())
        on_own = [n for n, pg in calls if pg is not groups[comm]]
        R.check(f"{phase.value.lower()}_expert_dispatch",
                out.device == dev and out.shape == want.shape and err <= 1e-5 and bool(calls) and not on_own,
                f"{phase.value} over {comm} (EP {topo.ep}, experts [{lo}, {hi})): max err {err:.1e}; "
                f"{len(calls)} torch.distributed calls {sorted({n for n, _ in calls})}, "
                f"{len(on_own)} on another group")


# ====================================================================== (b) the engine
def engine_config(device: str, lockstep: bool):
    """``configs/tiny-crossed-cpu.yaml`` at world size 1 on ``device``, eager decode: the lockstep
    engine's (``expert_backend: torch``) or the single-rank engine's (``local``)."""
    from ainfer_pd.config import WorkerConfig
    return WorkerConfig.from_yaml(CONFIG).replace(**{
        "parallel.world_size": 1, "parallel.attn_dp": 1, "parallel.expert_parallel": 1,
        "parallel.expert_backend": "torch" if lockstep else "local", "parallel.ordering": "selective",
        "device.device": device, "device.cuda_graphs": False, "scheduler.overlap_decode": False,
        # not a stall test: the first D iteration on a GPU may compile its kernels (Triton JIT)
        "parallel.stall_timeout_s": 180.0, "parallel.rendezvous_timeout_s": 180.0})


async def _conversations(worker) -> dict:
    """Concurrent two-turn conversations, greedy: {(conversation, turn): tokens}."""
    from ainfer_pd import SamplingParams
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs: dict = {}

    async def conv(i: int) -> None:
        rng = random.Random(1000 + i)
        o = await worker.generate([rng.randrange(2, 512) for _ in range(rng.randrange(20, 90))], sp)
        outs[(i, 0)] = list(o.token_ids)
        o2 = await worker.continue_(o.trajectory_id, [rng.randrange(2, 512) for _ in range(rng.randrange(5, 30))], sp)
        outs[(i, 1)] = list(o2.token_ids)
        await worker.release(o.trajectory_id)
    async with asyncio.TaskGroup() as tg:
        for i in range(CONVERSATIONS):
            tg.create_task(conv(i))
    return outs


async def _run_engine(device: str, lockstep: bool, one_rank: str) -> dict:
    from ainfer_pd import RolloutWorker
    from ainfer_pd.comm.collectives import ONE_RANK_ENV
    from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D
    cfg = engine_config(device, lockstep)
    old = os.environ.pop(ONE_RANK_ENV, None)
    if one_rank:
        os.environ[ONE_RANK_ENV] = one_rank      # read when the rank's phase collectives are built
    t0 = time.perf_counter()
    try:
        async with RolloutWorker(cfg) as w:
            eng = w.engine
            outs = await _conversations(w)
            info = {"outs": outs, "wall_s": round(time.perf_counter() - t0, 2), "d_iters": eng.d.num_iters,
                    "device": str(eng.device.torch_device), "lockstep": eng.dist is not None}
            if eng.dist is not None:
                D = eng.dist.colls.D
                info.update(dp_path=bool(eng.dist.decode_hooks.dp), tp_path=bool(eng.dist.decode_hooks.tp),
                            backends=dict(eng.dist.group_backends),
                            issued={c: D.issued[c] for c in (ATTN_TP_D, ATTN_DP_D)},
                            completed={c: D.completed[c] for c in (ATTN_TP_D, ATTN_DP_D)},
                            enqueued={c: D.enqueued[c] for c in (ATTN_TP_D, ATTN_DP_D)},
                            moe_layers=sum(bool(lyr.is_moe) for lyr in eng.runner.model.layers),
                            dp_group_is_own=all(D.groups[ATTN_DP_D] is not pg for pg in
                                                (*eng.dist.colls.P.groups.values(), D.groups[ATTN_TP_D])),
                            expert_dispatches={"P": eng.dist.dispatchers.prefill.stats["combine"],
                                               "D": eng.dist.dispatchers.decode.stats["combine"]})
            return info
    finally:
        os.environ.pop(ONE_RANK_ENV, None)
        if old is not None:
            os.environ[ONE_RANK_ENV] = old


def engine_part(device: str, backend: str, R: Results) -> None:
    from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D
    ref = asyncio.run(_run_engine(device, False, ""))
    run = asyncio.run(_run_engine(device, True, ONE_RANK))
    ctl = asyncio.run(_run_engine(device, True, ""))
    turns = len(ref["outs"])
    diff = sorted(k for k in ref["outs"] if run["outs"].get(k) != ref["outs"][k])
    R.check("engine_tokens_equal_single_rank",
            run["lockstep"] and not ref["lockstep"] and not diff and len(run["outs"]) == turns == 2 * CONVERSATIONS,
            f"{turns - len(diff)} of {turns} turns equal ({CONVERSATIONS} conversations x 2 turns, {MAX_NEW} tokens "
            f"each, greedy) on {run['device']}; lockstep engine {'yes' if run['lockstep'] else 'NO'}"
            + (f"; differ: {diff}" if diff else ""))
    dp, iters, moe = run.get("issued", {}).get(ATTN_DP_D, 0), run["d_iters"], run.get("moe_layers", 0)
    done = run.get("completed", {}).get(ATTN_DP_D, -1)
    backends = run.get("backends", {})
    R.check("engine_d_dp_attention_issued",
            # every D iteration runs the whole schedule: two per MoE layer (more only if other D
            # passes, e.g. speculative verification, went through the hooks too)
            run.get("dp_path", False) and dp >= done >= 2 * moe * iters > 0 and done % (2 * moe) == 0
            and run["enqueued"] == run["completed"] and backends.get(ATTN_DP_D) == backend
            and backends.get(ATTN_TP_D) == backend and run.get("dp_group_is_own", False)
            and min(run.get("expert_dispatches", {"P": 0}).values()) > 0,
            f"D's DP-attention path {'on' if run.get('dp_path') else 'OFF'}: attn_dp.D issued {dp}, booked {done} "
            f"= 2 x {moe} MoE layers x {iters} D iterations: {done == 2 * moe * iters}; attn_tp.D issued "
            f"{run.get('issued', {}).get(ATTN_TP_D)}; expert exchanges (P, D) {run.get('expert_dispatches')}; "
            f"group backends {backends}")
    cdiff = sorted(k for k in ctl["outs"] if run["outs"].get(k) != ctl["outs"][k])
    R.check("engine_one_rank_collectives_change_no_token",
            not cdiff and not ctl.get("dp_path", True) and ctl.get("issued", {}).get(ATTN_DP_D, -1) == 0,
            f"the same lockstep engine without D's one-rank collectives: {turns - len(cdiff)} of {turns} turns equal, "
            f"attn_dp.D issued {ctl.get('issued', {}).get(ATTN_DP_D)}")
    R.fig("engine", {"turns": turns, "d_iters": iters, "moe_layers": moe, "issued": run.get("issued"),
                     "expert_dispatches": run.get("expert_dispatches"),
                     "completed": run.get("completed"), "wall_s": {"single_rank": ref["wall_s"], "lockstep": run["wall_s"],
                                                                   "lockstep_no_one_rank": ctl["wall_s"]}})


# ====================================================================== one rank
def rank_main(rank: int, world_size: int, device: str, parts: tuple[str, ...]) -> dict:
    """One rank of the section (``torch.distributed`` is initialised by :func:`ainfer_pd.launch.spawn`)."""
    import torch.distributed as dist
    backend = "nccl" if device == "cuda" else "gloo"
    R = Results(backend)
    dev = _rank_device(device)
    R.check("world", str(dist.get_backend()) == backend and dist.get_world_size() == world_size,
            f"rank {rank} of {dist.get_world_size()}, default group {dist.get_backend()}, device {dev}")
    if "collectives" in parts:
        R.guarded("collectives", collectives_part, rank, world_size, dev, backend, R)
    if "engine" in parts and world_size == 1:
        R.guarded("engine", engine_part, device, backend, R)
    return R.as_dict()


def run(device: str = "cuda", world_size: int = 1, parts: tuple[str, ...] = ("collectives", "engine"),
        timeout_s: float = 210.0) -> dict:
    """The section over ``world_size`` fresh rank processes; per check, every rank's verdict joined
    (ok only where every rank's is; the details of rank 0, or of the first failing rank)."""
    from ainfer_pd.launch import spawn
    mod = importlib.import_module("benchmarks._gate_nccl")       # the rank function by its importable name
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        from ainfer_pd.comm.backend import require_cuda
        require_cuda("the gate's nccl section")
    t0 = time.perf_counter()
    ranks = spawn(mod.rank_main, world_size, (device, tuple(parts)), timeout_s, backend=backend)
    out: dict = {"checks": {}, "figures": {}, "world_size": world_size, "backend": backend}
    for r, res in enumerate(ranks):
        for name, (ok, detail) in res["checks"].items():
            prev = out["checks"].get(name)
            if prev is None:
                out["checks"][name] = [ok, detail if r == 0 else f"rank {r}: {detail}"]
            elif prev[0] and not ok:
                out["checks"][name] = [False, f"rank {r}: {detail}"]
        if r == 0:
            out["figures"] = res["figures"]
    out["figures"][f"{backend}_section_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


# ====================================================================== the gate's side
def section(out_dir: Path, run_sub, check, fig, *, timeout: int = 240, device: str = "cuda") -> None:
    """``benchmarks/gpu_gate.py``'s ``nccl`` part: this module as a subprocess (``run_sub``, the
    gate's) on the GPU, its checks and figures recorded through the gate's ``check`` / ``fig`` (they
    land in latest.json); ``nccl_section_completes`` says the subprocess ended cleanly."""
    run_section("nccl", Path(__file__).resolve(), ["--device", device, "--timeout", str(max(30, timeout - 30))],
                out_dir, run_sub, check, fig, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where the checks and figures go")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--parts", default="collectives,engine")
    ap.add_argument("--timeout", type=float, default=210.0, help="the rank processes' deadline (s)")
    args = ap.parse_args()
    try:
        res = run(args.device, args.world_size, tuple(args.parts.split(",")), args.timeout)
    except Exception as exc:  # noqa: BLE001 - a rank that died or hung (spawn names it) is a failed check
        traceback.print_exc()
        backend = "nccl" if args.device == "cuda" else "gloo"
        res = {"checks": {f"{backend}_ranks_finish": [False, f"{type(exc).__name__}: {str(exc)[:800]}"]},
               "figures": {}}
    finish(res, args.json)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
