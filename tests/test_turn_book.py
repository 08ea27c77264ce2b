"""The engine's turn bookkeeping (engine/turns.TurnBook), synchronously: no event loop runs, no
device; a real KV cache manager, the real planner and sampler. A turn's future belongs to a loop
that is never run (set_result needs none)."""
import asyncio
import random

import pytest
import torch

from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.runtime.runner import BatchPlan
from ainfer_pd.engine.loop.state import Trajectory, Turn, TurnState
from ainfer_pd.engine.loop.turns import TurnBook
from ainfer_pd.errors import SamplingError
from ainfer_pd.metrics.recorder import Recorder
from ainfer_pd.request import SamplingParams
from ainfer_pd.sched.planner import plan_prefill
from tests.conftest import rand_ids, tiny_cfg

BS = 16
PROMPT, NEW = 40, 24             # 64 tokens: 4 blocks of 16 per turn


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


class Book:
    """A TurnBook over a pool of ``num_blocks`` and what it notified."""

    def __init__(self, loop, num_blocks: int = 8) -> None:
        self.cfg = tiny_cfg(**{"cache.num_blocks": num_blocks, "cache.block_size": BS})
        self.kv = KVCacheManager(num_blocks, BS)
        self.notified = 0
        self.book = TurnBook(self.cfg.model, self.cfg.scheduler, Recorder(), self.kv, notify=self._count)
        self.loop = loop
        self.rng = random.Random(0)

    def _count(self) -> None:
        self.notified += 1

    def turn(self, tid: str, *, traj: Trajectory | None = None, **params) -> Turn:
        """A submitted turn of a fresh trajectory ``tid`` (or the next turn of ``traj``)."""
        traj = traj or Trajectory(tid)
        p = SamplingParams(**{"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True, **params})
        t = Turn(request_id=f"{tid}.{traj.num_turns}", traj=traj, params=p, context=traj.tokens + rand_ids(self.rng, PROMPT),
                 prev_tokens=list(traj.tokens), num_cached=0, future=self.loop.create_future(),
                 t_submit=self.book.rec.now())
        traj.turn = t
        traj.num_turns += 1
        self.book.submit(t)
        return t

    def admit(self) -> list[tuple[Turn, int, int]]:
        """What a P epoch planned now would run (its admissions reserved)."""
        b = self.book
        chunks, admitted = plan_prefill(b.pending_view(), self.cfg.scheduler.max_prefill_tokens, b.available_blocks())
        return b.admit(chunks, admitted)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits [R, V] whose greedy pick of row i is tokens[i]."""
        out = torch.full((len(tokens), self.cfg.model.vocab_size), -10.0)
        for i, tok in enumerate(tokens):
            out[i, tok] = 10.0
        return out

    def prefill(self, work, tokens: list[int]) -> None:
        """The P pass over ``work`` completed with first tokens ``tokens`` (one per completed prompt)."""
        done = [t for t, s, n in work if s + n == len(t.context)]
        self.book.finish_prefill(BatchPlan(None, work, [], done), self.logits(tokens))

    def decode(self, rows: list[Turn], tokens: list[int]) -> None:
        self.book.finish_decode(BatchPlan(None, [], rows, rows), self.logits(tokens))


def test_a_small_pool_admits_the_turns_that_fit_and_queues_the_rest(loop):
    b = Book(loop, num_blocks=8)
    a, c, d = b.turn("a"), b.turn("c"), b.turn("d")
    assert b.notified == 3 and list(b.book.waiting) == [a, c, d]
    work = b.admit()
    assert work == [(a, 0, PROMPT), (c, 0, PROMPT)]            # 4 + 4 blocks: d does not fit
    assert a.lifetime and c.lifetime and not d.lifetime
    assert b.kv.num_free_blocks == 0
    b.prefill(work, [7, 9])
    assert (a.state, c.state, d.state) == (TurnState.DECODING, TurnState.DECODING, TurnState.WAITING)
    assert a.out_tokens == [7] and c.out_tokens == [9] and b.book.decoding == [a, c]
    assert list(b.book.waiting) == [d] and not b.book.p_admissible()
    assert b.book.num_prefill_tokens == 2 * PROMPT and len(b.book.rec.samples["ttft_s"]) == 2


def test_aborting_a_turn_frees_its_blocks_and_admits_the_next(loop):
    b = Book(loop, num_blocks=8)
    a, c, d = b.turn("a"), b.turn("c"), b.turn("d")
    b.prefill(b.admit(), [7, 9])
    b.book.abort(a)
    out = a.future.result()
    assert out.finish_reason == "abort" and out.token_ids == [7] and out.num_prompt_tokens == PROMPT
    assert a.state is TurnState.ABORTED and a not in b.book.decoding and a.drained.is_set()
    assert a.traj.turn is None and a.traj.tokens == a.context + [7]        # committed: resumable
    assert b.kv.num_free_blocks == 4 and b.kv.check_no_leak()
    assert b.book.p_admissible()
    assert b.admit() == [(d, 0, PROMPT)] and b.kv.num_free_blocks == 0
    assert b.book.metrics()["aborted"] == 1


def test_an_abort_with_device_work_in_flight_frees_the_blocks_once_drained(loop):
    b = Book(loop, num_blocks=8)
    a = b.turn("a")
    work = b.admit()
    a.in_flight += 1                                   # the P pass is still on the device
    b.book.abort(a, commit=False)
    assert a.future.result().finish_reason == "abort"  # the caller is answered at once
    assert a.state is TurnState.WAITING and a.traj.draining is a and b.kv.num_free_blocks == 4
    a2 = b.turn("a", traj=a.traj)                      # the trajectory's next turn waits for the drain
    assert a2.prev_tokens == [] and b.book.behind_drain(a2) and b.book.pending_view() == []
    b.prefill(work, [7])                               # the pass completes: its result is not used
    assert a.out_tokens == [] and a2.state is TurnState.WAITING
    a.in_flight -= 1
    b.book.drain_cleanups()
    assert a.state is TurnState.ABORTED and a.traj.draining is None and b.kv.num_free_blocks == 8
    assert not b.book.behind_drain(a2) and [p.request_id for p in b.book.pending_view()] == [a2.request_id]
    assert b.admit() == [(a2, 0, PROMPT)]


def test_decode_ends_turns_at_a_stop_token_and_at_the_length_limit(loop):
    b = Book(loop, num_blocks=8)
    a = b.turn("a", max_new_tokens=3)
    c = b.turn("c", stop_token_ids=(5,))
    b.prefill(b.admit(), [7, 9])
    b.decode([a, c], [8, 5])
    assert c.state is TurnState.DONE and c.future.result().finish_reason == "stop"
    assert c.future.result().token_ids == [9, 5] and len(c.future.result().logprobs) == 2
    assert b.book.decoding == [a] and c.traj.tokens == c.context + [9, 5] and c.traj.turn is None
    b.decode([a], [6])
    out = a.future.result()
    assert out.finish_reason == "length" and out.token_ids == [7, 8, 6]
    assert b.book.decoding == [] and b.book.num_finished == 2
    assert b.kv.num_free_blocks == 8 and b.kv.check_no_leak()    # what they wrote stays cached, unreferenced
    assert len(b.book.rec.samples["request_latency_s"]) == 2


def test_a_row_the_sampler_cannot_sample_fails_alone_and_frees_its_blocks(loop):
    b = Book(loop, num_blocks=8)
    a, c = b.turn("a"), b.turn("c")
    work = b.admit()
    logits = b.logits([7, 9])
    logits[0] = float("nan")
    b.book.finish_prefill(BatchPlan(None, work, [], [a, c]), logits)
    with pytest.raises(SamplingError, match="a.0"):
        a.future.result()
    assert a.state is TurnState.ABORTED and c.out_tokens == [9] and b.book.decoding == [c]
    assert b.kv.num_free_blocks == 4 and b.kv.check_no_leak()
    m = b.book.metrics()
    assert (m["failures"], m["aborted"], m["finished"]) == (1, 0, 0)


def test_resolve_answers_the_caller_once(loop):
    b = Book(loop)
    a = b.turn("a")
    b.book.resolve(a, "abort")
    b.book.resolve(a, "stop")
    assert a.future.result().finish_reason == "abort" and a.future.result().trajectory_id == "a"


def test_fail_all_ends_every_turn_with_the_error_and_leaves_no_block_held(loop):
    b = Book(loop, num_blocks=8)
    a, c, d = b.turn("a"), b.turn("c"), b.turn("d")
    b.prefill(b.admit(), [7, 9])
    err = SamplingError("the engine stopped")
    b.book.fail_all(err)
    for t in (a, c, d):
        assert t.future.exception() is err and t.state is TurnState.ABORTED
    assert not b.book.waiting and not b.book.decoding
    assert b.kv.num_free_blocks == 8 and b.kv.check_no_leak() and b.book.num_failed == 3
