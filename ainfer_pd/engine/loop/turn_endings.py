"""The endings of a :class:`~ainfer_pd.engine.loop.turns.TurnBook`'s turns: abort and its drain,
failure, the caller's :class:`~ainfer_pd.request.TurnOutput`, and the book's close. A mixin of
the book (its state is the book's); every method stays callable on it (``engine.book.abort``...).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from ...request import TurnOutput
from ..model.routed_experts import of_turn
from .state import Turn, TurnState

if TYPE_CHECKING:
    from ...metrics.recorder import Recorder
    from ..kv.kv_cache import KVCacheManager


class TurnEndings:
    """How turns end: abort (partial output, KV cleaned up once drained), failure, close."""

    waiting: deque[Turn]
    decoding: list[Turn]
    kv: "KVCacheManager"
    rec: "Recorder"
    routed: Any
    notify: Callable[[], None]
    pending_cleanup: list[Turn]
    pending_finish: list[Turn]
    num_aborted: int
    num_failed: int

    # ================================================================== aborts
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
        turn.routed_experts = of_turn(self.routed, self.kv, turn)    # before its KV can go
        self.resolve(turn, "abort")
        if turn.traj.turn is turn:             # the trajectory is free for its next turn at once
            turn.traj.turn = None
            turn.traj.tokens = turn.context + turn.out_tokens if commit else turn.prev_tokens
        if turn.in_flight == 0:
            self._cleanup_aborted(turn)
        else:
            # NOTE: only a turn with device work pending drains; a queued turn never submitted
            # any, and must not hide the drain of the turn it waits for.
            turn.traj.draining = turn
            self.pending_cleanup.append(turn)
        self.notify()

    def _cleanup_aborted(self, turn: Turn, *, failed: bool = False) -> None:
        """``failed``: the turn ended with an error (counted in ``failures``, not ``aborted``)."""
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
        self._drained(turn)
        if not failed:
            self.num_aborted += 1

    @staticmethod
    def _drained(turn: Turn) -> None:
        """``turn``'s device work is over and its KV handed back: its trajectory no longer waits on it."""
        if turn.traj.draining is turn:
            turn.traj.draining = None
        turn.drained.set()

    def drain_cleanups(self) -> None:
        """Clean up every aborted turn whose device work has drained since, and give back the KV
        of every ended turn whose last (unused) pass has."""
        still = []
        for t in self.pending_cleanup:
            if t.in_flight == 0:
                f = t.future
                self._cleanup_aborted(t, failed=f.done() and not f.cancelled() and f.exception() is not None)
            else:
                still.append(t)
        self.pending_cleanup = still
        if self.pending_finish:
            ended = [t for t in self.pending_finish if t.in_flight == 0]
            self.pending_finish = [t for t in self.pending_finish if t.in_flight]
            for t in ended:
                self.kv.finish_turn(t.tid, t.lifetime, t.seq_len - 1, self.rec.now())
                self._drained(t)
            if ended:
                self.notify()

    # ================================================================== endings
    def resolve(self, t: Turn, reason: str) -> None:
        """Give ``t``'s caller its :class:`TurnOutput` (once: a later call changes nothing)."""
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

    def fail_turns(self, turns: list[Turn], err: BaseException, *, drained: bool = True) -> None:
        """End ``turns`` with ``err`` (typed) and free their KV: now when their device work has
        drained; with ``drained=False`` (the overlapped D loop's next pass may still feed a
        row) once it has, the trajectory draining meanwhile."""
        for t in turns:
            if t.state in (TurnState.DONE, TurnState.ABORTED):
                continue
            if not t.future.done():
                t.future.set_exception(err)
            self.num_failed += 1
            t.abort_requested = True
            t.commit_on_abort = False        # a failed turn leaves its trajectory as it was
            if drained:
                t.in_flight = 0
            if t.in_flight == 0:
                self._cleanup_aborted(t, failed=True)
                continue
            if t.traj.turn is t:
                t.traj.turn = None
                t.traj.tokens = t.prev_tokens
            t.traj.draining = t
            self.pending_cleanup.append(t)
        self.notify()

    def close(self) -> None:
        """No device work is in flight any more (the loops stopped, the streams were joined):
        every turn still known ends with "abort" and every pending cleanup runs, so no caller,
        drain waiter or KV pin is left behind."""
        for t in self.pending_cleanup:
            t.in_flight = 0
        self.drain_cleanups()
        for t in list(self.waiting) + list(self.decoding):
            t.in_flight = 0
            self.abort(t, "shutdown")

    def fail_all(self, exc: BaseException) -> None:
        """Every turn in flight ends with ``exc`` (typed)."""
        self.fail_turns(list(self.waiting) + list(self.decoding), exc)
