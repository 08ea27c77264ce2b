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
from .options import build_trace, config_of, opt
from .replay import ReplayResult
from .report import aggregate, format_table, summarize
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
    eng = worker.engine.dist
    backends = eng.group_backends if eng is not None else None
    if not backends:
        return f"rank {worker.rank}: single-rank Engine (no process groups)"
    groups = " ".join(f"{k}={v}" for k, v in backends.items())
    rdv = getattr(eng.rdv, "kind", "?")
    ep = "torch all-to-all" if eng.dispatchers is not None else "local"
    where = f"; {eng.topology.describe()}; ordering {eng.ordering}"
    return (f"rank {worker.rank} process groups: {groups}; rendezvous {rdv}; expert dispatch {ep}; "
            f"device {worker.engine.device.torch_device}{where}")


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
    # the engine stops only once every rank closed: read the metrics now, so that they cover the
    # whole run on every rank (a follower's replay, with no conversations, returns at once)
    res.metrics = worker.metrics()
    res.timeline = None
    return res


WORLD_EVENTS = frozenset({"rendezvous", "rendezvous_s_count", "step_sync_s_count", "num_epochs",
                          "p_epoch_s_count", "d_iter_s_count"})
"""Counts of events every rank of a lockstep world takes part in (each turnstile rendezvous, step,
epoch and D iteration is one act of all ranks): the world's figure is one rank's count, not the sum."""
REQUEST_SAMPLES = frozenset({"ttft_s", "d_wait_s", "request_latency_s"})
"""Samples taken per request or per D launch with rows: only the ranks that serve conversations
(the replica leaders) hold them; pooled (counts and sums added, the mean over every sample)."""
RANK_COUNTERS = frozenset({"finished", "failures", "aborted", "dropped_results", "prefill_tokens",
                           "prefix_reused_tokens", "prefix_prompt_tokens", "kv_evictions", "kv_preemptions", "trajectories",
                           "spec_verifies", "spec_drafted", "spec_accepted", "spec_empty_plans", "spec_rows_skipped",
                           "spec_verify_joined", "spec_verify_pad_positions"})
