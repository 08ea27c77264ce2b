"""The turn bookkeeping of one rank's engine: queues, admission, tokens and endings (synchronous).

:class:`TurnBook` holds the turns an engine serves (``waiting`` for prefill, ``decoding``) and
everything that happens to them between device passes, without an event loop or a device:
submission, the admissible view the planner sees and the KV reservation of what it admits
(:meth:`TurnBook.admit`), the tokens a pass's logits give (:meth:`TurnBook.finish_prefill`,
:meth:`TurnBook.finish_decode`), and every ending (stop / length, abort and its drain, failure)
with its :class:`~ainfer_pd.request.TurnOutput` (abort, failure and close are the mixin
:class:`~ainfer_pd.engine.loop.turn_endings.TurnEndings`). The engine's loops (:mod:`.engine`) decide
when device work runs and call in here before and after it; whatever they wait on that
changes here is reported through ``notify``.
"""
from __future__ import annotations

import logging
from array import array
from collections import deque
from typing import Any, Callable

import torch

from ...config import ModelConfig, SchedulerConfig
from ...errors import SamplingError
from ...metrics.recorder import Recorder
from ...sched.output_reserve import OutputReserve
from ...sched.planner import PendingPrefill, fits, plan_prefill
from ...sched.priority import History, PriorityConfig, Work, order, short_first_under_pressure
from ..kv import prefix
from ..kv.kv_cache import KVCacheManager
from ..model.routed_experts import of_turn
from ..runtime.runner import BatchPlan
from ..model.sampler import DeviceSample, SampleRow, read_sample, sample
from ...spec.verify import DeviceVerify, read_verify, verify_rows, verify_starts
from .kv_growth import KVGrowth
from .live_cap import LiveCap
from .state import InFlight, Turn, TurnState
from .turn_endings import TurnEndings

log = logging.getLogger("ainfer_pd.engine")


