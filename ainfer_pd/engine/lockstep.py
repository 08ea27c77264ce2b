"""The lockstep engine of one rank in a multi-rank worker (any g, ATP, ADP; EP = g).

Ranks are grouped into attention-DP replicas of ATP ranks (:mod:`ainfer_pd.comm.topology`). A
replica's leader owns its requests; its TP followers hold the other head shards
(:mod:`.tensor_parallel`) and run the same segments on the leader's batches
(:mod:`.replica`: one broadcast per D iteration, two per P epoch). Experts are spread over every
rank, so every expert exchange and every D collective needs every rank, in the same order. The
rank-shared planner makes that hold: each *step* the ranks exchange a few counters over the
control rendezvous and take the same decisions from the same numbers:

* a P epoch starts on every rank at the same step (a replica with nothing to prefill runs it with
  an empty batch: it still joins every collective);
* a D iteration runs on every rank when any rank has decode rows, every replica padded to the
  agreed row count (D's collectives gather every replica's rows);
* the turnstile's gating and span come from the same agreed inputs (rank 0's activation).

``parallel.ordering`` routes P's attention all-reduce (:func:`~ainfer_pd.comm.ordering.collective_stream`):
under ``selective`` a registered one goes onto the D stream behind the D launch of the round that
granted it. A :class:`~ainfer_pd.comm.watchdog.Watchdog` turns a device-progress stall into a
:class:`~ainfer_pd.errors.StallError` naming the cross-rank frontier; a failure after a peer
died is raised as :class:`~ainfer_pd.errors.PeerLostError` naming it.
"""
from __future__ import annotations

import asyncio
import itertools
import logging

from ..comm.collectives import RankCollectives
from ..comm.ordering import P_ATP_ALL_REDUCE, collective_stream
from ..comm.topology import ATTN_DP_D, ATTN_TP_D, REPLICA, Topology
from ..comm.watchdog import Watchdog
from ..config import WorkerConfig
from ..errors import AInferPDError, ConfigError, InvalidRequestError, PeerLostError, StallError, WorkerAsleepError
from ..metrics.recorder import Recorder
from ..phase import Phase
from ..sched.planner import plan_decode, plan_prefill
from ..sched.epoch_mode import epoch_mode
from .engine import Engine
from .replica import ReplicaChannel, decode_numel, pack_decode, pack_prefill, pad_decode, unpack_decode, unpack_prefill
from .runner import BatchPlan
from .tensor_parallel import DecodeHooks, PrefillHooks

log = logging.getLogger("ainfer_pd.lockstep")

IDLE_BACKOFF_S = 0.002
STEP_POLL_S = 0.0005
"""Longest a step waits for a local change while a P epoch runs elsewhere or exclusively."""
_instances = itertools.count()


