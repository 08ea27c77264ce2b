"""The ranks of one harness launch: one rank's runs over one set of process groups
(:func:`harness_rank`, spawned; :func:`rank_main` also under ``torchrun``) and the parent side
(:func:`run_harness` -> :class:`HarnessOutcome`)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ainfer_pd.errors import ConfigError, RankFailedError, StallError

from .harness import RankRun
from .spec import HarnessSpec, registry_for

__all__ = ["HarnessOutcome", "harness_rank", "rank_main", "run_harness", "summarize_error"]


async def rank_main(rank: int, world_size: int, specs: list[HarnessSpec], *, results: list | None = None,
                     session: dict | None = None) -> list[dict]:
    """Run ``specs`` in order on this rank over one set of process groups.

    ``results`` (optional) receives each run's result as soon as it completed (what ran before a
    failure survives it); ``session`` receives ``topo`` and ``groups``. With NCCL the rank uses
    ``cuda:LOCAL_RANK``, creates its communicators in one global order before any run, and
    aborts them (bounded) when a run fails, so a stalled kernel cannot keep the process alive.
    """
    from ainfer_pd.comm.topology import Topology, build_process_groups
    from ainfer_pd.launch import get_store

    if not specs:
        return []
    s0 = specs[0]
    for s in specs:
        s.validate()
        if (s.world_size, s.attn_dp, s.backend) != (s0.world_size, s0.attn_dp, s0.backend):
            raise ConfigError("all specs of one harness launch must share the topology and the backend")
    if world_size != s0.world_size:
        raise ConfigError(f"{world_size} ranks were started for a world size {s0.world_size} spec")
    topo = Topology(world_size=world_size, attn_dp=s0.attn_dp, expert_parallel=1, rank=rank)
    cuda_index = None
    if s0.backend == "nccl":
        from ainfer_pd.comm.backend import local_cuda_index
        cuda_index = local_cuda_index()
        torch.cuda.set_device(cuda_index)
    groups = build_process_groups(topo, s0.backend, control_timeout_s=max(s.rendezvous_timeout_s for s in specs),
                                  data_timeout_s=max(s.coll_timeout_s for s in specs))
    if session is not None:
        session.update(topo=topo, groups=groups, cuda_index=cuda_index)
    store = get_store()
    out = results if results is not None else []
    try:
        if cuda_index is not None:
            from ainfer_pd.comm.backend import warm_up_nccl
            await asyncio.to_thread(warm_up_nccl, groups, cuda_index)
        for index, s in enumerate(specs):
            if s.run_dir:
                Path(s.run_dir).mkdir(parents=True, exist_ok=True)
                if rank == 0:
                    meta = {"spec": dataclasses.asdict(s), "world_size": world_size, "topology": topo.describe(),
                            "crossed": topo.crossed, "backend": s.backend,
                            "registered_pairs": registry_for(topo, s).describe()}
                    (Path(s.run_dir) / "meta.json").write_text(json.dumps(meta, indent=1))
            run = RankRun(rank, topo, groups, s, store, index)
            out.append(await run.run())
    except BaseException:
        if cuda_index is not None:
            from ainfer_pd.comm.backend import abort_nccl
            await asyncio.to_thread(abort_nccl, groups, 5.0)
        raise
    return out


def harness_rank(rank: int, world_size: int, specs: list[HarnessSpec]) -> list[dict]:
    """Entry point of one rank (spawned): runs ``specs`` in order over one set of groups (the
    data backend of ``specs``; the default group the spawner created is gloo)."""
    return asyncio.run(rank_main(rank, world_size, list(specs)))


# ====================================================================== parent side
@dataclass
class HarnessOutcome:
    """Per-rank outcome of one launch: ``results[r]`` is a list of per-run dicts or an exception."""

    results: list[Any]
    wall_s: float
    specs: list[HarnessSpec] = field(default_factory=list)

    @property
    def errors(self) -> dict[int, BaseException]:
        return {r: v for r, v in enumerate(self.results) if isinstance(v, BaseException)}

    @property
    def completed(self) -> bool:
        return not self.errors

    def runs(self, i: int = 0) -> list[dict]:
        """The i-th run's result dict of every rank (only when every rank completed)."""
        return [v[i] for v in self.results]

    def stalled(self) -> bool:
        return bool(self.errors) and any(isinstance(e, StallError) for e in self.errors.values())


def run_harness(specs: HarnessSpec | list[HarnessSpec], *, timeout_s: float = 120.0,
                fail_grace_s: float | None = None) -> HarnessOutcome:
    """Spawn ``world_size`` ranks running ``specs`` (one launch); never hangs (stragglers are
    killed at ``timeout_s``)."""
    from ainfer_pd.launch import spawn

    specs = [specs] if isinstance(specs, HarnessSpec) else list(specs)
    s0 = specs[0]
    grace = fail_grace_s if fail_grace_s is not None else max(s.rendezvous_timeout_s for s in specs) + 8.0
    t0 = time.perf_counter()
    try:
        results = spawn(harness_rank, s0.world_size, (specs,), timeout_s, return_exceptions=True,
                        fail_grace_s=grace)
    except RankFailedError as exc:
        results = exc.results or [exc] * s0.world_size
    return HarnessOutcome(results=list(results), wall_s=time.perf_counter() - t0, specs=specs)


def summarize_error(exc: BaseException) -> str:
    first = str(exc).split("\n", 1)[0]
    return f"{type(exc).__name__}: {first[:300]}"
