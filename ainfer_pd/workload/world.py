"""The replay over N local rank processes (``ainfer-pd replay --world-size N`` / torchrun).

Every rank is one process running a :class:`~ainfer_pd.RolloutWorker` of the lockstep
multi-rank engine (one attention-DP replica per rank, experts spread over the ranks with
``expert_backend=torch`` unless the config says otherwise). Conversation ``i`` is served
by rank ``i % N``. The ranks start their replay after a barrier; the parent merges the
per-rank records into one result (makespan = the last completion on any rank).

Under torchrun the same holds for ``--nproc-per-node 1``: one lockstep rank with its process
groups (data groups NCCL on CUDA, gloo on CPU; control group gloo) and the torch expert
dispatch, so the N-rank code path can be exercised on one GPU. Rank 0 prints its process
groups' backends.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..config import WorkerConfig
from .replay import ReplayResult
from .trace import Trace


def multirank_config(cfg: WorkerConfig, world_size: int) -> WorkerConfig:
    """The config of one lockstep rank among ``world_size`` (one attention-DP replica per rank,
    experts over every rank with the torch all-to-all). A config already written for this world
    size is kept, except that one rank gets ``expert_backend: torch`` (the lockstep engine)."""
    pc = cfg.parallel
    if pc.world_size == world_size and world_size > 1:
        return cfg
    return cfg.replace(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                          "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch"})


def describe_groups(worker: Any) -> str:
    """One line: this rank's process groups and their backends, the rendezvous, the expert path."""
    eng = worker.engine
    backends = getattr(eng, "group_backends", None)
    if not backends:
        return f"rank {worker.rank}: single-rank Engine (no process groups)"
    groups = " ".join(f"{k}={v}" for k, v in backends.items())
    rdv = getattr(getattr(eng, "rdv", None), "kind", "?")
    ep = "torch all-to-all" if getattr(eng, "dispatchers", None) is not None else "local"
    topo = getattr(eng, "topology", None)
    where = f"; {topo.describe()}; ordering {eng.ordering}" if topo is not None else ""
    return (f"rank {worker.rank} process groups: {groups}; rendezvous {rdv}; expert dispatch {ep}; "
            f"device {eng.device.torch_device}{where}")


async def rank_replay(rank: int, world_size: int, cfg_dict: dict, trace: Trace, cell: str, seed: int,
                       time_scale: float) -> ReplayResult:
    import torch.distributed as dist

    from .. import RolloutWorker
    from .replay import replay
    cfg = WorkerConfig.from_dict(cfg_dict)
    pc = cfg.parallel
    atp = pc.world_size // pc.attn_dp
    # conversation i is served by replica i % ADP, at its leader; TP followers serve none of their own
    leader, replica = rank % atp == 0, rank // atp
    mine = Trace(conversations=[c for i, c in enumerate(trace.conversations)
                                if leader and i % pc.attn_dp == replica], meta=dict(trace.meta))
    async with RolloutWorker(cfg) as worker:
        if rank == 0:
            print(describe_groups(worker), file=sys.stderr, flush=True)
        await asyncio.to_thread(dist.barrier)          # every rank starts its clock together
        res = await replay(worker, mine, cell=cell, seed=seed, time_scale=time_scale,
                           label=f"rank{rank}")
    res.timeline = None
    return res


def merge(results: list[ReplayResult]) -> ReplayResult:
    """One result of the whole world: records of every rank; per-rank metrics averaged
    (counts summed)."""
    first = results[0]
    metrics: dict[str, Any] = {}
    keys = set().union(*(r.metrics.keys() for r in results))
    for k in keys:
        vals = [r.metrics.get(k) for r in results]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(nums) == len(vals):
            metrics[k] = sum(nums) if (k.endswith(("_count", "_sum")) or k in ("rendezvous", "finished", "failures")) \
                else sum(nums) / len(nums)
        elif all(isinstance(v, list) for v in vals):
            metrics[k] = [x for v in vals for x in v]
    metrics["world_size"] = len(results)
    outputs: dict = {}
    for r in results:
        outputs.update(r.outputs)
    return ReplayResult(records=[x for r in results for x in r.records],
                        trajectories=sorted((t for r in results for t in r.trajectories), key=lambda t: t.conversation),
                        outputs=outputs, metrics=metrics, makespan_s=max(r.makespan_s for r in results),
                        cell=first.cell, seed=first.seed, time_scale=first.time_scale, label=first.label,
                        failures=sum(r.failures for r in results),
                        planned_requests=sum(r.planned_requests for r in results),
                        errors=[e for r in results for e in r.errors])


