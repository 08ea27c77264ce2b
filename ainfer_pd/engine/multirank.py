"""The lockstep engine of one rank in a multi-rank worker.

Every rank is one attention-DP replica (ATP = 1) and the MoE experts are spread over
the expert-parallel ranks, so every expert exchange (P's and D's, on their own
communicators) needs every rank, in the same order. The rank-shared planner makes that
hold: each *step* the ranks exchange a few counters over the control rendezvous and take
the same decisions from the same numbers:

* a P epoch starts on every rank at the same step (a rank with nothing to prefill runs
  it with an empty batch: it still joins every expert exchange);
* a D iteration runs on every rank when any rank has decode rows (empty rows elsewhere);
* the turnstile's gating and span come from the same agreed inputs (rank 0's activation).

World size 1 uses :class:`~ainfer_pd.engine.engine.Engine` directly, except under
``torch.distributed`` with ``expert_backend: torch`` (``torchrun --nproc-per-node 1 -m
ainfer_pd.cli replay``): then one lockstep rank with its process groups (the same code path as N
ranks). Data groups (expert all-to-all, attention collectives) use NCCL on CUDA and gloo on CPU
(:func:`ainfer_pd.multirank.backend.data_backend_for`); the control group is always gloo.
"""
from __future__ import annotations

import asyncio
import logging

from ..config import WorkerConfig
from ..errors import ConfigError
from ..metrics.recorder import Recorder
from ..sched.planner import plan_decode, plan_prefill
from .engine import TURNSTILE_POLICIES, Engine

log = logging.getLogger("ainfer_pd.multirank")

IDLE_BACKOFF_S = 0.002
STEP_POLL_S = 0.0005
"""Longest a step waits for a local change while a P epoch runs elsewhere or exclusively."""