class LockstepEngine(Engine):
    runs_overlap_decode = False     # every rank's D iteration is stepped together and read before the next

    def __init__(self, cfg: WorkerConfig, recorder: Recorder, *, rendezvous, topology: Topology, groups: dict,
                 backend: str, dispatchers=None, store=None) -> None:
        if cfg.scheduler.policy == "mixed-chunked":
            raise ConfigError("mixed-chunked is a single-rank reference; use world_size 1")
        if dispatchers is not None and cfg.device.cuda_graphs and cfg.device.device != "cpu":
            # D's expert exchange is its own dispatcher's all-to-all with host split sizes: not
            # graph-capturable; decode eagerly through the D dispatcher instead.
            log.info("expert-parallel lockstep engine: CUDA-graph decode off (D uses its own all-to-all)")
            cfg = cfg.replace(**{"device.cuda_graphs": False})
        topo = self.topology = topology
        self.world_size = topo.world_size
        self.is_leader = topo.is_replica_leader
        self.ordering = cfg.parallel.ordering
        self.colls = RankCollectives(topo, groups, backend=backend, recorder=recorder)   # one per phase
        self.colls.set_booking(False)                # warm-up passes and graph captures are not traced
        self.dispatchers = dispatchers
        from ..faults import Faults
        self._d_device_delay_s, self._p_coll_delay_s = Faults.load(cfg.faults).phase_skew_s(topo.dp_rank, topo.tp_rank)

        def setup(eng: Engine) -> None:              # before graph capture: the graphs bind these hooks
            from .expert_parallel import ExpertParallel
            r = eng.runner
            if dispatchers is not None:
                r.ep = ExpertParallel(r.model, dispatchers, eng.device)
            self.decode_hooks = DecodeHooks(self.colls.D, r.model, r.ep, eng.decode_ctx)
            r.hooks = {Phase.PREFILL: PrefillHooks(self.colls.P, r.ep, eng.prefill_ctx).hooks(),
                       Phase.DECODE: self.decode_hooks.hooks()}

        super().__init__(cfg, recorder, rendezvous=rendezvous, rank=topo.rank,
                         tp_shard=(topo.tp_rank, topo.atp) if topo.atp > 1 else None, setup=setup)
        self.colls.set_booking(True)
        self.colls.set_gate(self.device.collective_slot)
        self._p_tensor_parallel = topo.atp > 1
        self.rdv = self.rendezvous          # (wrapped by fault injection when configured)
        self.replica = None
        if topo.atp > 1:
            self.replica = ReplicaChannel(groups[REPLICA], rank=topo.rank, leader=topo.replica_leader,
                                          members=topo.tp_group, timeout_s=cfg.parallel.rendezvous_timeout_s)
        self.group_backends: dict[str, str] = {}
        """Process group name -> backend (set by :func:`~ainfer_pd.engine.make.make_engine`)."""
        self._go: asyncio.Queue = asyncio.Queue()
        self.num_steps = 0
        self.num_d_iters = 0
        self._announced = 0           # decode rows this rank announced at the current step
        self._rows_agreed = 0         # the padded rows of every replica's D batch at this step
        self.not_closing: tuple[int, ...] = ()    # ranks whose client was still serving at the last step
        self.closing = False          # this rank's client is done; stop once every rank is
        self.owned_rendezvous = None  # the control rendezvous make_engine created (closed by aclose)
        self.watchdog = Watchdog(rank=topo.rank, world_size=topo.world_size, stall_s=cfg.parallel.stall_timeout_s,
                                 progress=self._progress_key, probe=self._frontier, store=store,
                                 prefix=f"ainfer_pd/engine/{next(_instances)}", busy=self._device_busy)
        # the block-table width of every D broadcast (the widest a row can need, plus the scratch)
        self._table_width = -(-cfg.model.max_context_len // cfg.cache.block_size) + 1

    def check_accepts(self) -> None:
        """A TP follower serves its replica leader's requests, never its own."""
        if not self.is_leader:
            raise InvalidRequestError(f"rank {self.rank} is a TP follower of replica {self.topology.dp_rank}: "
                                      f"submit to its leader, rank {self.topology.replica_leader}")

    def submit(self, turn) -> None:
        self.check_accepts()
        super().submit(turn)

    # ------------------------------------------------------------------ run / failure
    async def run(self) -> None:
        """The step loop, the P worker and the watchdog; raises one typed error on failure."""
        self.watchdog.start()
        try:
            async with asyncio.TaskGroup() as tg:
                prefill = tg.create_task(self._prefill_worker(), name="prefill")
                wd = tg.create_task(self.watchdog.watch(), name="watchdog")
                await self._step_loop()
                prefill.cancel()
                wd.cancel()
        except BaseExceptionGroup as eg:
            first = _first_error(eg)
            if first is None:
                raise
            raise await self._explain(first) from first
        finally:
            self.watchdog.stop()

    async def _explain(self, exc: BaseException) -> BaseException:
        """A failure of this rank's loops: a stall stays a stall; after a peer died, name it."""
        if isinstance(exc, StallError) or not isinstance(exc, Exception):
            return exc
        await asyncio.sleep(1.2)                      # let a dead peer's heartbeat go stale
        lost = self.watchdog.unresponsive(stale_s=1.0)
        if not lost:
            return exc
        names = ", ".join(f"rank {r}" for r in lost)
        return PeerLostError(f"rank {self.rank}: peer {names} died or stopped responding (no heartbeat for > 1 s); "
                             f"this rank failed with {type(exc).__name__}: {exc}", ranks=tuple(lost))

    def _progress_key(self) -> tuple:
        return (sum(s.num_done for s in self.device.streams.values()), self.colls.progress(), self.book.num_finished)

    def _device_busy(self) -> bool:
        return any(s.num_pending for s in self.device.streams.values())

    def _frontier(self) -> dict:
        st = self.device.streams
        return {"d_done": self.num_d_iters, "p_done": st["P"].num_done if "P" in st else 0,
                "requests_done": self.book.num_finished, "epoch": self._epoch, "colls": self.colls.frontier(),
                "pending": {n: s.num_pending for n, s in st.items()}}

    async def aclose(self) -> None:
        """After the loops stopped: close the control rendezvous this engine created (its
        thread would otherwise outlive the worker; one given by the caller stays theirs)."""
        if self.replica is not None:
            self.replica.close()
        rdv, self.owned_rendezvous = self.owned_rendezvous, None
        close = getattr(rdv, "close", None)
        if close is not None:
            await close()

    # ------------------------------------------------------------------ local state
    def _local_p_tokens(self) -> int:
        if self._p_running or not self.is_leader:
            return 0
        book = self.book
        chunks, _ = plan_prefill(book.pending_view(), self.cfg.scheduler.max_prefill_tokens, book.available_blocks())
        return sum(c.num_tokens for c in chunks)

    def _live_rows(self) -> list:
        return [t for t in self.book.decoding if not t.abort_requested]

    # ------------------------------------------------------------------ the step loop
    async def _step_loop(self) -> None:
        """Control + D loop. Each step: exchange (D rows, admissible P tokens, P running,
        rank 0's clock, closing) with every rank; start a P epoch everywhere when any rank has
        P and none is still running one; run one D iteration everywhere when any rank has
        decode rows (through the turnstile rounds while a gated epoch is active).
        Waits for: the step rendezvous, the P worker entering the epoch, the turnstile.
        Unblocked by: every rank arriving."""
        max_rows = self.cfg.scheduler.max_decode_batch
        while True:
            self.num_steps += 1
            self._announced = min(len(self._live_rows()), max_rows)
            now = self.rec.now()                # one clock reading: rank 0's clock and its oldest wait agree
            clock_ms = int(now * 1000)
            waiting = self.book.waiting if self.is_leader else ()
            oldest_ms = int(self._oldest_wait_s(now) * 1000) if self.is_leader else 0
            payload = (self._announced, self._local_p_tokens(), int(self._p_running), clock_ms, int(self.closing),
                       len(waiting), int(self.slowdown.value * 1000), sum(t.remaining_prompt for t in waiting),
                       oldest_ms, int(self.device_ready()))
            t0 = self.rec.now()
            states = await self.rdv.arrive("step", payload, epoch=self._epoch)
            self.rec.sample("step_sync_s", self.rec.now() - t0)
            asleep = tuple(r for r, s in enumerate(states) if not s[9])
            if asleep:
                # NOTE (issue 34, item 13): a rank whose KV pool or weights are off the device (sleep)
                # cannot join an epoch or a D iteration, and every one needs every rank: nothing
                # starts anywhere (the same step on every rank) until all are awake; the turns wait.
                self._asleep_ranks = asleep
                if not self._wait_for_sleepers(states, asleep):
                    return
                await self._changed_or(IDLE_BACKOFF_S)
                continue
            self._asleep_ranks = ()
            total_d = sum(s[0] for s in states)
            total_p = sum(s[1] for s in states)
            self._rows_agreed = self._padded_rows(max(s[0] for s in states))
            any_running = any(s[2] for s in states)
            # NOTE: activation from agreed inputs only (totals, rank 0's clock): identical on every rank
            mux_on = self.activation.update(states[0][3] / 1000.0, total_p, total_d)
            self._exclusive_why = ("no-d" if not total_d else "policy" if not self.traits.turnstile
                                   else None if mux_on else "inactive")
            if mux_on and total_p and not any_running:    # the epoch about to start: does gating it pay?
                mux_on = self._mux_pays(total_d, sum(s[5] for s in states), states[0][6] / 1000.0,
                                        sum(s[7] for s in states), max(s[8] for s in states) / 1000.0)
            if not any_running:
                self._exclusive_epoch = False         # agreed: every rank finished the last epoch
            self.not_closing = tuple(r for r, s in enumerate(states) if not s[4])
            if not self.not_closing and not (total_d or total_p or any_running):
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

    def device_ready(self) -> bool:
        """This rank can run the model: its KV pool and its weights are on the device, and it is
        not going to sleep (:meth:`quiesce`)."""
        st = self.residency.state
        return bool(st.kv) and st.weights == "device" and not self._pausing

    _pausing = False
    _paused_at = 0

    async def quiesce(self) -> None:
        """Before this rank's device memory goes (``sleep(level >= 1)``): announce it asleep and
        wait until the ranks have agreed on it at a step and no epoch of this rank runs any more,
        so no epoch or D iteration that needs this rank starts or is left mid-way on the memory
        being released (every rank needs every other for each one). Peers' turns then wait for
        :meth:`resume` (issue 34, item 13)."""
        self._pausing = True
        self._notify()
        mark = self.num_steps
        while (self.num_steps <= mark + 1 or self._p_running or self.rank not in self._asleep_ranks) \
                and not self.closing:
            await self._changed_or(IDLE_BACKOFF_S)

    def resume(self) -> None:
        """Back from sleep: this rank takes part again from its next step (when its memory is back)."""
        self._pausing = False
        self._notify()

    _asleep_ranks: tuple[int, ...] = ()
    """The ranks that were asleep at the last step (nothing runs while there are any)."""

    def _wait_for_sleepers(self, states, asleep: tuple[int, ...]) -> bool:
        """A step at which ``asleep`` ranks cannot run the model (same decision on every rank). A
        sleeping rank that is also closing never wakes: this rank's queued and decoding turns fail
        with WorkerAsleepError naming it instead of waiting forever; a running epoch (begun
        before the sleep) still ends first. Returns False when the loop is to end (every rank is
        closing and idle)."""
        any_running = any(s[2] for s in states)
        not_closing = tuple(r for r, s in enumerate(states) if not s[4])
        self.not_closing = not_closing
        if self.turnstile.gated_epoch_active:
            self.turnstile.open_gate()              # no D round is owed while D cannot run anywhere
        gone = [r for r in asleep if states[r][4]]
        if gone and not any_running and not self._p_running:
            stuck = [t for t in list(self.book.waiting) + list(self.book.decoding) if not t.abort_requested]
            if stuck:
                self.book.fail_turns(stuck, WorkerAsleepError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, gone))} of this replica are asleep and closing: "
                    f"{len(stuck)} turn(s) cannot run (every step needs every rank awake)"))
        if not not_closing and not any_running and not any(s[0] or s[1] for s in states):
            log.info("rank %d: every rank is closing and idle after %d steps", self.rank, self.num_steps)
            return False
        return True

    def _padded_rows(self, rows: int) -> int:
        """Every replica's D batch size: the largest announced, up to the graph bucket (on CUDA
        the replay and the eager path then gather the same shapes everywhere), a multiple of ATP
        (D's attention reduce-scatter gives each TP rank an equal share; D's DP-attention
        all-gather, equal shares of every replica)."""
        atp = self.topology.atp
        g = self.runner.graphs
        if g is not None:
            fit = [b for b in g.batch_sizes if b >= rows and b % atp == 0]
            if fit:
                return fit[0]
        return -(-rows // atp) * atp

    async def _start_epoch(self, has_d: bool, mux_on: bool) -> None:
        self._epoch += 1
        mode = epoch_mode(self.policy, has_d, mux_on)
        self._exclusive_epoch = mode.exclusive
        entered = asyncio.Event()
        self._p_running = True
        await self._go.put((self._epoch, mode, entered))
        await entered.wait()

    async def _prefill_worker(self) -> None:
        """Background P task. Consumes epochs started by the step loop. A replica leader plans
        its local chunks (maybe none) and shares the batch with its TP followers; a follower
        receives it; both run the epoch's segments, waiting for receive counts and then permits.
        Unblocked by: the step loop."""
        while True:
            epoch, mode, entered = await self._go.get()
            try:
                work, plan = await self._epoch_batch()
                await self._run_epoch(epoch, work, mode, d_enqueued=False, entered=entered,
                                      plan=plan)
            finally:
                entered.set()

    async def _epoch_batch(self) -> tuple[list, BatchPlan]:
        if self.is_leader:
            chunks, admitted = plan_prefill(self.book.pending_view(), self.cfg.scheduler.max_prefill_tokens,
                                            self.book.available_blocks())
            work = self.book.admit(chunks, admitted, self.cfg.scheduler.max_prefill_tokens)
            plan = self.runner.build(work, [])
            if self.replica is not None:
                await self.replica.share(pack_prefill(plan.fb), None, "P batch")
            return work, plan
        buf = await self.replica.share(None, None, "P batch")
        fb = unpack_prefill(buf, self.device.torch_device, self.kv.block_size)
        return [], BatchPlan(fb, [], [], [])

    async def _decode_iteration(self) -> None:
        t_ready = self.rec.now()
        rnd = await self.turnstile.before_decode()
        rows = list(plan_decode(self._live_rows(), self.cfg.scheduler.max_decode_batch))[:self._announced]
        try:
            await self._decode_once(rows, rnd, t_ready)
        finally:
            self.colls.D.complete_pending(ATTN_TP_D)     # a graph replay ran them without host callbacks
            self.colls.D.complete_pending(ATTN_DP_D)
        self.num_d_iters += 1
        self._notify()

    async def _decode_plan(self, rows: list) -> BatchPlan:
        """This replica's D batch; under ATP > 1 padded to the agreed rows (the followers' broadcast
        has that size) and shared with the TP followers."""
        B, r = self._rows_agreed, self.runner
        if not self.is_leader:
            buf = await self.replica.share(None, decode_numel(B, self._table_width), "D batch")
            fb = unpack_decode(buf, B, self._table_width, self.device.torch_device, self.kv.block_size)
            return BatchPlan(fb, [], [], [])
        plan = r.build([], rows)
        if self.replica is None and not self.decode_hooks.dp:
            return plan                  # ATP = 1 and no DP-attention gather: D's dispatcher takes any row count
        # the DP-attention all-gather / reduce-scatter (attn_dp.D) need every replica at the agreed rows
        fb = pad_decode(plan.fb, B, r.scratch_slot, r.scratch_block)
        if self.replica is not None:
            await self.replica.share(pack_decode(fb, self._table_width), decode_numel(B, self._table_width), "D batch")
        return BatchPlan(fb, [], rows, rows)

    def _before_d_launch(self, rnd) -> None:
        """D's collectives in host order, with the round that orders them (trace-check's G)."""
        self.colls.D.enqueue_schedule(self.decode_hooks.schedule(), stream="D",
                                    epoch=rnd.epoch if rnd is not None else None,
                                    boundary=rnd.boundary if rnd is not None else None)

    def _p_all_reduce(self, tensor, *, after, epoch: int, boundary: int, gated: bool):
        """P's attention all-reduce of one layer, on the stream the ordering gives it (selective:
        a registered one on the D stream, behind the D launch of the round that granted it)."""
        stream = collective_stream(self.ordering, P_ATP_ALL_REDUCE, self.colls.registry)
        return self.colls.P.launch(P_ATP_ALL_REDUCE, tensor, device=self.device, stream=stream, epoch=epoch,
                                 boundary=boundary, deps=(after,) if stream != "P" else (),
                                 delay_s=self._p_coll_delay_s, extra={"gated": gated})

    _exclusive_epoch = False

    # ------------------------------------------------------------------ ownership audit
    def ownership_registry(self):
        """Every mutable object of this rank, registered to P, D or the shared set (SPEC 3.4)."""
        from ..comm.experts.ownership import SHARED, OwnershipRegistry
        reg = self.dispatchers.registry() if self.dispatchers is not None else OwnershipRegistry()
        for ctx in (self.prefill_ctx, self.decode_ctx):
            reg.register("engine_stream", f"{ctx.phase.value}.engine_stream", ctx.phase, ctx.stream)
        self.colls.register_owned(reg)               # each phase's attention collectives: its own state
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


def _first_error(eg: BaseExceptionGroup) -> BaseException | None:
    """The typed error of a failed TaskGroup (else its first exception), unwrapped."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            flat.append(e)
    walk(eg)
    flat = [e for e in flat if not isinstance(e, asyncio.CancelledError)]
    typed = [e for e in flat if isinstance(e, AInferPDError)]
    return (typed or flat or [None])[0]