def run_world(cfg: WorkerConfig, trace: Trace, world_size: int, *, cell: str, seed: int, time_scale: float,
              timeout_s: float = 1800.0) -> ReplayResult:
    from ..launch import spawn
    cfg = multirank_config(cfg, world_size)
    results = spawn(rank_replay, world_size, (cfg.to_dict(), trace, cell, seed, time_scale), timeout_s)
    return merge(results)


def run_cli(args: argparse.Namespace) -> int:
    """The ``--world-size N`` path of ``ainfer-pd replay`` / ``bench``."""
    from ..cli import _opt, build_trace, load_config
    from ..metrics.report import aggregate, format_table, summarize
    cfg = load_config(args.config, getattr(args, "set", None), getattr(args, "model", None),
                      getattr(args, "ordering", None))
    trace = build_trace(args, cfg)
    policies = [args.policy] if getattr(args, "policy", None) else [p for p in args.policies.split(",") if p]
    cells = [args.cell or _opt(args, "cell")] if hasattr(args, "cell") else [c for c in args.cells.split(",") if c]
    repeats = int(getattr(args, "repeats", 1) or 1)
    time_scale = _opt(args, "time_scale")
    ws = int(args.world_size)
    pc = multirank_config(cfg, ws).parallel
    print(f"multi-rank replay: world size {ws} (ADP={pc.attn_dp}, ATP={pc.atp}, EP={pc.expert_parallel}, ordering "
          f"{pc.ordering}), {trace.num_requests} requests, policies {policies}, cells {cells}", file=sys.stderr, flush=True)
    failures = 0
    for cell in cells:
        aggs = {}
        for pol in policies:
            c = cfg.replace(**{"scheduler.policy": pol})
            if args.span:
                c = c.replace(**{"mux.span": args.span})
            runs = []
            for rep in range(repeats):
                res = run_world(c, trace, ws, cell=cell, seed=args.seed, time_scale=time_scale)
                failures += res.failures
                runs.append(summarize(res))
                print(f"  {pol} cell {cell} run {rep + 1}: makespan {res.makespan_s:.2f} s, "
                      f"{res.completed}/{res.planned_requests} requests", file=sys.stderr, flush=True)
            aggs[pol] = aggregate(runs)
        print(format_table(aggs, baseline=policies[0], title=f"cell {cell}, world size {ws}"))
    return 1 if failures else 0


def run_torchrun_cli(args: argparse.Namespace) -> int:
    """``torchrun --nproc-per-node N -m ainfer_pd.cli replay ...``: this process is one rank.

    Every rank builds the same trace (same flags, same seed), serves its share of the
    conversations, and rank 0 gathers the records and prints the table."""
    import torch.distributed as dist

    from ..cli import _opt, build_trace, load_config
    from ..launch import destroy_distributed, init_distributed
    from ..metrics.report import aggregate, format_table, summarize
    ctx = init_distributed()
    ws, rank = ctx.world_size, ctx.rank
    cfg = multirank_config(load_config(args.config, getattr(args, "set", None), getattr(args, "model", None),
                      getattr(args, "ordering", None)), ws)
    trace = build_trace(args, cfg)
    policies = [args.policy] if getattr(args, "policy", None) else [p for p in args.policies.split(",") if p]
    cell = (args.cell or _opt(args, "cell")) if hasattr(args, "cell") else args.cells.split(",")[0]
    time_scale = _opt(args, "time_scale")
    failures = 0
    aggs = {}
    try:
        for pol in policies:
            c = cfg.replace(**{"scheduler.policy": pol})
            res = asyncio.run(rank_replay(rank, ws, c.to_dict(), trace, cell, args.seed, time_scale))
            gathered: list = [None] * ws
            dist.all_gather_object(gathered, res)
            merged = merge(gathered)
            failures += merged.failures
            aggs[pol] = aggregate([summarize(merged)])
        if rank == 0:
            print(format_table(aggs, baseline=policies[0], title=f"cell {cell}, world size {ws} (torchrun)"))
    finally:
        destroy_distributed()
    return 1 if failures else 0
