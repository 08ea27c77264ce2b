"""How a rank's engine is built, and what the engine does not build yet (refused by name).

* World size 1: :class:`~ainfer_pd.engine.engine.Engine` with a local coordinator, except under
  ``torch.distributed`` with ``expert_backend: torch`` (``torchrun --nproc-per-node 1 ...
  replay``): one rank with its process groups (:class:`~ainfer_pd.engine.loop.ranks.DistRanks`),
  the N-rank code path.
* World size g > 1: the same engine with its :class:`~ainfer_pd.engine.loop.ranks.DistRanks`, for
  any attention split (ATP = g / ADP) with experts expert-parallel over every rank (EP = g). Data groups are NCCL on
  CUDA and gloo on CPU (:func:`ainfer_pd.comm.backend.data_backend_for`); the control group is
  always gloo.

:func:`check_engine_support` is the one place that refuses what is not built, with a
:class:`~ainfer_pd.errors.NotBuiltError` naming the missing piece; it is pure (no process
groups), so every named config can be checked anywhere.
"""
from __future__ import annotations

import logging

from ..config import WorkerConfig
from ..errors import ConfigError, NotBuiltError
from ..metrics.recorder import Recorder
from ..sched.epoch_mode import policy_traits
from .engine import Engine

log = logging.getLogger("ainfer_pd.make")


def lockstep_at_world_size_one(cfg: WorkerConfig) -> bool:
    """One rank runs the multi-rank code path (process groups, torch expert dispatch) when
    ``torch.distributed`` is initialised and the config asks for ``expert_backend: torch``."""
    import torch.distributed as dist
    return cfg.parallel.world_size == 1 and cfg.parallel.expert_backend == "torch" and dist.is_initialized()


def check_engine_support(cfg: WorkerConfig) -> None:
    """Refuse, by name, a multi-rank configuration the engine does not build (pure)."""
    pc = cfg.parallel
    g = pc.world_size
    if not policy_traits(cfg.scheduler.policy).multi_rank:
        raise NotBuiltError(f"scheduler.policy={cfg.scheduler.policy} is the single-rank reference loop; use "
                            "world_size 1 without torch.distributed", missing="a multi-rank mixed-chunked loop")
    if cfg.scheduler.overlap_decode is True:  # multi-rank, at any world size (auto: the plain D iteration)
        raise NotBuiltError("scheduler.overlap_decode: the ranks step every D iteration together and read each "
                            "before the next; the overlapped D iteration runs on one rank without process "
                            "groups", missing="an overlapped D iteration across ranks")
    if g == 1:
        return
    if pc.expert_parallel != g:
        raise NotBuiltError(
            f"parallel.expert_parallel={pc.expert_parallel} with world_size={g} means ETP = {pc.etp} "
            f"(experts tensor-parallel over {pc.etp} ranks): expert tensor parallelism is not built; the engine "
            f"spreads whole experts over every rank (expert_parallel = world_size)",
            missing="expert tensor parallelism (ETP > 1)")
    if pc.expert_backend == "deepep":
        raise NotBuiltError(
            "parallel.expert_backend=deepep: the DeepEP dispatchers (ainfer_pd.comm.experts.deepep) are not wired "
            "into the multi-rank engine, which builds P's torch all-to-all; use parallel.expert_backend: torch",
            missing="DeepEP expert dispatch in the multi-rank engine")
    if cfg.cache.routed_experts and g // pc.attn_dp > 1:
        raise NotBuiltError(
            f"cache.routed_experts with attention TP {g // pc.attn_dp}: D's reduce-scatter leaves each TP rank the "
            "routing of its own share of the rows, and the ids are not gathered to the replica's leader",
            missing="routing replay under attention tensor parallelism (a gather of the routed ids)")