class LockstepEngine(Engine):
    def __init__(self, cfg: WorkerConfig, recorder: Recorder, *, rendezvous, rank: int, world_size: int,
                 dispatchers=None) -> None:
        if cfg.scheduler.policy == "mixed-chunked":
            raise ConfigError("mixed-chunked is a single-rank reference; use world_size 1")
        if cfg.parallel.attn_dp != world_size:
            raise ConfigError("the multi-rank engine runs one attention-DP replica per rank (attn_dp = world_size); "
                              "ATP > 1 runs through ainfer_pd.multirank")
        if dispatchers is not None and cfg.device.cuda_graphs and cfg.device.device != "cpu":
            # Engine captures the decode graphs before runner.ep exists: they would compute every
            # expert locally and skip D's own all-to-all (expert dispatch with host split sizes is
            # not graph-capturable); decode eagerly through the D dispatcher instead.
            log.info("expert-parallel lockstep engine: CUDA-graph decode off (D uses its own all-to-all)")
            cfg = cfg.replace(**{"device.cuda_graphs": False})
        super().__init__(cfg, recorder, rendezvous=rendezvous, rank=rank)
        self.rdv = self.rendezvous          # (wrapped by fault injection when configured)
        self.group_backends: dict[str, str] = {}
        """Process group name -> backend (set by :func:`make_engine`)."""
        self.world_size = world_size
        if dispatchers is not None:
            from .expert_parallel import ExpertParallel
            self.runner.ep = ExpertParallel(self.runner.model, dispatchers)
        self.dispatchers = dispatchers
        self._go: asyncio.Queue = asyncio.Queue()
        self.num_steps = 0
        self.closing = False          # this rank's client is done; stop once every rank is
        self.owned_rendezvous = None  # the control rendezvous make_engine created (closed by aclose)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            prefill = tg.create_task(self._prefill_worker(), name="prefill")
            await self._step_loop()
            prefill.cancel()

    async def aclose(self) -> None:
        """After the loops stopped: close the control rendezvous this engine created (its
        thread would otherwise outlive the worker; one given by the caller stays theirs)."""
        rdv, self.owned_rendezvous = self.owned_rendezvous, None
        close = getattr(rdv, "close", None)
        if close is not None:
            await close()

    # ------------------------------------------------------------------ local state
    def _local_p_tokens(self) -> int:
        if self._p_running:
            return 0
        chunks, _ = plan_prefill(self._pending_view(), self.cfg.scheduler.max_prefill_tokens, self._available_blocks())
        return sum(c.num_tokens for c in chunks)

    def _live_rows(self) -> list:
        return [t for t in self.decoding if not t.abort_requested]

    # ------------------------------------------------------------------ the step loop
    async def _step_loop(self) -> None:
        """Control + D loop. Each step: exchange (D rows, admissible P tokens, P running,
        rank 0's activation) with every rank; start a P epoch everywhere when any rank has
        P and none is still running one; run one D iteration everywhere when any rank has
        decode rows (through the turnstile rounds while a gated epoch is active).
        Waits for: the step rendezvous, the P worker entering the epoch, the turnstile.
        Unblocked by: every rank arriving."""
        while True:
            self.num_steps += 1
            rows = self._live_rows()
            clock_ms = int(self.rec.now() * 1000)
            payload = (len(rows), self._local_p_tokens(), int(self._p_running), clock_ms, int(self.closing))
            t0 = self.rec.now()
            states = await self.rdv.arrive("step", payload, epoch=self._epoch)
            self.rec.sample("step_sync_s", self.rec.now() - t0)
            total_d = sum(s[0] for s in states)
            total_p = sum(s[1] for s in states)
            any_running = any(s[2] for s in states)
            # NOTE: activation from agreed inputs only (totals, rank 0's clock): identical on every rank
            mux_on = self.activation.update(states[0][3] / 1000.0, total_p, total_d)
            if not any_running:
                self._exclusive_epoch = False         # agreed: every rank finished the last epoch
            if all(s[4] for s in states) and not (total_d or total_p or any_running):
                log.info("rank %d: every rank is closing and idle after %d steps", self.rank, self.num_steps)
                return                                  # the same step on every rank
            if total_p and not any_running:
                await self._start_epoch(total_d > 0, mux_on)
                any_running = True
            if total_d == 0:
                if self.turnstile.gated_epoch_active:
                    self.turnstile.open_gate()          # same step on every rank: D is empty everywhere
                if not any_running:
                    await asyncio.sleep(IDLE_BACKOFF_S)
                else:
                    await self._changed_or(STEP_POLL_S)
                continue
            if any_running and self._exclusive_epoch:
                # strict P priority: D waits for the epoch (everywhere). NOTE: never a bare sleep(0)
                # here: at world size 1 the step rendezvous is immediate, and a spinning loop holds
                # the GIL against the stream threads that launch the epoch's kernels.
                await self._changed_or(STEP_POLL_S)
                continue
            await self._decode_iteration()

    async def _start_epoch(self, has_d: bool, mux_on: bool) -> None:
        self._epoch += 1
        mux = self.policy in TURNSTILE_POLICIES and has_d and mux_on
        exclusive = self.policy == "normal" or (has_d and not mux)
        self._exclusive_epoch = exclusive
        entered = asyncio.Event()
        self._p_running = True
        await self._go.put((self._epoch, mux, exclusive, entered))
        await entered.wait()

    async def _prefill_worker(self) -> None:
        """Background P task. Consumes epochs started by the step loop; plans its local
        chunks (maybe none) and runs the epoch's segments, waiting for receive counts and
        then permits. Unblocked by: the step loop."""
        while True:
            epoch, mux, exclusive, entered = await self._go.get()
            chunks, admitted = plan_prefill(self._pending_view(), self.cfg.scheduler.max_prefill_tokens,
                                            self._available_blocks())
            work = self._admit(chunks, admitted)
            try:
                await self._run_epoch(epoch, work, mux=mux, exclusive=exclusive, d_enqueued=False, entered=entered)
            finally:
                entered.set()

    async def _decode_iteration(self) -> None:
        t_ready = self.rec.now()
        rnd = await self.turnstile.before_decode()
        rows = list(plan_decode(self._live_rows(), self.cfg.scheduler.max_decode_batch))
        await self._decode_once(rows, rnd, t_ready)
        self._notify()

    _exclusive_epoch = False

    # ------------------------------------------------------------------ ownership audit
    def ownership_registry(self):
        """Every mutable object of this rank, registered to P, D or the shared set (SPEC 3.4)."""
        from ..comm.experts.ownership import SHARED, OwnershipRegistry
        if self.dispatchers is not None:
            reg = self.dispatchers.registry()
        else:
            reg = OwnershipRegistry()
        for ctx in (self.prefill_ctx, self.decode_ctx):
            reg.register("engine_stream", f"{ctx.phase.value}.engine_stream", ctx.phase, ctx.stream)
        reg.register("kv_storage", "kv_cache", SHARED, self.runner.kv_cache)
        for name, p in self.runner.model.named_parameters():
            reg.register("weights", name, SHARED, p)
        reg.register("runtime", "control_rendezvous", SHARED, self.rdv)
        return reg

    def audit(self, *, strict: bool = False):
        report = self.ownership_registry().audit(strict=strict)
        self.rec.event("ownership_audit", ok=report.ok, violations=[str(v) for v in report.violations],
                       phase_memory_bytes=report.phase_memory_bytes)
        return report