class TurnBook(KVGrowth, TurnEndings):
    """The turns of one rank and what happens to them between device passes.

    ``routed``: the routed-experts cache (routing replay) a turn's expert ids are gathered from
    as it ends, or None; ``notify()``: called whenever the queues, the KV pool or a turn's
    state changed in a way the engine's loops may be waiting on; ``reserve``: what a turn's output
    holds in KV (``cache.reserve_output``: :mod:`.kv_growth`)."""

    def __init__(self, model: ModelConfig, scheduler: SchedulerConfig, recorder: Recorder, kv: KVCacheManager, *,
                 routed=None, notify: Callable[[], None] = lambda: None,
                 reserve: OutputReserve = OutputReserve()) -> None:
        self.max_context_len = model.max_context_len
        self.max_prefill_tokens = scheduler.max_prefill_tokens
        self.rec = recorder
        self.kv = kv
        self.routed = routed
        self.notify = notify
        self.waiting: deque[Turn] = deque()
        self.decoding: list[Turn] = []
        self.model_stops = model.stop_set
        """The model's whole stop set (``eos_token_id`` + ``stop_token_ids``: issue 34, item 2)."""
        sc = scheduler
        self.priority = PriorityConfig(sc.priority, sc.priority_aging_s, sc.ttft_bound_tokens, sc.short_prefill_tokens)
        self.live = LiveCap(sc.max_live_trajectories, kv, recorder, notify)
        self.history = History()           # finished trajectories: the critical-path predictor
        self.num_p_admitted_tokens = 0     # prefill tokens admitted so far (the first-token bound)
        self.reserve = reserve
        self.ratio = reserve.init          # estimate: the expected share of a turn's tokens left it writes
        self.num_preemptions = 0
        self.pending_cleanup: list[Turn] = []
        """Aborted turns whose device work has not drained (cleaned up by :meth:`drain_cleanups`)."""
        self.pending_finish: list[Turn] = []
        """Ended turns whose last (unused) D pass is in flight: their KV goes back once it drained
        (:meth:`drain_cleanups`)."""
        self.num_dropped_results = 0
        self.num_prefill_tokens = 0        # prompt tokens computed by P passes
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0

    # ================================================================== device work in flight
    def in_flight(self, turns) -> "InFlight":
        """Count ``turns`` as touched by device work until the returned hold is released (a
        context manager, or :meth:`InFlight.release` once the work was read): an aborted or
        ended turn keeps its KV until then (:meth:`drain_cleanups`)."""
        return InFlight(list(turns))

    # ================================================================== submission
    def submit(self, turn: Turn) -> None:
        turn.p_mark = self.num_p_admitted_tokens
        # NOTE: a waiting turn does not pin its trajectory's KV: an idle prefix stays evictable
        # (or waiting turns could hold the whole cache and none be admitted); admission re-reads it.
        self.waiting.append(turn)
        self.notify()

    # ================================================================== admission
    def pending_view(self) -> list[PendingPrefill]:
        """Admissible waiting turns in the order the priority policy serves them.
        NOTE: a turn whose missing prefix a sibling is writing waits for it (prefix.pending_view)."""
        turns = self.by_priority([t for t in self.waiting if not (t.abort_requested or self.behind_drain(t))],
                                 waiting=True)
        if self.live.cap and (cap := self.live.cap_now(self.history)):
            turns = self.live.capped(turns, self.decoding, self.waiting, cap)
        view = prefix.pending_view(self.kv, turns, self.reserve, self.ratio)
        kv, pr = self.kv, self.priority
        first = next((p for p in view if not p.admitted), None)
        # (the D loop asks for this view every iteration: nothing more unless the head needs more
        # blocks than are free, the only case the order below can change)
        if pr.policy != "fifo" or pr.short_prefill_tokens <= 0 or first is None \
                or first.blocks_needed <= kv.alloc.num_free:
            return view
        by_id = {t.request_id: t for t in turns}
        overdue = self.p_tokens_ahead(by_id[first.request_id]) >= pr.ttft_bound_tokens
        # blocks an admission takes without evicting a waiting turn's cached prefix: the free ones and
        # the cached ones no waiting turn reuses (a prefix siblings share counted once per sibling)
        wanted = sum((len(by_id[p.request_id].prompt) - p.remaining_tokens) // kv.block_size
                     for p in view if not p.admitted)
        spare = kv.alloc.num_free + max(0, kv.alloc.num_cached - wanted)
        return short_first_under_pressure(view, spare, pr.short_prefill_tokens, overdue)

    def p_tokens_ahead(self, t: Turn) -> int:
        """Prefill tokens admitted since ``t`` was submitted (what the first-token bound counts)."""
        return self.num_p_admitted_tokens - t.p_mark

    def by_priority(self, turns: list[Turn], *, waiting: bool) -> list[Turn]:
        """``turns`` (arrival order) in the order ``scheduler.priority`` serves them."""
        if self.priority.policy == "fifo" or len(turns) < 2:
            return turns
        now = self.rec.now()
        short = waiting and self.priority.short_prefill_tokens > 0
        work = [Work(t.request_id, t.traj.group or t.tid, t.traj.num_turns - 1, len(t.context) + len(t.out_tokens),
                     now - t.t_submit, self.p_tokens_ahead(t) if waiting else 0,
                     bool(t.lifetime) if waiting else False,
                     prefix.prefill_left(self.kv, t) if short else 0) for t in turns]
        by_id = {t.request_id: t for t in turns}
        return [by_id[w.key] for w in order(work, self.history, self.priority)]

    def record_trajectory(self, group: str, turns: int, tokens: int) -> None:
        """A trajectory ended (released): what it took feeds the critical-path predictor."""
        if turns > 0:
            self.history.record(group, turns, tokens)

    @staticmethod
    def behind_drain(t: Turn) -> bool:
        """``t`` waits for its trajectory's aborted turn to drain (device work still touches
        the KV it would reuse): queued, not admissible yet; abort / release / sleep / exit end
        it like any waiting turn (issue 13, cases 3 and 4)."""
        d = t.traj.draining
        return d is not None and d is not t

    def available_blocks(self) -> int:
        """Blocks an admission may take: the pool less the admitted turns' expected output."""
        return self.kv.pool_blocks() - self.headroom()

    def p_admissible(self) -> bool:
        """Some waiting turn would be admitted by a P epoch planned now."""
        pend = self.pending_view()
        if not pend:
            return False
        chunks, _ = plan_prefill(pend, self.max_prefill_tokens, self.available_blocks())
        return bool(chunks)

    def admit(self, chunks, admitted, budget: int | None = None) -> list[tuple[Turn, int, int]]:
        """Reserve KV for newly admitted turns (FIFO), re-checking each with the same rule the
        planner used (:func:`~ainfer_pd.sched.planner.fits`) on the live cache; the cached prefix
        a turn shares is re-read at its reservation (an earlier admission may have evicted part of
        it, adopted the tail it counted on, or shared more: the planned demand is never below the
        live one). Returns the runnable chunks (turn, start, tokens), in the plan's order.

        Each chunk is sized from the cache as it is after the step's earlier admissions (issue 34,
        item 10): a turn starts where its reservation's reused prefix ends and runs to the end of
        its prompt within ``budget`` (the step's token budget; default the planned chunks' total),
        so a view an earlier admission of the same step made stale never leaves part of a prompt
        behind. A chunk never runs past its prompt."""
        by_id = {t.request_id: t for t in self.waiting}
        now = self.rec.now()
        blocked = False
        new = set(admitted)
        left = sum(c.num_tokens for c in chunks) if budget is None else budget
        work = []
        for c in chunks:
            t = by_id[c.request_id]
            if c.request_id in new:
                if blocked or not fits(prefix.demand(self.kv, t, self.reserve, self.ratio), self.available_blocks()):
                    blocked = True        # FIFO: nothing behind it either (cannot happen: same rule as the plan)
                    continue
                prefix.reserve(self.kv, t, now, self.reserve)
                self.headroom_admitted(t)
                self.live.admitted(t.tid)
                self.num_p_admitted_tokens += len(t.prompt) - t.prefilled
                n = min(len(t.prompt) - t.prefilled, left)
            elif t.lifetime:
                n = min(len(t.prompt) - t.prefilled, left)
            else:
                continue
            if n > 0:
                work.append((t, t.prefilled, n))
                left -= n
        return work

    def has_live_rows(self) -> bool:
        return any(not t.abort_requested for t in self.decoding)

    # ================================================================== results of a pass
    def finish_prefill(self, plan: BatchPlan, logits: torch.Tensor | None = None, *,
                       sampled: DeviceSample | None = None) -> None:
        """Promote completed prompts to D (lifetime-checked); advance partial chunks. Their first
        tokens: ``sampled`` on the device already (every logits row of the plan, by P's head item),
        or sampled here from ``logits``."""
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
            toks, lps, bad = self._tokens(keep, turns, logits, sampled)
            self._fail_unsampled(turns, bad)
            for i, (t, tok, lp) in enumerate(zip(turns, toks, lps)):
                if i in bad:
                    continue
                self.waiting.remove(t)
                if t.t_first is None:                    # (a preempted turn's resumption: not its first)
                    t.t_first = now
                    self.rec.sample("ttft_s", now - t.t_submit)
                t.state = TurnState.DECODING
                self._append_token(t, tok, lp)
        self.notify()

    def finish_decode(self, plan: BatchPlan, logits: torch.Tensor | None = None, *,
                      sampled: DeviceSample | None = None) -> None:
        """Append each live decode row's sampled token (its KV for the fed token is written).
        ``sampled``: the iteration was sampled on the device already (every row of the plan, by
        its D item); rows that ended or were aborted since are skipped."""
        live = [i for i, t in enumerate(plan.logit_turns) if not t.abort_requested and t.state is TurnState.DECODING]
        if sampled is not None and len(live) < len(plan.logit_turns):
            self.rec.count("d_rows_unused", len(plan.logit_turns) - len(live))   # ended or aborted since the launch
        if not live:
            return
        turns = [plan.logit_turns[i] for i in live]
        for t in turns:
            self.kv.mark_written(t.tid, t.lifetime, t.seq_len)
        toks, lps, bad = self._tokens(live, turns, logits, sampled)
        self._fail_unsampled(turns, bad)
        for i, (t, tok, lp) in enumerate(zip(turns, toks, lps)):
            if i not in bad:
                self._append_token(t, tok, lp)

    def finish_verify(self, plan: BatchPlan, logits: torch.Tensor | None = None, *,
                      verified: DeviceVerify | None = None) -> list[int | None]:
        """A verify pass (speculative decoding: ``plan.drafts``) was read: each live row's emitted
        run, its accepted drafts then the one token after them (:func:`~ainfer_pd.spec.verify.verify`:
        the sampler's tokens and the target's logprobs), is appended token by token, each marking
        written the KV its predecessor's position holds (that position was fed in this pass with
        the accepted prefix), so a stop token or the length limit ends the turn at once and the
        rest of the run is dropped; a rejected draft's KV is never marked written. ``verified``:
        the item verified every row on the device already (:func:`verify_rows`), else it is done
        here from ``logits``. Returns the drafts each row accepted (None: a row ended or aborted
        since the launch)."""
        turns, drafts = plan.decode, plan.drafts
        accepted: list[int | None] = [None] * len(turns)
        live = [i for i, t in enumerate(turns) if not t.abort_requested and t.state is TurnState.DECODING]
        if not live:
            return accepted
        rows = [turns[i] for i in live]
        if verified is None:
            starts = verify_starts(drafts)
            v = read_verify(verify_rows(logits, [drafts[i] for i in live], [self.sample_row(t) for t in rows],
                                        starts=[starts[i] for i in live]))
            at = range(len(live))
        else:
            v, at = read_verify(verified), live
        for j, t in enumerate(rows):
            for tok, lp in zip(v.tokens[at[j]], v.logprobs[at[j]]):
                if t.state is not TurnState.DECODING:
                    break
                self.kv.mark_written(t.tid, t.lifetime, t.seq_len)
                self._append_token(t, tok, lp)
            accepted[live[j]] = v.accepted[at[j]]
        bad = {j: v.bad[at[j]] for j in range(len(rows)) if at[j] in v.bad}
        self._fail_unsampled(rows, {j: why for j, why in bad.items() if rows[j].state is TurnState.DECODING})
        return accepted

    def _tokens(self, idx: list[int], turns: list[Turn], logits: torch.Tensor | None,
                sampled: DeviceSample | None) -> tuple[list[int], list[float], dict[int, str]]:
        """The tokens, logprobs and unsampled rows of the plan's logits rows ``idx`` (``turns``):
        read from ``sampled`` (the item sampled every row; no device work here), else sampled now
        from ``logits`` (a device read on the event loop: the mixed-chunked loop's)."""
        if sampled is None:
            return sample(logits[idx], [self.sample_row(t) for t in turns])
        all_toks, all_lps, all_bad = read_sample(sampled)
        return ([all_toks[i] for i in idx], [all_lps[i] for i in idx],
                {j: all_bad[i] for j, i in enumerate(idx) if i in all_bad})

    def _fail_unsampled(self, turns: list[Turn], bad: dict[int, str]) -> None:
        """Rows the sampler could not sample end alone with SamplingError (their device work
        has completed); the rest of the batch goes on."""
        for i, why in bad.items():
            t = turns[i]
            log.warning("request %s failed in sampling: %s", t.request_id, why)
            self.fail_turns([t], SamplingError(f"request {t.request_id} ({t.tid!r}): {why} "
                                               f"(sampling params {t.params})"), drained=False)

    @staticmethod
    def sample_row(t: Turn, ahead: int = 0, live: bool = False) -> SampleRow:
        """``ahead``: tokens of ``t`` sampled on the device and not read yet (their count is the
        noise counter's offset; a repetition penalty takes the one fed on the device from the pass's
        input ids: see ``engine.d_overlap``). ``live``: a penalized row carries the turn's history
        itself with its length and key (for a :class:`~..model.seen_masks.SeenMasks` pool), else a
        snapshot copy."""
        hist = None
        if t.params.repetition_penalty != 1.0:       # the turn's ids, kept as array('q'): extended, not rebuilt
            hist = t.history
            if hist is None or len(hist) < len(t.context):
                hist = t.history = array("q", t.context)
            hist.extend(t.out_tokens[len(hist) - len(t.context):])
            if live:                                  # append-only: its first len(hist) ids stay this row's
                return SampleRow(t.params, t.seed, len(t.out_tokens) + ahead, hist, t.tid, len(hist))
            hist = array("q", hist)                   # a snapshot (a memcpy): the row may be sampled on a stream
        return SampleRow(t.params, t.seed, len(t.out_tokens) + ahead, hist)

    def _append_token(self, t: Turn, tok: int, lp: float) -> None:
        t.out_tokens.append(tok)
        t.out_logprobs.append(lp)
        p = t.params
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.model_stops):
            reason = "stop"
        elif len(t.out_tokens) >= p.max_new_tokens or t.seq_len >= self.max_context_len:
            reason = "length"
        if reason is None:
            if t.state is TurnState.DECODING and t not in self.decoding:
                self.decoding.append(t)
            return
        if t in self.decoding:
            self.decoding.remove(t)
        t.state = TurnState.DONE
        t.traj.tokens = t.context + t.out_tokens
        t.routed_experts = of_turn(self.routed, self.kv, t)          # before its KV goes
        if t.in_flight:
            # NOTE: the overlapped D loop launched the next iteration with this row before its
            # stop token was read: that pass still writes the row's KV. Its blocks go back once it
            # drained; until then the trajectory drains (its next turn waits, release waits).
            t.traj.draining = t
            self.pending_finish.append(t)
        else:
            self.kv.finish_turn(t.tid, t.lifetime, t.seq_len - 1, self.rec.now())
        if t.traj.turn is t:
            t.traj.turn = None
        self.num_finished += 1
        self.rec.sample("request_latency_s", self.rec.now() - t.t_submit)
        self.resolve(t, reason)

    # ================================================================== introspection
    def metrics(self) -> dict[str, Any]:
        """The turns' and the KV cache's counters."""
        kv = self.kv
        return {
            "finished": self.num_finished, "aborted": self.num_aborted, "failures": self.num_failed,
            "dropped_results": self.num_dropped_results,
            "kv_free_blocks": kv.num_free_blocks, "kv_total_blocks": kv.alloc.num_blocks,
            "kv_evictions": kv.num_evictions,
            "kv_cached_blocks": kv.num_cached_blocks,
            "prefix_prompt_tokens": kv.num_prompt_tokens,      # prompt tokens of every admitted turn
            "prefix_reused_tokens": kv.num_reused_tokens,      # of those, served from cached KV
            "prefill_tokens": self.num_prefill_tokens,         # prompt tokens computed
            "kv_preemptions": self.num_preemptions,            # decoding rows a full pool sent back (estimate)
            "kv_output_ratio": round(self.ratio, 4),
        }