def make_engine(cfg: WorkerConfig, recorder: Recorder, *, rank: int = 0, rendezvous=None) -> Engine:
    """The engine for this rank: on one rank (unless :func:`lockstep_at_world_size_one`) with a
    local coordinator, else with its process groups, rendezvous and the phase-owned expert
    dispatchers (P's and D's)."""
    g = cfg.parallel.world_size
    if g == 1 and not lockstep_at_world_size_one(cfg):
        return Engine(cfg, recorder, rendezvous=rendezvous, rank=rank)
    check_engine_support(cfg)
    import torch

    from ..comm.backend import check_backend, data_backend_for, group_backend, local_cuda_index, warm_up_nccl
    from ..comm.topology import Topology, build_process_groups
    from ..launch import get_store
    from ..turnstile.dist_rendezvous import detect_same_host, make_rendezvous
    from .loop.ranks import DistRanks

    rank = _distributed_rank(g)
    pc = cfg.parallel
    topo = Topology.from_config(pc, rank)
    backend = check_backend(data_backend_for(cfg.device.device))    # cuda -> nccl, cpu -> gloo
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(local_cuda_index())   # the engine's device: NCCL communicators bind to it
    groups = build_process_groups(topo, backend, control_timeout_s=pc.rendezvous_timeout_s,
                                  data_timeout_s=pc.rendezvous_timeout_s)
    if cuda:
        warm_up_nccl(groups, torch.cuda.current_device())    # every communicator, one global order, before traffic
    store = get_store()
    same = detect_same_host(store, rank, g, timeout_s=pc.rendezvous_timeout_s)
    rdv = rendezvous or make_rendezvous(pc, topo, same_host=same, group=groups["control"], store=store)
    dispatchers = _phase_dispatchers(cfg, topo, groups, cuda, recorder)
    if cfg.device.cuda_graphs and cfg.device.device != "cpu":
        # D's expert exchange is its own dispatcher's all-to-all with host split sizes: not
        # graph-capturable; decode eagerly through the D dispatcher instead.
        log.info("expert-parallel multi-rank engine: CUDA-graph decode off (D uses its own all-to-all)")
        cfg = cfg.replace(**{"device.cuda_graphs": False})
    dist_ranks = DistRanks(cfg, recorder, topology=topo, groups=groups, backend=backend, rendezvous=rdv,
                           dispatchers=dispatchers, store=store)
    eng = Engine(cfg, recorder, rendezvous=rdv, dist=dist_ranks)
    if rendezvous is None:
        dist_ranks.owned_rendezvous = rdv
    dist_ranks.group_backends = {name: group_backend(pg) for name, pg in groups.items() if name != "world"}
    recorder.event("process_groups", backends=dist_ranks.group_backends,
                   rendezvous=getattr(rdv, "kind", type(rdv).__name__),
                   topology=topo.describe(), registered=dist_ranks.colls.registry.describe(), ordering=pc.ordering,
                   expert_dispatch="P: torch all-to-all (normal); D: its own torch all-to-all (low-latency)")
    return eng


def _distributed_rank(g: int) -> int:
    """This rank, once ``torch.distributed`` is checked to hold the configured ``g`` ranks."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ConfigError("parallel.world_size > 1 needs torch.distributed initialised "
                          "(torchrun, or ainfer_pd.launch.init_distributed)")
    if dist.get_world_size() != g:
        raise ConfigError(f"parallel.world_size={g} but torch.distributed has {dist.get_world_size()} ranks")
    return dist.get_rank()


def _phase_dispatchers(cfg: WorkerConfig, topo, groups: dict, cuda: bool, recorder: Recorder):
    """The phase-owned expert dispatchers: P's normal path, D's low-latency path (SPEC 3.4)."""
    import torch

    from ..comm.experts.base import PhaseDispatchers
    from ..comm.experts.torch_a2a import TorchAllToAllDispatcher
    from ..comm.topology import EP_D, EP_P
    from ..phase import Phase
    from .runtime.tensor_parallel import decode_dispatch_rows
    mc, sc, pc = cfg.model, cfg.scheduler, cfg.parallel
    width = 1 + cfg.spec.num_draft_tokens if cfg.spec.enabled else 1    # a verify pass feeds 1 + K rows per turn
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    common = dict(hidden=mc.hidden_size, top_k=mc.top_k, dtype=mc.torch_dtype, device=dev, recorder=recorder)
    return PhaseDispatchers(
        TorchAllToAllDispatcher(Phase.PREFILL, groups[EP_P], topo.ep_rank, pc.expert_parallel, mc.num_experts,
                                max_tokens=sc.max_prefill_tokens, **common),
        TorchAllToAllDispatcher(Phase.DECODE, groups[EP_D], topo.ep_rank, pc.expert_parallel, mc.num_experts,
                                max_tokens=decode_dispatch_rows(sc.max_decode_batch * width, topo), **common))