def lockstep_at_world_size_one(cfg: WorkerConfig) -> bool:
    """One rank runs the lockstep engine (process groups, torch expert dispatch) when
    ``torch.distributed`` is initialised and the config asks for ``expert_backend: torch``."""
    import torch.distributed as dist
    return cfg.parallel.world_size == 1 and cfg.parallel.expert_backend == "torch" and dist.is_initialized()


def make_engine(cfg: WorkerConfig, recorder: Recorder, *, rank: int = 0, rendezvous=None) -> Engine:
    """The engine for this rank: :class:`Engine` at world size 1 (unless
    :func:`lockstep_at_world_size_one`), else the lockstep engine with its process groups,
    rendezvous and phase-owned expert dispatchers."""
    g = cfg.parallel.world_size
    if g == 1 and not lockstep_at_world_size_one(cfg):
        if cfg.scheduler.policy == "mixed-chunked":
            from .mixed import MixedChunkedEngine
            return MixedChunkedEngine(cfg, recorder, rendezvous=rendezvous, rank=rank)
        return Engine(cfg, recorder, rendezvous=rendezvous, rank=rank)
    import torch
    import torch.distributed as dist

    from ..comm.experts.base import PhaseDispatchers
    from ..comm.topology import EP_D, EP_P, Topology, build_process_groups
    from ..launch import get_store
    from ..multirank.backend import check_backend, data_backend_for, group_backend, local_cuda_index
    from ..phase import Phase
    from ..turnstile.dist_rendezvous import detect_same_host, make_rendezvous

    if not dist.is_initialized():
        raise ConfigError("parallel.world_size > 1 needs torch.distributed initialised "
                          "(torchrun, or ainfer_pd.launch.init_distributed)")
    if dist.get_world_size() != g:
        raise ConfigError(f"parallel.world_size={g} but torch.distributed has {dist.get_world_size()} ranks")
    rank = dist.get_rank()
    pc = cfg.parallel
    if pc.expert_parallel not in (1, g):
        raise ConfigError("the lockstep engine needs expert_parallel 1 or world_size (ETP = 1 or g)")
    topo = Topology.from_config(pc, rank)
    backend = check_backend(data_backend_for(cfg.device.device))    # cuda -> nccl, cpu -> gloo
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(local_cuda_index())   # the engine's device: NCCL communicators bind to it
    groups = build_process_groups(topo, backend, control_timeout_s=pc.rendezvous_timeout_s,
                                  data_timeout_s=pc.rendezvous_timeout_s)
    store = get_store()
    same = detect_same_host(store, rank, g, timeout_s=pc.rendezvous_timeout_s)
    rdv = rendezvous or make_rendezvous(pc, topo, same_host=same, group=groups["control"], store=store)
    dispatchers = None
    if pc.expert_parallel > 1 or pc.expert_backend == "torch":
        mc, sc = cfg.model, cfg.scheduler
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if pc.expert_backend == "deepep":
            raise ConfigError("expert_backend=deepep runs through ainfer_pd.comm.experts.deepep on GPU hosts; "
                              "the lockstep engine uses expert_backend=torch") from None
        from ..comm.experts.torch_a2a import TorchAllToAllDispatcher
        common = dict(hidden=mc.hidden_size, top_k=mc.top_k, dtype=mc.torch_dtype, device=dev, recorder=recorder)
        dispatchers = PhaseDispatchers(
            TorchAllToAllDispatcher(Phase.PREFILL, groups[EP_P], topo.ep_rank, pc.expert_parallel, mc.num_experts,
                                    max_tokens=sc.max_prefill_tokens, **common),
            TorchAllToAllDispatcher(Phase.DECODE, groups[EP_D], topo.ep_rank, pc.expert_parallel, mc.num_experts,
                                    max_tokens=sc.max_decode_batch, **common))
    eng = LockstepEngine(cfg, recorder, rendezvous=rdv, rank=rank, world_size=g, dispatchers=dispatchers)
    if rendezvous is None:
        eng.owned_rendezvous = rdv
    eng.group_backends = {name: group_backend(pg) for name, pg in groups.items() if name != "world"}
    recorder.event("process_groups", backends=eng.group_backends, rendezvous=getattr(rdv, "kind", type(rdv).__name__),
                   expert_dispatch="torch all-to-all" if dispatchers is not None else "local")
    return eng
