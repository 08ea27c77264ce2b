"""The engine of one rank: one step, as in SPEC's diagram, over a coordinator.

Each step every rank announces what it could do (:class:`~ainfer_pd.sched.step.StepInputs`), the
coordinator gives every rank's announcement (one rank: its own at once; several: a rendezvous on
the control group) and :func:`~ainfer_pd.sched.step.decide_step` gives every rank the same
decision: start a P epoch (run by the P driver on its own task, stopping at safe boundaries for
turnstile rounds while it is gated), run one D iteration (the D driver: D first, through the
round P's next boundary opens), or wait. Policies (SPEC section 4) are data (:mod:`~ainfer_pd.sched.epoch_mode`):

* ``normal``          D is not run while any P is admissible or running (strict P priority).
* ``global-complete`` turnstile with one boundary per P epoch, published after the epoch *completed*.
* ``global-enqueue``  turnstile with one boundary per P epoch, published once it is fully *enqueued*.
* ``fine-grained``    turnstile at every safe boundary (layer ends and expert notification points).
* ``mixed-chunked``   its own loop (:mod:`.loop.mixed`): every step one batch of decode rows plus a
                      prefill chunk, composed of the same book and runner.

The turns served, their admission, tokens and endings are the :class:`~.turns.TurnBook`
(``engine.book``, synchronous). All state is touched only from the event loop thread; streams
only compute.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import torch

from ..config import WorkerConfig
from ..errors import DeviceStallError, InvalidRequestError, WorkerAsleepError, first_error
from ..faults import Faults, FaultyRendezvous
from ..metrics.recorder import Recorder
from ..metrics.stats import percentile, work_s
from ..phase import Phase, PhaseContext
from ..sched.epoch_mode import policy_traits
from ..sched.span import Activation, SpanInputs, make_span_policy
from ..sched.step import COUNTERS, StepDecision, StepInputs, decide_step
from ..spec.make import make_speculator
from ..turnstile.rendezvous import LocalRendezvous
from ..turnstile.turnstile import Turnstile
from .runtime.device import Device, make_device
from .kv.kv_cache import KVCacheManager
from .loop.coordinator import IDLE_BACKOFF_S, LocalCoordinator, RankCoordinator
from .loop.d_driver import DDriver
from .loop.device_watch import device_watchdog
from .loop.mixed import run_mixed
from .loop.p_driver import PDriver
from .loop.timings import EngineTimings
from .loop.p_walk import GATED_LANE
from .kv.residency import Residency, kv_blocks_for_device
from .runtime.mtp_runner import MtpRunner
from .runtime.runner import ModelRunner, RunnerSections, graph_captures
from .runtime.warmup import warmup_prefill
from .loop.state import Turn
from .loop.turns import TurnBook

log = logging.getLogger("ainfer_pd.engine")


class Engine:
    """One rank's engine. ``dist``: the multi-rank parts (:class:`~.loop.ranks.DistRanks`; None on
    one rank without ``torch.distributed``), which also make the coordinator a rank rendezvous."""

    def __init__(self, cfg: WorkerConfig, recorder: Recorder, *, rendezvous=None, rank: int = 0, dist=None) -> None:
        self.cfg, self.rec, self.dist = cfg, recorder, dist
        self.rank = dist.rank if dist is not None else rank
        self.policy = cfg.scheduler.policy
        self.traits = policy_traits(self.policy)
        self.faults = Faults.load(cfg.faults)
        if self.faults.active and rendezvous is not None:
            rendezvous = FaultyRendezvous(rendezvous, self.faults)
        self.rendezvous = rendezvous
        dc = cfg.device                   # the streams' launcher threads start with their first item
        self.device: Device = make_device(
            dc.device, recorder, residency_slots=dc.residency_slots, collective_slots=dc.collective_slots,
            dp_collective_slots=dc.dp_collective_slots, collective_wait_s=cfg.parallel.rendezvous_timeout_s,
            threads_per_stream=dc.cpu_threads_per_stream, high_priority_stream=dc.high_priority_stream,
            lane_sms={("P", GATED_LANE): dc.p_stream_sms})
        self.runner: ModelRunner | None = None
        try:
            self._build_device(cfg, recorder)
            self._changed = asyncio.Event()    # replaced on every notify: waiters re-check their predicate
            self.book = TurnBook(cfg.model, cfg.scheduler, recorder, self.kv, routed=self.runner.routed, notify=self.notify,
                                 reserve=cfg.cache.output_reserve)
            span_policy = make_span_policy(cfg.mux) if self.traits.per_layer else (lambda _inp: 1)
            self.turnstile = Turnstile(rendezvous=rendezvous or LocalRendezvous(), span=span_policy, recorder=recorder,
                                       rank=self.rank, timeout_s=cfg.parallel.rendezvous_timeout_s,
                                       load=self._span_inputs)
            self.activation = Activation(threshold=cfg.mux.activation_threshold, cooldown_s=cfg.mux.activation_cooldown_s)
            self.timings = EngineTimings(recorder)
            self._build_drivers(cfg, recorder, dist)
        except BaseException:
            # NOTE: a failed start (load, capture, warm-up, cost table) joins its stream threads and
            # frees the device memory, or the process cannot exit; then its own error propagates
            try:
                self.shutdown()
            except Exception as e:              # noqa: BLE001 - must not mask the start's error
                log.warning("rank %d: releasing a failed engine start failed: %r", self.rank, e)
            raise
        self.coord = (LocalCoordinator(self.wait_changed) if dist is None else
                      RankCoordinator(self.rendezvous, recorder, dist.world_size, self.wait_changed, dist.mtp))
        self.num_steps = 0
        self.closing = False          # this rank's client is done; stop once every rank is
        self.not_closing: tuple[int, ...] = ()    # ranks whose client was still serving at the last step
        self.asleep_ranks: tuple[int, ...] = ()   # the ranks that were asleep at the last step
        self.asleep_at = 0                        # the last step that agreed this rank asleep
        self._exclusive = False                   # the epoch running (on some rank) was started exclusive
        self._pausing = False
        self.stepping = False         # the step loop runs (quiesce waits only for a loop that steps)

    def _build_device(self, cfg: WorkerConfig, recorder: Recorder) -> None:
        """KV pool, runner, phase contexts; then (CUDA) each phase's graphs and P's warm-up."""
        dc = cfg.device
        if self.device.kind == "cpu":
            torch.set_num_threads(dc.cpu_threads_per_stream)
        num_blocks = kv_blocks_for_device(cfg, self.device.kind)
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, sharing=cfg.cache.prefix_sharing,
                                 wait_min_tokens=cfg.cache.prefix_wait_min_tokens)
        self.runner = (MtpRunner if cfg.spec.mtp else ModelRunner)(   # mtp: its passes feed the MTP drafter
            RunnerSections.from_config(cfg), self.device.torch_device, self.kv,
            tp_shard=self.dist.tp_shard if self.dist is not None else None)
        self.residency = Residency(self.runner)
        self.prefill_ctx = PhaseContext(Phase.PREFILL, self.device.stream("P"))
        self.decode_ctx = PhaseContext(Phase.DECODE, self.device.stream("D"))
        if self.dist is not None:
            self.dist.install(self)           # the phase hooks, before the graphs bind them
        if self.device.kind == "cuda" and dc.cuda_graphs:  # each on its phase's stream, thread (phase_capture)
            for ctx, capture, label in graph_captures(self.runner, self.decode_ctx, self.prefill_ctx):
                ctx.stream.submit(capture, ctx, label=label).enqueued().result()
        if self.device.kind == "cuda" and dc.warmup_prefill:
            self.prefill_ctx.stream.submit(warmup_prefill, self.runner, self.prefill_ctx,
                                           cfg.scheduler.max_prefill_tokens, label="P.warmup").enqueued().result()
            torch.cuda.synchronize()

    def _build_drivers(self, cfg: WorkerConfig, recorder: Recorder, dist) -> None:
        common = dict(rec=recorder, book=self.book, runner=self.runner, turnstile=self.turnstile,
                      timings=self.timings, faults=self.faults, notify=self.notify)
        d_delay = p_delay = 0.0
        if dist is not None:
            d_delay, p_delay = self.faults.phase_skew_s(dist.topology.dp_rank, dist.topology.tp_rank)
        self.p = PDriver(**common, sched=cfg.scheduler, mux=cfg.mux, timeout_s=cfg.parallel.rendezvous_timeout_s,
                         ctx=self.prefill_ctx, drain=self.drain_stream,
                         all_reduce=dist.p_all_reduce_hook(self.device, p_delay) if dist is not None else None,
                         share=dist.share_prefill if dist is not None and dist.replica is not None else None,
                         is_leader=dist is None or dist.is_leader, isolate_failures=dist is None,
                         cpu=self.device.kind == "cpu")
        self.overlap_decode = (dist is None and not self.traits.mixed_steps
                               and cfg.scheduler.overlap_decode in (True, "auto"))
        self.spec = make_speculator(cfg, self.runner, self.decode_ctx, recorder, dist)
        self.d = DDriver(**common, sched=cfg.scheduler, max_context_len=cfg.model.max_context_len,
                         ctx=self.decode_ctx, p=self.p, overlap=self.overlap_decode, dist=dist, spec=self.spec)
        # replicas out of phase: D waits before its first crossed collective of each iteration where
        # the groups cross (the four-rank cycle's pair), else before the iteration
        crossed = dist.colls.D.crossed_comms() if dist is not None else []
        self.d.device_delay_s = 0.0 if crossed else d_delay
        if crossed and d_delay:
            dist.colls.D.skew_s = {c: d_delay for c in crossed}
        if dist is None:
            self.p.decide, self.p.changed = self._decide_epoch, lambda: self._changed
        else:
            dist.attach(self)

    # ================================================================== turns (the book holds them)
    @property
    def multi_rank(self) -> bool:
        """The steps are a rendezvous of ranks (which leave together: :meth:`begin_closing`)."""
        return self.dist is not None

    def check_accepts(self) -> None:
        """Raise unless this rank takes requests (a TP follower serves its replica leader's)."""
        d = self.dist
        if d is not None and not d.is_leader:
            raise InvalidRequestError(f"rank {self.rank} is a TP follower of replica {d.topology.dp_rank}: "
                                      f"submit to its leader, rank {d.topology.replica_leader}")

    def submit(self, turn: Turn) -> None:
        self.check_accepts()
        self.book.submit(turn)

    # ================================================================== changes
    def notify(self) -> None:
        """Something the loops wait on changed: wake every waiter (no task is created)."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_for(self, pred: Callable[[], bool]) -> None:
        while not pred():
            await self._changed.wait()

    async def wait_changed(self, timeout_s: float | None = None, seen: asyncio.Event | None = None) -> None:
        """Wait until a change after ``seen`` was taken (now when None), at most ``timeout_s``."""
        ev = seen if seen is not None else self._changed
        if timeout_s is None:
            await ev.wait()
            return
        try:
            async with asyncio.timeout(timeout_s):
                await ev.wait()
        except TimeoutError:
            pass

    # ================================================================== the step
    async def run(self) -> None:
        """Owns the loops for the worker's TaskGroup; raises one typed error on failure. A watchdog
        runs beside them: the ranks' (several), the device's (one rank: :mod:`.loop.device_watch`)."""
        wd = self.dist.watchdog if self.dist is not None else device_watchdog(self)
        wd.start()
        self.stepping = not self.traits.mixed_steps
        try:
            async with asyncio.TaskGroup() as tg:
                watch = tg.create_task(wd.watch(), name="watchdog")
                if self.traits.mixed_steps:
                    await run_mixed(self)
                else:
                    prefill = tg.create_task(self.p.run(), name="prefill")
                    try:
                        await self._steps()
                    finally:
                        self.d.abandon()
                    prefill.cancel()
                watch.cancel()
        except BaseExceptionGroup as eg:
            first = first_error(eg)
            if first is None:
                raise
            if isinstance(first, DeviceStallError):     # its shutdown must not wait for the device
                self.device.mark_stalled(str(first))
            raise (await self.dist.explain(first) if self.dist is not None else first) from first
        finally:
            self.stepping = False
            wd.stop()

    async def _steps(self) -> None:
        """The step loop: announce, agree, decide; then start P, run D, or wait."""
        while True:
            self.num_steps += 1
            seen = self._changed                  # a change from here on ends this step's wait
            mine = self._inputs()
            states = await self.coord.exchange(mine, epoch=self.p.epoch)
            on = self.activation.update(states[0].clock_ms / 1000.0, sum(s.p_tokens for s in states),
                                        sum(s.d_rows for s in states))
            dec = decide_step(states, self.traits, self.cfg.mux, activation_on=on, exclusive_running=self._excl())
            self.not_closing = dec.not_closing
            # agreed: the epoch started exclusive stays so until a step at which no rank runs one
            self._exclusive = dec.epoch.exclusive if dec.epoch is not None else self._exclusive and dec.p_running
            if dec.asleep:
                if not await self._asleep_step(dec, seen):
                    return
                continue
            self.asleep_ranks = ()
            if dec.stop:
                log.info("rank %d: every rank is closing and idle after %d steps", self.rank, self.num_steps)
                await self.d.settle()
                return
            await self._act(dec, mine, seen)

    async def _act(self, dec: StepDecision, mine: StepInputs, seen: asyncio.Event) -> None:
        """One step's decision: start the epoch, then D's iteration, or wait for a change."""
        if self.dist is not None:
            self.dist.agree_rows(dec.d_rows, self.runner.graphs)
        if dec.epoch is not None and self.dist is not None:     # one rank: the P task starts it
            if dec.why in COUNTERS:
                self.rec.count(COUNTERS[dec.why])
            await self.p.start(dec.epoch, dec.why, d_enqueued=self.d.in_flight)
        if dec.run_d:
            await self.d.iteration(limit=mine.d_rows if self.dist is not None else None, verify=dec.verify)
            return
        await self.d.settle()
        if dec.open_gate and self.turnstile.gated_epoch_active:
            # no D round is owed to a gated epoch while no rank has rows (issue 13, case 2: the last
            # row finished, was aborted or slept away mid-epoch); new rows appear only when it ends
            self.turnstile.open_gate()
        if mine.d_rows:
            self.d.wanted()                       # D waits for an exclusive epoch
        if dec.p_running:
            await self.coord.wait_epoch(seen)
        else:
            await self.coord.idle(seen)

    def _excl(self) -> bool:
        """The epoch running was started exclusive: one rank's own epoch, or the agreed flag."""
        return self.p.exclusive if self.dist is None else self._exclusive

    def _decide_epoch(self) -> tuple | None:
        """One rank, on the P task: the step's P decision (the next epoch's item, or None)."""
        mine = self._inputs()
        on = self.activation.update(mine.clock_ms / 1000.0, mine.p_tokens, mine.d_rows)
        dec = decide_step([mine], self.traits, self.cfg.mux, activation_on=on, exclusive_running=self._excl())
        if dec.asleep or dec.stop or dec.epoch is None:
            return None
        if dec.why in COUNTERS:
            self.rec.count(COUNTERS[dec.why])
        return self.p.begin(dec.epoch, dec.why, d_enqueued=self.d.in_flight)

    def _inputs(self) -> StepInputs:
        now = self.rec.now()                # one clock reading: rank 0's clock and its oldest wait agree
        waiting = self.book.waiting if self.p.is_leader else ()
        oldest = max((now - t.t_submit for t in waiting), default=0.0)
        return StepInputs(d_rows=min(len(self.d.live_rows()), self.cfg.scheduler.max_decode_batch),
                          p_tokens=self.p.admissible_tokens(), p_running=self.p.running, clock_ms=int(now * 1000),
                          closing=self.closing, waiting_turns=len(waiting),
                          slowdown_milli=int(self.p.slowdown.value * 1000),
                          backlog_tokens=sum(t.remaining_prompt for t in waiting), oldest_wait_ms=int(oldest * 1000),
                          device_ready=self.device_ready(), d_drafting=self.d.would_draft())

    def _span_inputs(self) -> SpanInputs:
        """What the span policy sees (rank 0's answer is used on every rank)."""
        book = self.book
        return SpanInputs(num_d_rows=len(book.decoding), max_d_rows=self.cfg.scheduler.max_decode_batch,
                          num_p_waiting_tokens=sum(t.remaining_prompt for t in book.waiting),
                          p_budget_tokens=self.cfg.scheduler.max_prefill_tokens,
                          d_iter_s=self.timings.d_iter_ema, p_boundary_s=self.timings.p_boundary_ema)

    # ================================================================== sleep
    def device_ready(self) -> bool:
        """This rank can run the model: its KV pool and its weights are on the device, and it is
        not going to sleep (:meth:`quiesce`)."""
        st = self.residency.state
        return bool(st.kv) and st.weights == "device" and not self._pausing

    async def _asleep_step(self, dec: StepDecision, seen: asyncio.Event) -> bool:
        """A step at which ``dec.asleep`` ranks cannot run the model (same decision on every rank):
        nothing starts anywhere until all are awake. A sleeping rank that is also closing never
        wakes: this rank's turns fail with WorkerAsleepError naming it instead of waiting forever
        (a running epoch, begun before the sleep, still ends first). False: the loop ends."""
        self.asleep_ranks = dec.asleep
        if self.rank in dec.asleep:
            self.asleep_at = self.num_steps
        await self.d.settle()
        if self.turnstile.gated_epoch_active:
            self.turnstile.open_gate()              # no D round is owed while D cannot run anywhere
        gone = [r for r in dec.asleep if r not in dec.not_closing]
        if gone and not dec.p_running:
            stuck = [t for t in list(self.book.waiting) + list(self.book.decoding) if not t.abort_requested]
            if stuck:
                self.book.fail_turns(stuck, WorkerAsleepError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, gone))} of this replica are asleep and closing: "
                    f"{len(stuck)} turn(s) cannot run (every step needs every rank awake)"))
        if dec.stop:
            log.info("rank %d: every rank is closing and idle after %d steps", self.rank, self.num_steps)
            return False
        await self.coord.idle(seen)
        return True

    async def quiesce(self) -> None:
        """Before this rank's device memory goes (``sleep(level >= 1)``): announce it asleep and
        wait until the ranks have agreed on it at a step and no epoch of this rank runs any more,
        so no epoch or D iteration that needs this rank starts or is left mid-way on the memory
        being released. Turns then wait for :meth:`resume` (issue 34, item 13)."""
        self._pausing = True
        self.notify()
        mark = self.num_steps           # the step under way announced this rank awake
        while (self.asleep_at <= mark or self.p.running or self.rank not in self.asleep_ranks) \
                and not self.closing and self.stepping:
            await self.wait_changed(IDLE_BACKOFF_S)

    def resume(self) -> None:
        """Back from sleep: this rank takes part again from its next step (when its memory is back)."""
        self._pausing = False
        self.notify()

    def begin_closing(self) -> None:
        """This rank's client is done: the loop ends once every rank is closing and idle."""
        self.closing = True
        self.notify()

    # ================================================================== ending
    async def drain_stream(self, stream) -> None:
        """Wait until every item submitted to ``stream`` so far has run (FIFO barrier)."""
        await asyncio.wrap_future(stream.submit(lambda: None, label="barrier").enqueued())

    async def aclose(self) -> None:
        """After the loops stopped: release what the engine owns beyond its threads (the
        multi-rank control rendezvous it created)."""
        if self.dist is not None:
            await self.dist.aclose()

    def metrics(self) -> dict[str, Any]:
        m = self.rec.summary()
        p_work, d_work = work_s(self.rec.intervals, "P"), work_s(self.rec.intervals, "D")   # set-up left out
        m.update({"policy": self.policy, "p_work_s_sum": p_work, "d_work_s_sum": d_work, "num_epochs": self.p.epoch})
        m.update(self.book.metrics())
        if self.spec is not None:
            m.update(self.spec.metrics())
        m.update({
            "activation_switches": self.activation.switches,
            "p_gated_slowdown": self.p.slowdown.value,
            "d_wait_s_samples": list(self.rec.samples.get("d_wait_s", [])),
            "ttft_s_samples": list(self.rec.samples.get("ttft_s", [])),
        })
        if alone := self.rec.samples.get("d_iter_alone_s"):   # the optimistic bound's chain: a fast D iteration alone
            m["d_iter_alone_s"] = percentile(alone, 10)
        return m

    def shutdown(self) -> None:
        """Join the stream threads; on CUDA free the device memory (weights, KV, graphs: the next worker fits)."""
        self.faults.release_hangs()       # an injected device hang ends, so its thread joins
        self.device.shutdown()            # a stalled device's memory stays: freeing it waits for the device
        if self.device.kind == "cuda" and self.runner is not None and self.device.stalled is None:
            self.runner.release_cuda()
