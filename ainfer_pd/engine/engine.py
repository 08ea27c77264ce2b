"""The engine of one rank: queues, the background P task and the foreground D loop.

Policies (SPEC section 4), all in this one engine:

* ``normal``          D is not enqueued while any admissible P is pending (strict P priority).
* ``global-complete`` turnstile with one boundary per P epoch, published after the epoch *completed*.
* ``global-enqueue``  turnstile with one boundary per P epoch, published once it is fully *enqueued*.
* ``fine-grained``    turnstile at every safe boundary (layer ends and expert notification points).
* ``mixed-chunked``   one loop; every step is one batch of decode rows plus a prefill chunk
                      (:class:`~ainfer_pd.engine.mixed.MixedChunkedEngine`).

All state is touched only from the event loop thread; streams only compute.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable

import torch

from ..config import WorkerConfig
from ..errors import AInferPDError, EpochFailedError, SamplingError
from ..faults import Faults, FaultyRendezvous
from ..metrics.export import set_log_context
from ..metrics.recorder import Recorder
from ..phase import Phase, PhaseContext
from ..request import TurnOutput
from ..sched.planner import PendingPrefill, fits, plan_decode, plan_prefill
from ..sched.priority import History, PriorityConfig, Work, order
from ..sched.span import Activation, SpanInputs, make_span_policy
from ..turnstile.rendezvous import LocalRendezvous
from ..turnstile.turnstile import Turnstile
from .device import Device, make_device
from . import prefix
from .kv_cache import KVCacheManager
from .routed_experts import of_turn
from .residency import Residency, kv_blocks_for_budget
from .runner import BatchPlan, ModelRunner
from .sampler import SampleRow, sample
from .state import Turn, TurnState

log = logging.getLogger("ainfer_pd.engine")

from ..sched.epoch_mode import TURNSTILE_POLICIES, EpochMode, epoch_mode, policy_traits  # noqa: E402,F401


class _Box:
    """Carries segment state between items of one FIFO stream."""

    __slots__ = ("st", "notified", "o")

    def __init__(self) -> None:
        self.st: Any = None
        self.notified: Any = None
        self.o: Any = None


P_ITEM = {"phase": "P", "kind": "compute"}
D_ITEM = {"phase": "D", "kind": "iter"}


async def _segments_done(segs: list, last) -> Any:
    """``last``'s result once it completed, raising the first failure of the P segments before it
    (the stream runs on after a failed item, so a failure is only seen by looking)."""
    try:
        result = await last.done()
    except BaseException:
        _raise_first_failure(segs)
        raise
    _raise_first_failure(segs)
    return result


def _raise_first_failure(segs: list) -> None:
    for w in segs:
        f = w.enqueued()
        if f.done() and not f.cancelled() and f.exception() is not None:
            raise f.exception()


class Engine:
    def __init__(self, cfg: WorkerConfig, recorder: Recorder, *, rendezvous=None, rank: int = 0,
                 tp_shard: tuple[int, int] | None = None, setup: Callable[["Engine"], None] | None = None) -> None:
        """``tp_shard`` = (tp_rank, ATP): this rank keeps that shard of the attention heads;
        ``setup(engine)`` runs after the runner exists and before decode graphs are captured
        (a multi-rank engine installs its phase hooks there: the graphs bind them)."""
        self.cfg = cfg
        self.rec = recorder
        self.rank = rank
        self.faults = Faults.load(cfg.faults)
        if self.faults.active and rendezvous is not None:
            rendezvous = FaultyRendezvous(rendezvous, self.faults)
        self.rendezvous = rendezvous
        self.policy = cfg.scheduler.policy
        dc = cfg.device
        self.device: Device = make_device(dc.device, recorder, residency_slots=dc.residency_slots,
                                          collective_slots=dc.collective_slots,
                                          threads_per_stream=dc.cpu_threads_per_stream,
                                          high_priority_stream=dc.high_priority_stream)
        if self.device.kind == "cpu":
            torch.set_num_threads(dc.cpu_threads_per_stream)
        num_blocks = cfg.cache.num_blocks or self._blocks_from_memory()
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
        if self.device.kind == "cuda" and dc.cuda_graphs:
            # captured on the D stream's own thread so the graphs bind D-owned state
            self.decode_ctx.stream.submit(self.runner.capture_decode_graphs, self.decode_ctx, label="D.capture").enqueued().result()
        if self.device.kind == "cuda" and dc.warmup_prefill:
            self.prefill_ctx.stream.submit(self.runner.warmup_prefill, self.prefill_ctx,
                                           cfg.scheduler.max_prefill_tokens, label="P.warmup").enqueued().result()
            torch.cuda.synchronize()
        self.waiting: deque[Turn] = deque()
        self.decoding: list[Turn] = []
        sc = cfg.scheduler
        self.priority = PriorityConfig(sc.priority, sc.priority_aging_s, sc.ttft_bound_tokens)
        self.history = History()           # finished trajectories: the critical-path predictor
        self._p_admitted_tokens = 0        # prefill tokens admitted so far (the first-token bound)
        self._changed = asyncio.Event()    # replaced on every notify: waiters re-check their predicate
        self._epoch = 0
        self._p_running = False          # a P epoch is being run
        self._p_exclusive = False        # D must not enter (normal policy / activation off)
        self._d_in_flight = False
        self._pending_cleanup: list[Turn] = []
        self.num_dropped_results = 0
        self.num_prefill_tokens = 0      # prompt tokens computed by P passes
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0

    def _blocks_from_memory(self) -> int:  # pragma: no cover - CUDA only
        mc, cc = self.cfg.model, self.cfg.cache
        free, total = torch.cuda.mem_get_info()
        nbytes = torch.finfo(mc.torch_dtype).bits // 8
        per_block = mc.num_layers * 2 * cc.block_size * mc.num_kv_heads * mc.head_dim * nbytes
        weights = mc.rank_params(self.cfg.parallel.expert_parallel) * nbytes      # this rank's experts only
        if cc.gpu_memory_utilization > 0:
            return kv_blocks_for_budget(total, cc.gpu_memory_utilization, weights, per_block, reserve_bytes=2 << 30)
        return max(16, int((free - weights) * cc.gpu_memory_fraction) // per_block)

    # ================================================================== submission
    def check_accepts(self) -> None:
        """Raise unless this rank takes requests (a multi-rank TP follower does not)."""

    def submit(self, turn: Turn) -> None:
        turn.p_mark = self._p_admitted_tokens
        # NOTE: a waiting turn does not pin its trajectory's KV: an idle prefix stays evictable
        # (or waiting turns could hold the whole cache and none be admitted); admission re-reads it.
        self.waiting.append(turn)
        self._notify()

    def abort(self, turn: Turn, reason: str = "abort", *, commit: bool = True) -> None:
        """Abort a turn: its caller gets finish_reason "abort" now, with the tokens and logprobs
        it produced so far (partial rollout). With ``commit`` (abort / abort_all / sleep) the
        trajectory's context becomes the turn's prompt plus those tokens and the KV written for
        them is kept, so ``continue_(tid, [])`` (or resubmitting prompt + partial tokens) resumes
        without recomputing it; without (the caller was cancelled: it never sees the tokens) the
        trajectory keeps its context from before the turn. The KV is cleaned up once no
        submitted device work touches it (a cancel waits for P work to drain). Until then the
        trajectory is *draining*: its next turn is queued but not admitted."""
        if turn.state in (TurnState.DONE, TurnState.ABORTED) or turn.abort_requested:
            return
        turn.abort_requested = True
        turn.commit_on_abort = commit
        turn.routed_experts = of_turn(self.runner.routed, self.kv, turn)    # before its KV can go
        self._resolve(turn, "abort")
        if turn.traj.turn is turn:             # the trajectory is free for its next turn at once
            turn.traj.turn = None
            turn.traj.tokens = turn.context + turn.out_tokens if commit else turn.prev_tokens
        if turn.in_flight == 0:
            self._cleanup_aborted(turn)
        else:
            # NOTE: only a turn with device work pending drains; a queued turn never submitted
            # any, and must not hide the drain of the turn it waits for.
            turn.traj.draining = turn
            self._pending_cleanup.append(turn)
        self._notify()

    def _cleanup_aborted(self, turn: Turn) -> None:
        if turn in self.waiting:
            self.waiting.remove(turn)
        if turn in self.decoding:
            self.decoding.remove(turn)
        turn.state = TurnState.ABORTED
        if turn.lifetime:
            # NOTE: what completed passes of this lifetime wrote (marked) stays cached, addressed by
            # its tokens (a resubmission finds it); a pass still in flight at the abort was never marked.
            self.kv.abort_turn(turn.tid, turn.lifetime, turn.seq_len, self.rec.now())
        # NOTE: a turn never admitted holds no reservation and pins nothing (a pin on its
        # trajectory's KV belongs to another lifetime: an earlier turn still draining).
        if turn.traj.turn is turn:
            turn.traj.turn = None
            turn.traj.tokens = turn.prev_tokens
        if turn.traj.draining is turn:
            turn.traj.draining = None
        turn.drained.set()
        self.num_aborted += 1

    def _drain_cleanups(self) -> None:
        still = []
        for t in self._pending_cleanup:
            if t.in_flight == 0:
                self._cleanup_aborted(t)
            else:
                still.append(t)
        self._pending_cleanup = still

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
    def _pending_view(self) -> list[PendingPrefill]:
        """Admissible waiting turns in the order the priority policy serves them.
        NOTE: a turn whose missing prefix a sibling is writing waits for it (prefix.pending_view)."""
        turns = [t for t in self.waiting if not (t.abort_requested or self._behind_drain(t))]
        return prefix.pending_view(self.kv, self._by_priority(turns, waiting=True))

    def _by_priority(self, turns: list[Turn], *, waiting: bool) -> list[Turn]:
        """``turns`` (arrival order) in the order ``scheduler.priority`` serves them."""
        if self.priority.policy == "fifo" or len(turns) < 2:
            return turns
        now = self.rec.now()
        work = [Work(t.request_id, t.traj.group or t.tid, t.traj.num_turns - 1, len(t.context) + len(t.out_tokens),
                     now - t.t_submit, (self._p_admitted_tokens - t.p_mark) if waiting else 0,
                     bool(t.lifetime) if waiting else False) for t in turns]
        by_id = {t.request_id: t for t in turns}
        return [by_id[w.key] for w in order(work, self.history, self.priority)]

    def record_trajectory(self, group: str, turns: int, tokens: int) -> None:
        """A trajectory ended (released): what it took feeds the critical-path predictor."""
        if turns > 0:
            self.history.record(group, turns, tokens)

    @staticmethod
    def _behind_drain(t: Turn) -> bool:
        """``t`` waits for its trajectory's aborted turn to drain (device work still touches
        the KV it would reuse): queued, not admissible yet; abort / release / sleep / exit end
        it like any waiting turn (issue 13, cases 3 and 4)."""
        d = t.traj.draining
        return d is not None and d is not t

    def _available_blocks(self) -> int:
        return self.kv.pool_blocks()

    def _admit(self, chunks, admitted) -> list[tuple[Turn, int, int]]:
        """Reserve KV for newly admitted turns (FIFO), re-checking each with the same rule the
        planner used (:func:`~ainfer_pd.sched.planner.fits`) on the live cache; the cached prefix
        a turn shares is re-read at its reservation (an earlier admission may have evicted part of
        it, or shared more: the planned demand is never below the live one). Returns the runnable
        chunks (a chunk never runs past its prompt)."""
        by_id = {t.request_id: t for t in self.waiting}
        now = self.rec.now()
        blocked = False
        for rid in admitted:
            t = by_id[rid]
            if blocked or not fits(prefix.demand(self.kv, t), self.kv.pool_blocks()):
                blocked = True            # FIFO: nothing behind it either (cannot happen: same rule as the plan)
                continue
            prefix.reserve(self.kv, t, now)
            self._p_admitted_tokens += len(t.context) - t.prefilled
        work = []
        for c in chunks:
            t = by_id[c.request_id]
            if t.lifetime:
                work.append((t, t.prefilled, min(c.num_tokens, len(t.context) - t.prefilled)))
        return work

    def _p_admissible(self) -> bool:
        pend = self._pending_view()
        if not pend:
            return False
        chunks, _ = plan_prefill(pend, self.cfg.scheduler.max_prefill_tokens, self._available_blocks())
        return bool(chunks)

    async def _prefill_loop(self) -> None:
        """Background P task. Consumes waiting turns in P epochs (token budget, D-first KV).
        Waits for: admissible work; per MoE layer the receive counts (P's own device
        progress) and then the turnstile permit. Unblocked by: submissions, KV freed by
        finished/aborted turns, D rounds granting permits."""
        while True:
            await self._wait_for(self._p_admissible)
            chunks, admitted = plan_prefill(self._pending_view(), self.cfg.scheduler.max_prefill_tokens,
                                            self._available_blocks())
            work = self._admit(chunks, admitted)
            if not work:
                # NOTE: unreachable while the plan and the admission share `fits`; should it happen,
                # wait for the next change (a turn ending frees KV) instead of polling.
                await self._changed.wait()
                continue
            self._epoch += 1
            has_d = bool(self.decoding)
            # NOTE: without the turnstile and with decode rows present, D waits for this epoch (strict P priority).
            mode = epoch_mode(self.policy, has_d, has_d and self.traits.turnstile and self._mux_active(work))
            try:
                await self._run_epoch(self._epoch, work, mode, d_enqueued=self._d_in_flight)
            except Exception as exc:
                # NOTE: one rank, so no peer waits on this epoch: fail its turns (typed), free their
                # KV once the P stream drained, keep serving everyone else.
                err = exc if isinstance(exc, AInferPDError) else EpochFailedError(
                    f"P epoch {self._epoch} failed: {exc!r}")
                await self._drain_stream(self.prefill_ctx.stream)
                self._fail_turns([t for t, _, _ in work], err)
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
        return SpanInputs(num_d_rows=len(self.decoding), max_d_rows=self.cfg.scheduler.max_decode_batch,
                          num_p_waiting_tokens=sum(t.remaining_prompt for t in self.waiting),
                          p_budget_tokens=self.cfg.scheduler.max_prefill_tokens,
                          d_iter_s=self._d_iter_ema, p_boundary_s=self._p_boundary_ema)

    @staticmethod
    def _ema(old: float, new: float, a: float = 0.3) -> float:
        return new if old == 0.0 else (1 - a) * old + a * new

    def _mux_active(self, work) -> bool:
        tokens = sum(n for _, _, n in work) + sum(t.remaining_prompt for t in self.waiting)
        return self.activation.update(self.rec.now(), tokens, len(self.decoding))

    async def _run_epoch(self, epoch: int, work: list[tuple[Turn, int, int]], mode: EpochMode, *,
                         d_enqueued: bool, entered: asyncio.Event | None = None, plan: BatchPlan | None = None) -> None:
        """One P epoch: segments on the P stream, stopping at safe boundaries for the turnstile
        (``mode.gated``). ``entered`` is set once the epoch is registered with the turnstile. ``plan``:
        the batch when it was not built here from ``work`` (a TP follower runs its leader's)."""
        plan = plan if plan is not None else self.runner.build(work, [])
        for t, _, _ in work:
            t.in_flight += 1
        ctx = self.prefill_ctx
        stream = ctx.stream
        runner, L = self.runner, self.runner.num_layers
        box = _Box()
        mux, fine = mode.gated, mode.per_layer
        counts = self._p_paced_per_layer()
        t_permits = 0.0
        self._p_exclusive = mode.exclusive
        self._p_running = True
        self.rec.event("p_epoch", epoch=epoch, tokens=plan.num_tokens, gated=mux, policy=self.policy)
        t_start = self.rec.now()
        waited = 0.0
        counts_waited = 0.0
        seg_b = 0                                # the boundary P last passed: its communication's segment
        try:
            async with self.turnstile.epoch(epoch, gated=mux, d_enqueued=d_enqueued) as ep:
                if entered is not None:
                    entered.set()
                async def permit(b: int) -> None:
                    nonlocal waited, seg_b
                    t0 = self.rec.now()
                    await ep.permit(b)
                    waited += self.rec.now() - t0
                    seg_b = b
                    self.rec.event("p_permit", epoch=epoch, boundary=b)
                    set_log_context(epoch=epoch, boundary=b)

                if mux:
                    ep.publish(0)
                    await permit(0)
                segs = [stream.submit(lambda: setattr(box, "st", runner.embed(plan)), label="P.embed", attrs=P_ITEM)]
                for layer in range(L):
                    w = self._enqueue_attention(layer, box, plan, epoch, seg_b, gated=mux, segs=segs)
                    b = 2 * layer + 1                  # expert notification point
                    if fine:
                        ep.publish(b)
                    if counts:
                        t0 = self.rec.now()
                        await w.done()                 # receive counts: P's device progress paces its host
                        if box.notified is not None:
                            await box.notified.wait(timeout=self.cfg.parallel.rendezvous_timeout_s)
                        if self.faults.slow_counts_ms:
                            await asyncio.sleep(self.faults.slow_counts_ms / 1e3)
                        self.rec.event("p_counts", epoch=epoch, boundary=b)
                        self.rec.sample("p_counts_wait_s", self.rec.now() - t0)
                        waited += self.rec.now() - t0
                        counts_waited += self.rec.now() - t0
                    if fine:
                        await permit(b)
                    segs.append(stream.submit(
                        lambda l=layer: setattr(box, "st", runner.experts(l, box.st, ctx, box.notified)),
                        label=f"P.experts{layer}", attrs=P_ITEM))
                    if fine:
                        if b + 1 < 2 * L:
                            ep.publish(b + 1)          # layer end
                            await permit(b + 1)
                        else:
                            ep.publish(b + 1, final=True)
                logits_w = stream.submit(lambda: runner.head(box.st, plan), label="P.head", attrs=P_ITEM)
                self.rec.sample("p_enqueue_s", self.rec.now() - t_start - waited)
                if plan.num_tokens and counts:
                    p_time = self.rec.now() - t_start - (waited - counts_waited)
                    self._p_boundary_ema = self._ema(self._p_boundary_ema, p_time / (2 * L))
                elif plan.num_tokens:
                    t_permits = waited
                if mode.final == "enqueue":
                    ep.publish(1, final=True)
                if mode.final == "complete" or not mux:
                    logits = await _segments_done(segs, logits_w)
                    if mux:
                        ep.publish(1, final=True)
            if mux and mode.final != "complete":
                logits = await _segments_done(segs, logits_w)
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
            self._drain_cleanups()
            self._notify()
        self.rec.event("p_epoch_done", epoch=epoch)
        self.rec.sample("p_epoch_s", self.rec.now() - t_start)
        self.rec.sample("p_epoch_tokens", plan.num_tokens)
        self._finish_prefill(plan, logits)

    def _enqueue_attention(self, layer: int, box: _Box, plan: BatchPlan, epoch: int, boundary: int, *,
                           gated: bool, segs: list):
        """Enqueue layer ``layer``'s attention and router (the expert notification) on the P
        stream; returns the item whose completion means the receive counts are on their way.
        Under attention TP the partial output is all-reduced by its own item in between
        (:meth:`_p_all_reduce`: routed by the ordering; ``boundary`` = its segment). Every item
        enqueued is appended to ``segs`` (the epoch's segments: a failed one fails the epoch)."""
        ctx, runner = self.prefill_ctx, self.runner
        faults_on = self.faults.active

        def attn() -> None:
            if faults_on:
                self.faults.on_p_segment(epoch, layer)
            box.st = runner.attn_route(layer, box.st, plan)
            box.notified = runner.notify(ctx, box.st)     # the expert notification

        def attention() -> None:
            if faults_on:
                self.faults.on_p_segment(epoch, layer)
            box.o = runner.attention(layer, box.st, plan)

        if not self._p_tensor_parallel:
            w = ctx.stream.submit(attn, label=f"P.attn{layer}", attrs=P_ITEM)
            segs.append(w)
            return w
        wa = ctx.stream.submit(attention, label=f"P.attn{layer}", attrs=P_ITEM)
        segs.append(wa)
        ar = self._p_all_reduce(lambda: box.o, after=wa, epoch=epoch, boundary=boundary, gated=gated)
        segs.append(ar)

        def route() -> None:
            box.st = runner.after_attention(layer, box.st, ar.enqueued().result(), plan)
            box.notified = runner.notify(ctx, box.st)

        w = ctx.stream.submit(route, label=f"P.route{layer}", attrs=P_ITEM,
                              deps=(ar,) if ar.stream is not ctx.stream else ())
        segs.append(w)
        return w

    _p_tensor_parallel = False
    """This rank holds a shard of the attention heads: P all-reduces every layer's output."""

    def _p_all_reduce(self, tensor, *, after, epoch: int, boundary: int, gated: bool):  # pragma: no cover
        raise NotImplementedError("attention TP runs in the lockstep engine")

    def _finish_prefill(self, plan: BatchPlan, logits: torch.Tensor) -> None:
        """Promote completed prompts to D (lifetime-checked); advance partial chunks."""
        now = self.rec.now()
        for t, start, n in plan.prefill:
            self.num_prefill_tokens += n                 # computed, whatever becomes of the turn
            if t.abort_requested or t.state is not TurnState.WAITING:
                continue
            if not self.kv.is_current(t.tid, t.lifetime):
                self.num_dropped_results += 1
                continue
            t.prefilled = start + n
            self.kv.mark_written(t.tid, t.lifetime, t.prefilled)
        keep = [i for i, t in enumerate(plan.logit_turns) if not t.abort_requested and t.state is TurnState.WAITING
                and self.kv.is_current(t.tid, t.lifetime)]
        if keep:
            turns = [plan.logit_turns[i] for i in keep]
            toks, lps, bad = sample(logits[keep], [self._sample_row(t) for t in turns])
            self._fail_unsampled(turns, bad)
            for i, (t, tok, lp) in enumerate(zip(turns, toks, lps)):
                if i in bad:
                    continue
                self.waiting.remove(t)
                t.t_first = now
                self.rec.sample("ttft_s", now - t.t_submit)
                t.state = TurnState.DECODING
                self._append_token(t, tok, lp)
        self._notify()

    # ------------------------------------------------------------------ D
    def _has_live_rows(self) -> bool:
        return any(not t.abort_requested for t in self.decoding)

    def _d_may_run(self) -> bool:
        if not self._has_live_rows():
            return False
        if self.traits.p_priority:
            return not (self._p_running or self._p_admissible())
        return not self._p_exclusive

    async def _await_decode_rows(self) -> None:
        """Wait for live decode rows. While D has none, it owes a gated P epoch no round: the
        turnstile opens that epoch's gate (issue 13, case 2: the last row finished, was aborted,
        cancelled, released or slept away mid-epoch; before, P waited for a permit no D round
        would grant). New rows appear only when an epoch ends, so the gate stays open to its end."""
        while not self._has_live_rows():
            if self.turnstile.gated_epoch_active:
                self.turnstile.open_gate()
            await self._changed.wait()

    async def _decode_loop(self) -> None:
        """Foreground D loop. Consumes decoding turns, one iteration at a time.
        Waits for: decode rows; under ``normal`` no pending P; under the turnstile
        policies P's next boundary (rendezvous 1) and the enqueue ACK (rendezvous 2).
        Unblocked by: promotions, P epochs ending, boundaries published, aborts."""
        while True:
            await self._await_decode_rows()
            t_ready = self.rec.now()
            await self._wait_for(lambda: self._d_may_run() or not self._has_live_rows())
            if not self._has_live_rows():
                continue
            rnd = await self.turnstile.before_decode()
            ready = self.decoding
            if len(ready) > self.cfg.scheduler.max_decode_batch:
                ready = self._by_priority(list(ready), waiting=False)
            rows = [t for t in plan_decode(ready, self.cfg.scheduler.max_decode_batch) if not t.abort_requested]
            if not rows:
                if rnd is not None:
                    await self.turnstile.after_decode(rnd)
                continue
            await self._decode_once(rows, rnd, t_ready)
            self._notify()

    async def _decode_once(self, rows: list[Turn], rnd, t_ready: float) -> None:
        """Enqueue one D iteration of ``rows`` (empty on a lockstep rank without rows), inside
        the turnstile round ``rnd`` when one is open; await completion; emit the tokens."""
        t_build = self.rec.now()
        plan = await self._decode_plan(rows)
        self.rec.sample("d_build_s", self.rec.now() - t_build)
        if self.faults.active:
            skew = self.faults.d_skew_s()
            if skew:
                await asyncio.sleep(skew)
        for t in rows:
            t.in_flight += 1
        self._before_d_launch(rnd)
        w = self.decode_ctx.stream.submit(self.runner.decode, plan, self.decode_ctx, label="D.iter",
                                          attrs={**D_ITEM, "epoch": rnd.epoch if rnd else None},
                                          delay_s=self._d_device_delay_s)
        self._d_in_flight = True
        if rows:
            self.rec.sample("d_wait_s", self.rec.now() - t_ready)
        self.rec.event("d_launch", rows=len(rows), round=rnd is not None, epoch=self._epoch)
        t_launch = self.rec.now()
        try:
            if rnd is not None:
                await self.turnstile.after_decode(rnd)
                p_running = self.prefill_ctx.stream.num_pending
                if p_running:
                    # the enqueue ACK came while P work was still running: not a completion fence
                    self.rec.count("delayed_ack_rounds")
                self.rec.event("ack", epoch=rnd.epoch, boundary=rnd.boundary, p_running=p_running)
            logits = await w.done()
        finally:
            self._d_in_flight = False
            for t in rows:
                t.in_flight -= 1
        t_done = self.rec.now()
        self._d_iter_ema = self._ema(self._d_iter_ema, t_done - t_launch)
        self.rec.sample("d_iter_s", t_done - t_launch)
        self._finish_decode(plan, logits)
        self._drain_cleanups()
        self.rec.sample("d_post_s", self.rec.now() - t_done)

    async def _decode_plan(self, rows: list[Turn]) -> BatchPlan:
        """The D batch of ``rows`` (a lockstep rank pads it and shares it with its TP followers)."""
        return self.runner.build([], rows)

    def _before_d_launch(self, rnd) -> None:
        """Host side of the D launch, right before it is enqueued (lockstep: D's collectives)."""

    _d_device_delay_s = 0.0
    """Fault injection: the D iteration starts this much later on the device (replicas out of phase)."""

    def _finish_decode(self, plan: BatchPlan, logits: torch.Tensor) -> None:
        live = [i for i, t in enumerate(plan.logit_turns) if not t.abort_requested and t.state is TurnState.DECODING]
        if not live:
            return
        turns = [plan.logit_turns[i] for i in live]
        for t in turns:
            self.kv.mark_written(t.tid, t.lifetime, t.seq_len)
        toks, lps, bad = sample(logits[live], [self._sample_row(t) for t in turns])
        self._fail_unsampled(turns, bad)
        for i, (t, tok, lp) in enumerate(zip(turns, toks, lps)):
            if i not in bad:
                self._append_token(t, tok, lp)

    def _fail_unsampled(self, turns: list[Turn], bad: dict[int, str]) -> None:
        """Rows the sampler could not sample end alone with SamplingError (their device work
        has completed); the rest of the batch goes on."""
        for i, why in bad.items():
            t = turns[i]
            log.warning("request %s failed in sampling: %s", t.request_id, why)
            self._fail_turns([t], SamplingError(f"request {t.request_id} ({t.tid!r}): {why} "
                                                f"(sampling params {t.params})"))

    # ================================================================== tokens and finishing
    def _sample_row(self, t: Turn) -> SampleRow:
        hist = (t.context + t.out_tokens) if t.params.repetition_penalty != 1.0 else None
        return SampleRow(t.params, t.generator, hist)

    def _append_token(self, t: Turn, tok: int, lp: float) -> None:
        t.out_tokens.append(tok)
        t.out_logprobs.append(lp)
        p = t.params
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.cfg.model.eos_token_id):
            reason = "stop"
        elif len(t.out_tokens) >= p.max_new_tokens or t.seq_len >= self.cfg.model.max_context_len:
            reason = "length"
        if reason is None:
            if t.state is TurnState.DECODING and t not in self.decoding:
                self.decoding.append(t)
            return
        if t in self.decoding:
            self.decoding.remove(t)
        t.state = TurnState.DONE
        t.traj.tokens = t.context + t.out_tokens
        t.routed_experts = of_turn(self.runner.routed, self.kv, t)          # before its KV goes
        self.kv.finish_turn(t.tid, t.lifetime, t.seq_len - 1, self.rec.now())
        if t.traj.turn is t:
            t.traj.turn = None
        self.num_finished += 1
        self.rec.sample("request_latency_s", self.rec.now() - t.t_submit)
        self._resolve(t, reason)

    def _resolve(self, t: Turn, reason: str) -> None:
        if t.future.done():
            return
        now = self.rec.now()
        ttft = (t.t_first - t.t_submit) if t.t_first is not None else now - t.t_submit
        out = TurnOutput(trajectory_id=t.tid, token_ids=list(t.out_tokens), logprobs=list(t.out_logprobs),
                         finish_reason=reason, num_prompt_tokens=len(t.context),
                         num_cached_tokens=t.num_cached, ttft_s=ttft, latency_s=now - t.t_submit,
                         request_id=t.request_id, turn_index=t.traj.num_turns - 1,
                         routed_experts=t.routed_experts)
        t.future.set_result(out)

    async def _drain_stream(self, stream) -> None:
        """Wait until every item submitted to ``stream`` so far has run (FIFO barrier)."""
        await asyncio.wrap_future(stream.submit(lambda: None, label="barrier").enqueued())

    def _fail_turns(self, turns: list[Turn], err: BaseException) -> None:
        """End ``turns`` with ``err`` (typed) and free their KV (their device work has drained)."""
        for t in turns:
            if t.state in (TurnState.DONE, TurnState.ABORTED):
                continue
            if not t.future.done():
                t.future.set_exception(err)
            self.num_failed += 1
            t.abort_requested = True
            t.commit_on_abort = False        # a failed turn leaves its trajectory as it was
            t.in_flight = 0
            self._cleanup_aborted(t)
            self.num_aborted -= 1            # counted as failed, not aborted
        self._notify()

    async def aclose(self) -> None:
        """After the loops stopped: release what the engine owns beyond its threads (the
        lockstep engine's control rendezvous); nothing at world size 1."""

    def close(self) -> None:
        """After the loops stopped and the streams were joined (no device work in flight):
        every turn still known ends with "abort" and every pending cleanup runs, so no caller,
        drain waiter or KV pin is left behind."""
        for t in self._pending_cleanup:
            t.in_flight = 0
        self._drain_cleanups()
        for t in list(self.waiting) + list(self.decoding):
            t.in_flight = 0
            self.abort(t, "shutdown")

    def fail_all(self, exc: BaseException) -> None:
        """The engine stopped: every turn in flight ends with ``exc`` (typed)."""
        self._fail_turns(list(self.waiting) + list(self.decoding), exc)

    # ================================================================== introspection
    def metrics(self) -> dict[str, Any]:
        m = self.rec.summary()
        p_work = sum(b - a for (_, s, a, b, _) in self.rec.intervals if s == "P")
        d_work = sum(b - a for (_, s, a, b, _) in self.rec.intervals if s == "D")
        m.update({
            "policy": self.policy,
            "p_work_s_sum": p_work, "d_work_s_sum": d_work,
            "num_epochs": self._epoch,
            "finished": self.num_finished, "aborted": self.num_aborted, "failures": self.num_failed,
            "dropped_results": self.num_dropped_results,
            "kv_free_blocks": self.kv.num_free_blocks, "kv_total_blocks": self.kv.alloc.num_blocks,
            "kv_evictions": self.kv.num_evictions,
            "kv_cached_blocks": self.kv.num_cached_blocks,
            "prefix_prompt_tokens": self.kv.num_prompt_tokens,      # prompt tokens of every admitted turn
            "prefix_reused_tokens": self.kv.num_reused_tokens,      # of those, served from cached KV
            "prefill_tokens": self.num_prefill_tokens,              # prompt tokens computed
            "activation_switches": self.activation.switches,
            "d_wait_s_samples": list(self.rec.samples.get("d_wait_s", [])),
            "ttft_s_samples": list(self.rec.samples.get("ttft_s", [])),
        })
        return m

    def shutdown(self) -> None:
        """Join the stream threads; on CUDA give the device memory back (a closed worker
        keeps no weights, KV cache or graphs alive, so the next one fits)."""
        self.device.shutdown()
        if self.device.kind == "cuda":
            r = self.runner
            r.graphs = None
            r.kv_cache = None
            for p in r.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
