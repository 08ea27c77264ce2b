"""The ownership-audit row of ``ainfer-pd selftest`` (SPEC 7.3).

Two real rank processes run the lockstep engine with expert parallelism over the torch
all-to-all backend; each audits its registry of phase-owned and shared objects (must pass),
then plants a counter shared by P and D (must fail).
"""
from __future__ import annotations

import argparse
from typing import Any


async def _rank_audit(rank: int, world_size: int) -> dict[str, Any]:
    from .. import RolloutWorker, SamplingParams
    from ..config import WorkerConfig
    from ..errors import OwnershipAuditError
    from ..config_files import config_path
    from ..phase import Phase
    cfg = WorkerConfig.from_yaml(config_path("tiny-cpu")).replace(**{
        "parallel.world_size": world_size, "parallel.attn_dp": world_size,
        "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
        "scheduler.policy": "fine-grained"})
    async with RolloutWorker(cfg) as w:
        out = await w.generate(list(range(2, 40)), SamplingParams(max_new_tokens=4, temperature=0.0))
        await w.release(out.trajectory_id)
        report = w.audit()
        from ..comm.experts.ownership import rank_registry
        reg = rank_registry(w.engine)
        counter = w.engine.dist.dispatchers.decode._recv_counts
        reg.register("counters", "planted.shared", Phase.PREFILL, identity=id(counter))
        reg.register("counters", "planted.shared", Phase.DECODE, identity=id(counter))
        try:
            reg.audit(strict=True)
            planted_fails = False
        except OwnershipAuditError:
            planted_fails = True
    return {"ok": report.ok, "violations": [str(v) for v in report.violations],
            "phase_memory_bytes": report.phase_memory_bytes, "planted_fails": planted_fails}


def ownership_audit_row(args: argparse.Namespace | None = None) -> dict[str, Any]:
    from ..launch import spawn
    res = spawn(_rank_audit, 2, (), 120.0)
    ok = all(r["ok"] for r in res) and all(r["planted_fails"] for r in res)
    mem = res[0]["phase_memory_bytes"]
    return {"check": "ownership audit, real engine (EP=2, torch all-to-all)",
            "expect": "passes on every rank; a planted shared counter fails",
            "result": (f"audit ok on {sum(r['ok'] for r in res)}/2 ranks, planted fails on "
                       f"{sum(r['planted_fails'] for r in res)}/2; P-owned state {mem / 2**20:.2f} MiB/rank"),
            "ok": ok}
