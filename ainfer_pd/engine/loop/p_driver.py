"""The P driver: the background P task that runs the epochs the engine's step starts.

An epoch is started by the step (the same step on every rank) and run here, on its own task, so
the step goes on to D while P walks: its batch (planned and admitted here; a TP follower receives
its leader's), the model's segments on the P stream (:class:`~ainfer_pd.engine.loop.p_walk.EpochWalk`),
stopping at safe boundaries for the turnstile when the epoch is gated, then the epoch's tokens.
Waits for: the step starting an epoch; per MoE layer the receive counts (P's own device progress)
and then the turnstile permit.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from ...errors import AInferPDError, EpochFailedError
from ...sched.epoch_mode import EpochFinal, EpochMode
from ...sched.planner import plan_prefill
from ...sched.span import SlowdownMeter
from ...sched.step import Exclusive
from .p_walk import EpochWalk, p_segments
from ..runtime.runner import BatchPlan
from .timings import EngineTimings

log = logging.getLogger("ainfer_pd.engine")


class PDriver:
    """P epochs of one rank. ``running`` / ``exclusive``: the epoch started last still runs (and
    D waits for it). ``all_reduce``: P's attention all-reduce under attention TP (None: this rank
    holds every head); ``share``: a replica's batch exchange with its TP followers (None without);
    ``isolate_failures``: one rank, so no peer waits on a failed epoch: its turns fail, the rest go on."""

    def __init__(self, *, sched, mux, timeout_s: float, rec, book, runner, ctx, turnstile, timings: EngineTimings, faults,
                 notify: Callable[[], None], drain: Callable[[Any], Any], all_reduce=None, share=None,
                 is_leader: bool = True, isolate_failures: bool = True, cpu: bool = False) -> None:
        self.sched, self.mux, self.timeout_s = sched, mux, timeout_s     # config sections: scheduler, mux
        self.rec, self.book, self.runner, self.ctx = rec, book, runner, ctx
        self.turnstile, self.timings, self.faults = turnstile, timings, faults
        self.notify, self.drain = notify, drain
        self.all_reduce, self.share, self.is_leader = all_reduce, share, is_leader
        self.isolate_failures = isolate_failures
        self.cpu = cpu
        self.segments = p_segments(runner.model.segments)   # built once: every epoch walks them
        self.slowdown = SlowdownMeter()     # P's gated over exclusive time per token (mux.activation_cost)
        self.epoch = 0
        self.running = False
        self.exclusive = False
        self.why: Exclusive | None = None   # why the epoch started last runs exclusively
        self._go: asyncio.Queue = asyncio.Queue()

    # ------------------------------------------------------------------ the step's side
    def admissible_tokens(self) -> int:
        """Prefill tokens this rank would admit now (0 while its epoch runs, or on a TP follower)."""
        if self.running or not self.is_leader:
            return 0
        book = self.book
        chunks, _ = plan_prefill(book.pending_view(), self.sched.max_prefill_tokens, book.available_blocks())
        return sum(c.num_tokens for c in chunks)

    def begin(self, mode: EpochMode, why: Exclusive | None, *, d_enqueued: bool) -> tuple:
        """The next epoch, decided: counted as running from now (the item the P task runs)."""
        self.epoch += 1
        self.exclusive = mode.exclusive
        self.why = why
        self.running = True
        return self.epoch, mode, asyncio.Event(), d_enqueued

    async def start(self, mode: EpochMode, why: Exclusive | None, *, d_enqueued: bool) -> None:
        """Start the next epoch on the P task; returns once it is registered with the turnstile
        (so the step's D round sees it)."""
        item = self.begin(mode, why, d_enqueued=d_enqueued)
        await self._go.put(item)
        await item[2].wait()

    decide: Callable[[], tuple | None] | None = None
    """One rank: the step's P decision, taken by the P task itself (:meth:`begin`'s item of the next
    epoch, or None). The coordinator is local, so P need not wait for the step loop to come round
    after the D iteration it is in; several ranks agree every epoch at a step (:meth:`start`)."""
    changed: Callable[[], asyncio.Event] | None = None
    """One rank: the engine's current change event (set by the next change)."""

    # ------------------------------------------------------------------ the P task
    async def run(self) -> None:
        while True:
            if self.decide is not None:
                seen = self.changed()
                item = self.decide()
                if item is None:
                    await seen.wait()
                    continue
            else:
                item = await self._go.get()
            epoch, mode, entered, d_enqueued = item
            admitted = True
            try:
                work, plan = await self._batch()
                # NOTE: an empty batch is unreachable while the plan and the admission share `fits`
                # (one rank: no peer joins this epoch); should it happen, P decides again after a change.
                admitted = bool(work) or not self.isolate_failures
                if admitted:
                    await self._run_isolated(epoch, work, plan, mode, d_enqueued, entered)
            finally:
                entered.set()
                if self.running and self.epoch == epoch:
                    self.running = self.exclusive = False
                    self.notify()
            if not admitted and self.changed is not None:
                await self.changed().wait()      # after the notify above: the next change

    async def _batch(self) -> tuple[list, BatchPlan]:
        """This epoch's batch: planned and admitted here (a replica leader shares it with its TP
        followers), or a follower's copy of its leader's."""
        if not self.is_leader:
            return [], await self.share(None)
        sc = self.sched
        chunks, admitted = plan_prefill(self.book.pending_view(), sc.max_prefill_tokens, self.book.available_blocks())
        work = self.book.admit(chunks, admitted, sc.max_prefill_tokens)
        plan = self.runner.build(work, [])
        if self.share is not None:
            await self.share(plan)
        return work, plan

    async def _run_isolated(self, epoch, work, plan, mode, d_enqueued, entered) -> None:
        if not self.isolate_failures:
            await self.run_epoch(epoch, work, mode, d_enqueued=d_enqueued, entered=entered, plan=plan)
            return
        try:
            await self.run_epoch(epoch, work, mode, d_enqueued=d_enqueued, entered=entered, plan=plan)
        except Exception as exc:
            # NOTE: one rank, so no peer waits on this epoch: fail its turns (typed), free their
            # KV once the P stream drained, keep serving everyone else.
            err = exc if isinstance(exc, AInferPDError) else EpochFailedError(f"P epoch {epoch} failed: {exc!r}")
            await self.drain(self.ctx.stream)
            self.book.fail_turns([t for t, _, _ in work], err)
            log.warning("P epoch %d failed, %d turns failed: %s", epoch, len(work), err)

    def paced_per_layer(self) -> bool:
        """``mux.p_host_pacing`` resolved. NOTE: receive counts exist only with expert parallelism;
        without them a wait after every attention segment is a device bubble per layer (P's host
        wakes, then launches the experts), so on CUDA P's host enqueues ahead and takes its device
        time once, at the epoch's end. An injected counts delay needs the wait."""
        mode = self.mux.p_host_pacing
        if mode == "auto":
            mode = "layer" if self.runner.ep is not None or self.cpu else "epoch"
        return mode == "layer" or bool(self.faults.slow_counts_ms)

    async def run_epoch(self, epoch: int, work: list, mode: EpochMode, *, d_enqueued: bool,
                        entered: asyncio.Event | None = None, plan: BatchPlan | None = None) -> None:
        """One P epoch: the walk inside the turnstile's epoch, its timings, then its tokens."""
        plan = plan if plan is not None else self.runner.build(work, [])
        counts = self.paced_per_layer()
        self.running, self.exclusive = True, mode.exclusive
        self.rec.event("p_epoch", epoch=epoch, tokens=plan.num_tokens, gated=mode.gated, policy=self.sched.policy,
                       why=None if mode.gated else (self.why.value if self.why else None))
        t_start = self.rec.now()
        hold = self.book.in_flight(t for t, _, _ in work)
        try:
            sampled = await self._walk(epoch, plan, mode, counts, d_enqueued, entered, t_start)
        finally:
            hold.release()                    # before the cleanups: the epoch's aborted turns drained
            self.running = self.exclusive = False
            self.book.drain_cleanups()
            self.notify()
        self.rec.event("p_epoch_done", epoch=epoch)
        self.rec.sample("p_epoch_s", self.rec.now() - t_start)
        self.slowdown.observe(mode.gated, self.rec.now() - t_start, plan.num_tokens)
        self.rec.sample("p_epoch_tokens", plan.num_tokens)
        self.book.finish_prefill(plan, sampled=sampled)

    async def _walk(self, epoch, plan, mode: EpochMode, counts: bool, d_enqueued, entered, t_start):
        """The walk inside the turnstile's epoch; the final boundary as ``mode.final`` says."""
        mux, boundaries = mode.gated, 2 * self.runner.num_layers
        async with self.turnstile.epoch(epoch, gated=mux, d_enqueued=d_enqueued) as ep:
            if entered is not None:
                entered.set()
            walk = EpochWalk(epoch, plan, ep, runner=self.runner, ctx=self.ctx, rec=self.rec, faults=self.faults,
                             timeout_s=self.timeout_s, all_reduce=self.all_reduce,
                             sample_rows=[self.book.sample_row(t) for t in plan.logit_turns])
            await walk.enqueue(self.segments, mode, counts)
            waited = walk.waited
            self.rec.sample("p_enqueue_s", self.rec.now() - t_start - waited)
            if plan.num_tokens and counts:
                self.timings.p_boundary(self.rec.now() - t_start - (waited - walk.counts_waited), boundaries)
            if mode.final is EpochFinal.ENQUEUE:
                ep.publish(1, final=True)
            done = mode.final is EpochFinal.COMPLETE or not mux
            if done:
                sampled = await walk.done()
                if mux:
                    ep.publish(1, final=True)
        if not done:
            sampled = await walk.done()
        if plan.num_tokens and not counts:
            # P time per boundary without the permit waits: host enqueue and device run overlap,
            # so this is the device-paced time (with D's work interleaved when multiplexed)
            self.timings.p_boundary(self.rec.now() - t_start - waited, boundaries)
        return sampled