"""Counters of things that belong to one rank (its requests, its KV pool, its rows' drafts and the
padding it ran for other replicas' verifies): summed over ranks."""
DEVICE_FRACTIONS = frozenset({"busy_fraction", "concurrent_fraction"})
"""A rank's device-time fractions: averaged over the ranks that ran device work (a rank without any
has no window, not a fraction of 0)."""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merge_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of one world from its ranks' ``worker.metrics()`` (taken after the world stopped,
    followers included). Each key is merged by what it counts, over the ranks that hold it:

    * :data:`WORLD_EVENTS`: one rank's count (the largest; ``<key>_per_rank`` keeps every rank's,
      ``world_events_agree`` says whether they were all equal);
    * :data:`REQUEST_SAMPLES` (``X_count`` / ``X_sum`` / ``X_mean``): pooled over the ranks holding
      samples (D wait and TTFT come from the replica leaders, never diluted by followers' absence);
    * other sample families: ``X_mean`` pooled, ``X_sum`` averaged over the ranks holding it (one
      rank's time in that state), ``X_count`` one rank's count (the largest);
    * :data:`RANK_COUNTERS`: summed; :data:`DEVICE_FRACTIONS`: averaged over the ranks with device
      work; any other number: averaged over the ranks holding it; lists: concatenated; anything
      else: the first rank's value.
    """
    keys: list[str] = []
    for m in per_rank:
        keys += [k for k in m if k not in keys]
    out = _merge_sample_families(per_rank, keys)
    worked = [m for m in per_rank if (m.get("p_work_s_sum") or 0) > 0 or (m.get("d_work_s_sum") or 0) > 0]
    agree = True
    for k in keys:
        if k not in out:
            agree = _merge_key(out, k, per_rank, worked) and agree
    out["world_events_agree"] = agree
    return out


def _merge_sample_families(per_rank: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """``X_count`` / ``X_sum`` / ``X_mean`` of every sample family ``X`` (see :func:`merge_metrics`)."""
    out: dict[str, Any] = {}
    fams = {k[: -len(suf)] for k in keys for suf in ("_count", "_sum", "_mean") if k.endswith(suf)}
    for fam in fams:
        holders = [m for m in per_rank if _num(m.get(f"{fam}_count")) and m[f"{fam}_count"] > 0
                   and _num(m.get(f"{fam}_sum"))]
        if not holders:
            continue
        n, tot = sum(m[f"{fam}_count"] for m in holders), sum(m[f"{fam}_sum"] for m in holders)
        if fam in REQUEST_SAMPLES:
            out[f"{fam}_count"], out[f"{fam}_sum"] = n, tot
        else:
            out[f"{fam}_count"] = max(m[f"{fam}_count"] for m in holders)
            out[f"{fam}_sum"] = tot / len(holders)
        out[f"{fam}_mean"] = tot / n
    return out


def _merge_key(out: dict[str, Any], k: str, per_rank: list[dict[str, Any]], worked: list[dict[str, Any]]) -> bool:
    """Merge key ``k`` into ``out`` (numbers by :func:`_merge_number`, lists concatenated, anything
    else the first rank's); False when it is a world event the ranks counted differently."""
    vals = [m[k] for m in per_rank if k in m]
    nums = [v for v in vals if _num(v)]
    if nums and len(nums) == len(vals):
        return _merge_number(out, k, nums, per_rank, worked)
    if vals and all(isinstance(v, list) for v in vals):
        out[k] = [x for v in vals for x in v]
    elif vals:
        out[k] = vals[0]
    return True


def _merge_number(out: dict[str, Any], k: str, nums: list, per_rank: list[dict[str, Any]],
                  worked: list[dict[str, Any]]) -> bool:
    """A numeric key by what it counts (see :func:`merge_metrics`); False when it is a world event
    the ranks counted differently."""
    if k in WORLD_EVENTS:
        out[k] = max(nums)
        out[f"{k}_per_rank"] = [m.get(k) for m in per_rank]
        return len(set(nums)) == 1 and len(nums) == len(per_rank)
    if k in RANK_COUNTERS:
        out[k] = sum(nums)
    elif k in DEVICE_FRACTIONS:
        src = [m[k] for m in worked if _num(m.get(k))] or nums
        out[k] = sum(src) / len(src)
    else:
        out[k] = sum(nums) / len(nums)
    return True


def merge(results: list[ReplayResult]) -> ReplayResult:
    """One result of the whole world: the records of every rank, the metrics merged by
    :func:`merge_metrics`."""
    first = results[0]
    metrics = merge_metrics([r.metrics for r in results])
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


SPLIT = (("split_p_epochs", "P epochs", "{:.0f}"), ("split_p_epoch_ms", "P epoch ms", "{:.1f}"),
         ("split_p_permit_wait_s", "permit wait s", "{:.3f}"), ("split_p_counts_wait_s", "counts wait s", "{:.3f}"),
         ("split_rendezvous_s", "rdv s", "{:.3f}"), ("rendezvous", "rdv", "{:.0f}"),
         ("split_d_boundary_wait_s", "D bnd wait s", "{:.3f}"), ("split_d_iters", "D iters", "{:.0f}"))
"""The P epoch split of a multi-rank run (one rank's: counts of world events, times averaged over ranks)."""


def epoch_split(m: dict[str, Any]) -> dict[str, float]:
    """Where a rank's P epochs went (merged metrics, :func:`merge_metrics`): epochs and their mean
    wall time, the rank's total time waiting for permits, for receive counts, in rendezvous, and D's
    boundary waits."""
    g = lambda k: float(m.get(k, 0.0) or 0.0)        # noqa: E731
    return {"split_p_epochs": g("p_epoch_s_count"), "split_p_epoch_ms": 1e3 * g("p_epoch_s_mean"),
            "split_p_permit_wait_s": g("p_wait_permit_s_sum"), "split_p_counts_wait_s": g("p_counts_wait_s_sum"),
            "split_rendezvous_s": g("rendezvous_s_sum"), "split_d_boundary_wait_s": g("d_boundary_wait_s_sum"),
            "split_d_iters": g("d_iter_s_count")}


def format_split(aggs: dict[str, dict[str, dict[str, float]]]) -> str:
    """The P epoch split per policy (medians over the repeats), one line each."""
    lines = ["P epoch split (per rank, medians): " + ", ".join(h for _, h, _ in SPLIT)]
    for pol, agg in aggs.items():
        vals = [fmt.format(agg[k]["median"]) if k in agg else "-" for k, _, fmt in SPLIT]
        lines.append(f"  {pol}: " + "  ".join(vals))
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """The ``--world-size N`` path of ``ainfer-pd replay`` / ``bench``."""
    cfg = config_of(args)
    trace = build_trace(args, cfg)
    policies = [args.policy] if getattr(args, "policy", None) else [p for p in args.policies.split(",") if p]
    cells = [args.cell or opt(args, "cell")] if hasattr(args, "cell") else [c for c in args.cells.split(",") if c]
    repeats = int(getattr(args, "repeats", 1) or 1)
    time_scale = opt(args, "time_scale")
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
                runs.append(summarize(res) | epoch_split(res.metrics))
                print(f"  {pol} cell {cell} run {rep + 1}: makespan {res.makespan_s:.2f} s, "
                      f"{res.completed}/{res.planned_requests} requests", file=sys.stderr, flush=True)
            aggs[pol] = aggregate(runs)
        print(format_table(aggs, baseline=policies[0], title=f"cell {cell}, world size {ws}"))
        print(format_split(aggs))
    return 1 if failures else 0


def run_torchrun_cli(args: argparse.Namespace) -> int:
    """``torchrun --nproc-per-node N -m ainfer_pd.tools.cli replay ...``: this process is one rank.

    Every rank builds the same trace (same flags, same seed), serves its share of the
    conversations, and rank 0 gathers the records and prints the table."""
    import torch.distributed as dist

    from ..launch import destroy_distributed, init_distributed
    ctx = init_distributed()
    ws, rank = ctx.world_size, ctx.rank
    cfg = multirank_config(config_of(args), ws)
    trace = build_trace(args, cfg)
    policies = [args.policy] if getattr(args, "policy", None) else [p for p in args.policies.split(",") if p]
    cell = (args.cell or opt(args, "cell")) if hasattr(args, "cell") else args.cells.split(",")[0]
    time_scale = opt(args, "time_scale")
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
