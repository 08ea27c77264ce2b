"""The engine of one rank: the background P task and the foreground D loop.

Policies (SPEC section 4), all in this one engine:

* ``normal``          D is not enqueued while any admissible P is pending (strict P priority).
* ``global-complete`` turnstile with one boundary per P epoch, published after the epoch *completed*.
* ``global-enqueue``  turnstile with one boundary per P epoch, published once it is fully *enqueued*.
* ``fine-grained``    turnstile at every safe boundary (layer ends and expert notification points).
* ``mixed-chunked``   one loop; every step is one batch of decode rows plus a prefill chunk
                      (:class:`~ainfer_pd.engine.mixed.MixedChunkedEngine`).

The loops decide when device work runs; the turns they serve, their admission, tokens and
endings are the engine's :class:`~.turns.TurnBook` (``engine.book``, synchronous), and a P
epoch's walk over the model's segments is :class:`~.p_walk.EpochWalk`.
All state is touched only from the event loop thread; streams only compute.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import torch

from ..config import WorkerConfig
from ..errors import AInferPDError, EpochFailedError
from ..faults import Faults, FaultyRendezvous
from ..metrics.recorder import Recorder
from ..metrics.stats import percentile, work_s
from ..phase import Phase, PhaseContext
from ..sched.epoch_mode import EpochMode, epoch_mode, policy_traits
from ..sched.planner import plan_decode, plan_prefill
from ..sched.span import (Activation, SlowdownMeter, SpanInputs, drains_exclusively, guards_first_token,
                          make_span_policy, multiplexing_pays)
from ..turnstile.rendezvous import LocalRendezvous
from ..turnstile.turnstile import Turnstile
from .d_overlap import InFlightD, decode_sampled, feed_of, needs_host_history, rows_after
from .device import Device, make_device
from .kv_cache import KVCacheManager
from .p_walk import GATED_LANE, EpochWalk, p_segments
from .residency import Residency, kv_blocks_from_memory
from .runner import BatchPlan, ModelRunner
from .state import Turn
from .turns import TurnBook

log = logging.getLogger("ainfer_pd.engine")

D_ITEM = {"phase": "D", "kind": "iter"}


class Engine:
    runs_overlap_decode = True
    """Whether this engine's D loop runs overlapped under ``scheduler.overlap_decode`` (``auto``
    turns it on where this is true; the lockstep and mixed-chunked engines run their plain loop)."""

    def __init__(self, cfg: WorkerConfig, recorder: Recorder, *, rendezvous=None, rank: int = 0,
                 tp_shard: tuple[int, int] | None = None, setup: Callable[["Engine"], None] | None = None) -> None:
        """``tp_shard`` = (tp_rank, ATP): this rank keeps that shard of the attention heads;
        ``setup(engine)`` runs after the runner exists and before decode graphs are captured
        (a multi-rank engine installs its phase hooks there: the graphs bind them)."""
        self.cfg = cfg
        self.rec = recorder
        self.rank = rank
        self.overlap_decode = self.runs_overlap_decode and cfg.scheduler.overlap_decode in (True, "auto")
        self.faults = Faults.load(cfg.faults)
        if self.faults.active and rendezvous is not None:
            rendezvous = FaultyRendezvous(rendezvous, self.faults)
        self.rendezvous = rendezvous
        self.policy = cfg.scheduler.policy
        dc = cfg.device
        self.device: Device = make_device(dc.device, recorder, residency_slots=dc.residency_slots,
                                          collective_slots=dc.collective_slots,
                                          threads_per_stream=dc.cpu_threads_per_stream,
                                          high_priority_stream=dc.high_priority_stream,
                                          lane_sms={("P", GATED_LANE): dc.p_stream_sms})
        if self.device.kind == "cpu":
            torch.set_num_threads(dc.cpu_threads_per_stream)
        num_blocks = cfg.cache.num_blocks or kv_blocks_from_memory(cfg)
        self.kv = KVCacheManager(num_blocks, cfg.cache.block_size, sharing=cfg.cache.prefix_sharing,
                                 wait_min_tokens=cfg.cache.prefix_wait_min_tokens)
        self.runner = ModelRunner(cfg, self.device.torch_device, self.kv, tp_shard=tp_shard)
        self.residency = Residency(self.runner)
        self.prefill_ctx = PhaseContext(Phase.PREFILL, self.device.stream("P"))
        self.decode_ctx = PhaseContext(Phase.DECODE, self.device.stream("D"))
        if setup is not None:
            setup(self)
        self.traits = policy_traits(self.policy)
        span_policy = make_span_policy(cfg.mux) if self.traits.per_layer else (lambda _inp: 1)
        self.turnstile = Turnstile(rendezvous=rendezvous or LocalRendezvous(), span=span_policy,
                                   recorder=recorder, rank=rank,
                                   timeout_s=cfg.parallel.rendezvous_timeout_s, load=self._span_inputs)
        self._d_iter_ema = 0.0          # seconds, launch -> completion
        self._p_boundary_ema = 0.0      # seconds of P per safe boundary
        self.activation = Activation(threshold=cfg.mux.activation_threshold,
                                     cooldown_s=cfg.mux.activation_cooldown_s)
        self.slowdown = SlowdownMeter()     # P's gated over exclusive time per token (mux.activation_cost)
        if self.device.kind == "cuda" and dc.cuda_graphs:
            # captured on the D stream's own thread so the graphs bind D-owned state
            self.decode_ctx.stream.submit(self.runner.capture_decode_graphs, self.decode_ctx,
                                          label="D.capture").enqueued().result()
        if self.device.kind == "cuda" and dc.warmup_prefill:
            self.prefill_ctx.stream.submit(self.runner.warmup_prefill, self.prefill_ctx,
                                           cfg.scheduler.max_prefill_tokens, label="P.warmup").enqueued().result()
            torch.cuda.synchronize()
        self._changed = asyncio.Event()    # replaced on every notify: waiters re-check their predicate
        self.book = TurnBook(cfg, recorder, self.kv, routed=self.runner.routed, notify=self._notify)
        self._p_segments = p_segments(self.runner.model.segments)   # built once: every P epoch walks them
        self._epoch = 0
        self._p_running = False          # a P epoch is being run
        self._p_exclusive = False        # D must not enter (normal policy / activation off)
        self._d_in_flight = False

    # ================================================================== turns (the book's)
    @property
    def waiting(self):
        """Turns queued for prefill (:attr:`TurnBook.waiting`)."""
        return self.book.waiting

    @property
    def decoding(self) -> list[Turn]:
        return self.book.decoding

    @property
    def history(self):
        return self.book.history

    def check_accepts(self) -> None:
        """Raise unless this rank takes requests (a multi-rank TP follower does not)."""

    def submit(self, turn: Turn) -> None:
        self.book.submit(turn)

    def abort(self, turn: Turn, reason: str = "abort", *, commit: bool = True) -> None:
        """Abort ``turn`` (:meth:`TurnBook.abort`: partial output, KV cleaned up once drained)."""
        self.book.abort(turn, reason, commit=commit)

    def record_trajectory(self, group: str, turns: int, tokens: int) -> None:
        self.book.record_trajectory(group, turns, tokens)

    def _notify(self) -> None:
        """Something the loops wait on changed: wake every waiter (no task is created)."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def _changed_or(self, timeout_s: float) -> None:
        """Wait until something is notified or ``timeout_s`` passes (a bounded, non-spinning poll)."""
        ev = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await ev.wait()
        except TimeoutError:
            pass

    async def _wait_for(self, pred: Callable[[], bool]) -> None:
        while not pred():
            await self._changed.wait()

    # ================================================================== loops
    async def run(self) -> None:
        """Owns the loops for the worker's TaskGroup."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._prefill_loop(), name="prefill")
            tg.create_task(self._decode_loop(), name="decode")

    # ------------------------------------------------------------------ P
    async def _prefill_loop(self) -> None:
        """Background P task. Consumes waiting turns in P epochs (token budget, D-first KV).
        Waits for: admissible work; per MoE layer the receive counts (P's own device
        progress) and then the turnstile permit. Unblocked by: submissions, KV freed by
        finished/aborted turns, D rounds granting permits."""
        book = self.book
        while True:
            await self._wait_for(book.p_admissible)
            chunks, admitted = plan_prefill(book.pending_view(), self.cfg.scheduler.max_prefill_tokens,
                                            book.available_blocks())
            work = book.admit(chunks, admitted, self.cfg.scheduler.max_prefill_tokens)
            if not work:
                # NOTE: unreachable while the plan and the admission share `fits`; should it happen,
                # wait for the next change (a turn ending frees KV) instead of polling.
                await self._changed.wait()
                continue
            self._epoch += 1
            has_d = bool(book.decoding)
            # NOTE: without the turnstile and with decode rows present, D waits for this epoch (strict P priority).
            self._exclusive_why = "no-d" if not has_d else (None if self.traits.turnstile else "policy")
            mode = epoch_mode(self.policy, has_d, has_d and self.traits.turnstile and self._mux_active(work))
            try:
                await self._run_epoch(self._epoch, work, mode, d_enqueued=self._d_in_flight)
            except Exception as exc:
                # NOTE: one rank, so no peer waits on this epoch: fail its turns (typed), free their
                # KV once the P stream drained, keep serving everyone else.
                err = exc if isinstance(exc, AInferPDError) else EpochFailedError(
                    f"P epoch {self._epoch} failed: {exc!r}")
                await self._drain_stream(self.prefill_ctx.stream)
                book.fail_turns([t for t, _, _ in work], err)
                log.warning("P epoch %d failed, %d turns failed: %s", self._epoch, len(work), err)

    def _p_paced_per_layer(self) -> bool:
        """``mux.p_host_pacing`` resolved (see there). NOTE: receive counts exist only with expert
        parallelism; without them a wait after every attention segment is a device bubble per layer
        (P's host wakes, then launches the experts), so on CUDA P's host enqueues ahead and takes
        its device time once, at the epoch's end. An injected counts delay needs the wait."""
        mode = self.cfg.mux.p_host_pacing
        if mode == "auto":
            mode = "layer" if self.runner.ep is not None or self.device.kind == "cpu" else "epoch"
        return mode == "layer" or bool(self.faults.slow_counts_ms)

    def _span_inputs(self) -> SpanInputs:
        """What the span policy sees (rank 0's answer is used on every rank)."""
        book = self.book
        return SpanInputs(num_d_rows=len(book.decoding), max_d_rows=self.cfg.scheduler.max_decode_batch,
                          num_p_waiting_tokens=sum(t.remaining_prompt for t in book.waiting),
                          p_budget_tokens=self.cfg.scheduler.max_prefill_tokens,
                          d_iter_s=self._d_iter_ema, p_boundary_s=self._p_boundary_ema)

    @staticmethod
    def _ema(old: float, new: float, a: float = 0.3) -> float:
        return new if old == 0.0 else (1 - a) * old + a * new

    def _mux_active(self, work) -> bool:
        backlog = sum(t.remaining_prompt for t in self.book.waiting)
        tokens = sum(n for _, _, n in work) + backlog
        rows = len(self.book.decoding)
        now = self.rec.now()
        on = self.activation.update(now, tokens, rows)
        if not on:
            self._exclusive_why = "inactive"
        # the epoch's turns are still in `waiting` (they leave it when their first token comes)
        return on and self._mux_pays(rows, len(self.book.waiting), self.slowdown.value, backlog,
                                     self._oldest_wait_s(now))

    def _oldest_wait_s(self, now: float) -> float:
        """How long the longest-waiting turn (its first token not out) has waited; 0 with none."""
        return max((now - t.t_submit for t in self.book.waiting), default=0.0)

    def _mux_pays(self, rows: int, turns: int, slowdown: float, backlog_tokens: int, oldest_wait_s: float) -> bool:
        """``mux.exclusive_backlog_tokens``: a backlog (the waiting turns' prompt tokens still to
        prefill, this epoch's included) above it runs exclusively (:func:`drains_exclusively`);
        ``mux.exclusive_wait_s``: so does an epoch while a waiting turn has waited longer
        (:func:`guards_first_token`); then ``mux.activation_cost``: none -> True; measured ->
        :func:`multiplexing_pays`. Every rank passes the same agreed inputs; an epoch declined
        runs exclusively."""
        if drains_exclusively(backlog_tokens, self.cfg.mux.exclusive_backlog_tokens):
            self.rec.count("backlog_exclusive")
            self._exclusive_why = "backlog"
            return False
        if guards_first_token(oldest_wait_s, self.cfg.mux.exclusive_wait_s):
            self.rec.count("wait_exclusive")
            self._exclusive_why = "wait"
            return False
        if self.cfg.mux.activation_cost == "none":
            return True
        pays = multiplexing_pays(rows, turns, slowdown)
        if not pays:
            self.rec.count("activation_declined")
            self._exclusive_why = "cost"
        return pays

    async def _run_epoch(self, epoch: int, work: list[tuple[Turn, int, int]], mode: EpochMode, *,
                         d_enqueued: bool, entered: asyncio.Event | None = None, plan: BatchPlan | None = None) -> None:
        """One P epoch: the model's segments on the P stream (:class:`~.p_walk.EpochWalk`), stopping
        at safe boundaries for the turnstile (``mode.gated``); then the epoch's tokens. ``entered`` is
        set once the epoch is registered with the turnstile. ``plan``: the batch when it was not built
        here from ``work`` (a TP follower runs its leader's)."""
        plan = plan if plan is not None else self.runner.build(work, [])
        for t, _, _ in work:
            t.in_flight += 1
        L = self.runner.num_layers
        mux = mode.gated
        counts = self._p_paced_per_layer()
        t_permits = 0.0
        self._p_exclusive = mode.exclusive
        self._p_running = True
        self.rec.event("p_epoch", epoch=epoch, tokens=plan.num_tokens, gated=mux, policy=self.policy,
                       why=None if mux else self._exclusive_why)
        t_start = self.rec.now()
        try:
            async with self.turnstile.epoch(epoch, gated=mux, d_enqueued=d_enqueued) as ep:
                if entered is not None:
                    entered.set()
                walk = EpochWalk(epoch, plan, ep, runner=self.runner, ctx=self.prefill_ctx, rec=self.rec,
                                 faults=self.faults, timeout_s=self.cfg.parallel.rendezvous_timeout_s,
                                 all_reduce=self._p_all_reduce if self._p_tensor_parallel else None)
                await walk.enqueue(self._p_segments, mode, counts)
                waited = walk.waited
                self.rec.sample("p_enqueue_s", self.rec.now() - t_start - waited)
                if plan.num_tokens and counts:
                    p_time = self.rec.now() - t_start - (waited - walk.counts_waited)
                    self._p_boundary_ema = self._ema(self._p_boundary_ema, p_time / (2 * L))
                elif plan.num_tokens:
                    t_permits = waited
                if mode.final == "enqueue":
                    ep.publish(1, final=True)
                if mode.final == "complete" or not mux:
                    logits = await walk.done()
                    if mux:
                        ep.publish(1, final=True)
            if mux and mode.final != "complete":
                logits = await walk.done()
            if plan.num_tokens and not counts:
                # P time per boundary without the permit waits: host enqueue and device run overlap,
                # so this is the device-paced time (with D's work interleaved when multiplexed)
                p_time = self.rec.now() - t_start - t_permits
                self._p_boundary_ema = self._ema(self._p_boundary_ema, p_time / (2 * L))
        finally:
            for t, _, _ in work:
                t.in_flight -= 1
            self._p_running = False
            self._p_exclusive = False
            self.book.drain_cleanups()
            self._notify()
        self.rec.event("p_epoch_done", epoch=epoch)
        self.rec.sample("p_epoch_s", self.rec.now() - t_start)
        self.slowdown.observe(mux, self.rec.now() - t_start, plan.num_tokens)
        self.rec.sample("p_epoch_tokens", plan.num_tokens)
        self.book.finish_prefill(plan, logits)

    _exclusive_why: str | None = None
    """Why the epoch being planned runs exclusively (the trace's ``p_epoch`` event): no-d (no decode
    rows), policy (no turnstile), inactive (activation off), backlog, wait, cost (``_mux_pays``)."""

    _p_tensor_parallel = False
    """This rank holds a shard of the attention heads: P all-reduces every layer's output."""

    def _p_all_reduce(self, tensor, *, after, epoch: int, boundary: int, gated: bool):  # pragma: no cover
        raise NotImplementedError("attention TP runs in the lockstep engine")

    # ------------------------------------------------------------------ D
    def _d_may_run(self) -> bool:
        if not self.book.has_live_rows():
            return False
        if self.traits.p_priority:
            return not (self._p_running or self.book.p_admissible())
        return not self._p_exclusive

    async def _await_decode_rows(self) -> None:
        """Wait for live decode rows. While D has none, it owes a gated P epoch no round: the
        turnstile opens that epoch's gate (issue 13, case 2: the last row finished, was aborted,
        cancelled, released or slept away mid-epoch; before, P waited for a permit no D round
        would grant). New rows appear only when an epoch ends, so the gate stays open to its end."""
        while not self.book.has_live_rows():
            if self.turnstile.gated_epoch_active:
                self.turnstile.open_gate()
            await self._changed.wait()

    async def _decode_loop(self) -> None:
        """Foreground D loop. Consumes decoding turns, one iteration at a time.
        Waits for: decode rows; under ``normal`` no pending P; under the turnstile
        policies P's next boundary (rendezvous 1) and the enqueue ACK (rendezvous 2).
        Unblocked by: promotions, P epochs ending, boundaries published, aborts.
        ``scheduler.overlap_decode``: :meth:`_overlapped_decode_loop` instead."""
        if self.overlap_decode:
            await self._overlapped_decode_loop()
            return
        while True:
            await self._await_decode_rows()
            opened = await self._open_d_round()
            if opened is None:
                continue
            t_ready, rnd, rows = opened
            if not rows:
                if rnd is not None:
                    await self.turnstile.after_decode(rnd)
                continue
            await self._decode_once(rows, rnd, t_ready)
            self._notify()

    async def _open_d_round(self):
        """Once D may run: (ready time, the turnstile round (None when no gated epoch is
        active), the rows of the next iteration); None when no live row is left meanwhile."""
        t_ready = self.rec.now()
        await self._wait_for(lambda: self._d_may_run() or not self.book.has_live_rows())
        if not self.book.has_live_rows():
            return None
        rnd = await self.turnstile.before_decode()
        return t_ready, rnd, self._d_rows()

    def _d_rows(self) -> list[Turn]:
        """The rows of the next D iteration (by priority when more are ready than fit)."""
        book = self.book
        ready = book.decoding
        if len(ready) > self.cfg.scheduler.max_decode_batch:
            ready = book.by_priority(list(ready), waiting=False)
        return [t for t in plan_decode(ready, self.cfg.scheduler.max_decode_batch) if not t.abort_requested]

    async def _decode_once(self, rows: list[Turn], rnd, t_ready: float) -> None:
        """Enqueue one D iteration of ``rows`` (empty on a lockstep rank without rows), inside
        the turnstile round ``rnd`` when one is open; await completion; emit the tokens."""
        t_build = self.rec.now()
        plan = await self._decode_plan(rows)
        self.rec.sample("d_build_s", self.rec.now() - t_build)
        w, t_launch = await self._d_launch(rows, rnd, t_ready, self.runner.decode, plan, self.decode_ctx)
        try:
            logits = await w.done()
        finally:
            self._d_in_flight = False
            for t in rows:
                t.in_flight -= 1
        self._book_d(w, t_launch, plan, logits=logits)

    async def _d_launch(self, rows: list[Turn], rnd, t_ready: float, fn, *args):
        """Submit the D iteration ``fn(*args)`` of ``rows`` on the D stream inside the round ``rnd``
        (when one is open: its enqueue ACK follows the launch). Returns (the item, launch time);
        ``rows`` count it in flight until the caller read it."""
        if self.faults.active:
            skew = self.faults.d_skew_s()
            if skew:
                await asyncio.sleep(skew)
        for t in rows:
            t.in_flight += 1
        try:
            self._before_d_launch(rnd)
            w = self.decode_ctx.stream.submit(fn, *args, label="D.iter",
                                              attrs={**D_ITEM, "epoch": rnd.epoch if rnd else None},
                                              delay_s=self._d_device_delay_s)
            self._d_in_flight = True
            self._d_last = w
            if rows:
                self.rec.sample("d_wait_s", self.rec.now() - t_ready)
            self.rec.event("d_launch", rows=len(rows), round=rnd is not None, epoch=self._epoch)
            t_launch = self.rec.now()
            if rnd is not None:
                await self.turnstile.after_decode(rnd)
                p_running = self.prefill_ctx.stream.num_pending
                if p_running:
                    # the enqueue ACK came while P work was still running: not a completion fence
                    self.rec.count("delayed_ack_rounds")
                self.rec.event("ack", epoch=rnd.epoch, boundary=rnd.boundary, p_running=p_running)
        except BaseException:
            self._d_in_flight = False
            for t in rows:
                t.in_flight -= 1
            raise
        return w, t_launch

    def _book_d(self, w, t_launch: float, plan: BatchPlan, **out) -> None:
        """A D iteration read: its timing samples, its tokens booked (``out``: the logits, or the
        tokens sampled on the device), the cleanups it unblocked, and the host time that took."""
        t_done = self.rec.now()
        self._d_timed(w, t_launch, t_done)
        self.book.finish_decode(plan, **out)
        self.book.drain_cleanups()
        self.rec.sample("d_post_s", self.rec.now() - t_done)

    _d_last = None
    """The D stream item launched last (the overlapped loop: D is in flight until it is read)."""

    def _d_timed(self, w, t_launch: float, t_done: float) -> None:
        """The timing samples of a D iteration read at ``t_done``. Overlapped, launch -> done
        includes the wait behind the iteration before it, so the D period the span policy and the
        bound's chain use is the device interval instead."""
        dur = t_done - t_launch
        self.rec.sample("d_iter_s", dur)
        period = dur
        if self.overlap_decode and w.interval is not None:
            period = w.interval[1] - w.interval[0]
        self._d_iter_ema = self._ema(self._d_iter_ema, period)
        self._split_d_iter(w, t_launch, t_done)
        if not self._p_running:
            self.rec.sample("d_iter_alone_s", period)       # no P epoch beside it

    # ------------------------------------------------------------------ D, overlapped
    async def _overlapped_decode_loop(self) -> None:
        """The D loop with ``scheduler.overlap_decode`` (see :mod:`.d_overlap`): iteration n+1 is
        launched before n is read, its rows that were in n fed on the device from n's tokens; n is
        read and booked while n+1 runs. Every wait that is not for the next iteration (no rows, D
        may not run, a row needs its history on the host) reads the iteration in flight first."""
        book = self.book
        max_ctx = self.cfg.model.max_context_len
        prev: InFlightD | None = None
        try:
            while True:
                if prev is None:
                    await self._await_decode_rows()
                elif not (book.has_live_rows() and self._d_may_run()):
                    await self._read_d(prev)
                    prev = None
                    continue
                opened = await self._open_d_round()
                if opened is None:
                    continue
                t_ready, rnd, rows = opened
                if prev is not None and needs_host_history(rows):
                    await self._read_d(prev)
                    prev = None
                    rows = self._d_rows()
                rows, ahead = rows_after(rows, prev, max_ctx)
                if not rows:
                    if rnd is not None:
                        await self.turnstile.after_decode(rnd)
                    if prev is not None:
                        await self._read_d(prev)
                        prev = None
                    continue
                t_build = self.rec.now()
                plan = self.runner.build([], rows, ahead)
                sample_rows = [book.sample_row(t, a) for t, a in zip(rows, ahead)]
                feed = feed_of(rows, ahead, prev, self.runner.device)
                self.rec.sample("d_build_s", self.rec.now() - t_build)
                self.rec.count("d_rows_fed", sum(ahead))
                w, t_launch = await self._d_launch(rows, rnd, t_ready, decode_sampled, self.runner, plan,
                                                   self.decode_ctx, sample_rows, feed,
                                                   prev.work if prev is not None else None)
                launched = InFlightD(plan, w, rows, t_launch, {id(t): i for i, t in enumerate(rows)})
                if prev is not None:
                    await self._read_d(prev)
                prev = launched
                self._notify()
        finally:
            if prev is not None:             # stopped with an iteration unread: nothing books it
                for t in prev.rows:
                    t.in_flight -= 1
                self._d_in_flight = False
                book.drain_cleanups()

    async def _read_d(self, it: InFlightD) -> None:
        """Wait for the overlapped iteration ``it``, then book its tokens."""
        try:
            ds = await it.work.done()
        finally:
            if self._d_last is it.work:
                self._d_in_flight = False
            for t in it.rows:
                t.in_flight -= 1
        self._book_d(it.work, it.t_launch, it.plan, sampled=ds)
        self._notify()

    def _split_d_iter(self, w, t_launch: float, t_done: float) -> None:
        """Where launch -> done went, in four parts that add up to it: ``d_pickup_s`` (submitted ->
        the launcher began), ``d_to_start_s`` (-> the device began; CUDA: the start event's time
        on the host clock, so it can read slightly negative), ``d_device_s`` (the device interval)
        and ``d_resume_s`` (device end -> this coroutine resumed: the waiter's wake-up and the
        event loop's lag). Also ``d_launch_call_s``, the host launch call itself."""
        if w.interval is None or w.t_started is None:
            return
        a, b = w.interval
        rec = self.rec
        rec.sample("d_pickup_s", w.t_started - t_launch)
        rec.sample("d_to_start_s", a - w.t_started)
        rec.sample("d_device_s", b - a)
        rec.sample("d_resume_s", t_done - b)
        rec.sample("d_launch_call_s", w.t_launched - w.t_started)

    async def _decode_plan(self, rows: list[Turn]) -> BatchPlan:
        """The D batch of ``rows`` (a lockstep rank pads it and shares it with its TP followers)."""
        return self.runner.build([], rows)

    def _before_d_launch(self, rnd) -> None:
        """Host side of the D launch, right before it is enqueued (lockstep: D's collectives)."""

    _d_device_delay_s = 0.0
    """Fault injection: the D iteration starts this much later on the device (replicas out of phase)."""

    # ================================================================== ending
    async def _drain_stream(self, stream) -> None:
        """Wait until every item submitted to ``stream`` so far has run (FIFO barrier)."""
        await asyncio.wrap_future(stream.submit(lambda: None, label="barrier").enqueued())

    async def aclose(self) -> None:
        """After the loops stopped: release what the engine owns beyond its threads (the
        lockstep engine's control rendezvous); nothing at world size 1."""

    def close(self) -> None:
        """After the loops stopped and the streams were joined (no device work in flight):
        :meth:`TurnBook.close` (every turn still known ends with "abort")."""
        self.book.close()

    def fail_all(self, exc: BaseException) -> None:
        """The engine stopped: every turn in flight ends with ``exc`` (typed)."""
        self.book.fail_all(exc)

    def metrics(self) -> dict[str, Any]:
        m = self.rec.summary()
        p_work, d_work = work_s(self.rec.intervals, "P"), work_s(self.rec.intervals, "D")   # set-up left out
        m.update({"policy": self.policy, "p_work_s_sum": p_work, "d_work_s_sum": d_work, "num_epochs": self._epoch})
        m.update(self.book.metrics())
        m.update({
            "activation_switches": self.activation.switches,
            "p_gated_slowdown": self.slowdown.value,
            "d_wait_s_samples": list(self.rec.samples.get("d_wait_s", [])),
            "ttft_s_samples": list(self.rec.samples.get("ttft_s", [])),
        })
        alone = self.rec.samples.get("d_iter_alone_s")
        if alone:      # the optimistic bound's chain (metrics.report.chain_lower_bound): a fast D iteration alone
            m["d_iter_alone_s"] = percentile(alone, 10)
        return m

    def shutdown(self) -> None:
        """Join the stream threads; on CUDA give the device memory back (a closed worker
        keeps no weights, KV cache or graphs alive, so the next one fits)."""
        self.device.shutdown()
        if self.device.kind == "cuda":
            self.runner.release_cuda()

