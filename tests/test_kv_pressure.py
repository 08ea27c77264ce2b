"""Issue 34, item 10: no deadlock under KV pressure with chunked prefill.

An admitted turn's chunks always make progress (a waiting head that does not fit never stops
them), and a prefill chunk is sized from the cache as it is after the step's earlier
admissions (never from a cached-prefix view an earlier admission just evicted). Every wait is
bounded; states are reached by holding streams, not by racing sleeps.
"""
from __future__ import annotations

import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.loop.state import Trajectory, Turn
from ainfer_pd.engine.loop.turns import TurnBook
from ainfer_pd.metrics.recorder import Recorder
from ainfer_pd.sched.planner import PendingPrefill, plan_prefill
from tests.conftest import rand_ids, tiny_cfg
from tests.test_reliability_cases import bounded, hold, release, until

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ====================================================================== the planner (pure)
def test_an_admitted_turns_chunk_runs_behind_a_head_that_does_not_fit():
    """Before: plan_prefill stopped at a waiting head that did not fit, so an admitted turn behind
    it (holding its blocks) never got its next chunk: nothing else could free them."""
    pend = [PendingPrefill("head", 100, False, 50), PendingPrefill("long", 300, True, 0),
            PendingPrefill("after", 10, False, 1)]
    chunks, admitted = plan_prefill(pend, 256, 40)
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("long", 256)]
    assert admitted == ()       # head-of-line still holds for new admissions: "after" waits for "head"


def test_the_planner_is_unchanged_when_the_head_fits():
    pend = [PendingPrefill("a", 100, False, 5), PendingPrefill("b", 300, True, 0), PendingPrefill("c", 10, False, 1)]
    chunks, admitted = plan_prefill(pend, 256, 40)
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("a", 100), ("b", 156)]
    assert admitted == ("a",)


# ====================================================================== the book (synchronous)
@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _turn(book: TurnBook, loop, tid: str, context: list[int], new: int) -> Turn:
    traj = Trajectory(tid)
    p = SamplingParams(max_new_tokens=new, **GREEDY)
    t = Turn(request_id=f"{tid}.0", traj=traj, params=p, context=list(context), prev_tokens=[], num_cached=0,
             future=loop.create_future(), t_submit=book.rec.now())
    traj.turn = t
    traj.num_turns = 1
    book.submit(t)
    return t


def _cache(kv: KVCacheManager, tid: str, tokens: list[int]) -> None:
    """``tokens`` written by an ended turn of ``tid``: full blocks and an adoptable tail, cached."""
    life = kv.reserve(tid, len(tokens), tokens)
    kv.mark_written(tid, life, len(tokens))
    kv.finish_turn(tid, life, len(tokens), 0.0)


def test_a_chunk_is_sized_from_the_cache_after_the_steps_earlier_admissions(loop):
    """The second way into the deadlock: H and X both see the cached tail of an ended turn (40
    tokens: 2 full blocks + 8 in an adoptable tail). H, admitted first in the step, adopts the tail
    (one sequence can); X then reuses only the 2 full blocks. Before: X's chunk was sized from the
    view before H's admission (prompt - 40), so X prefilled only part of its prompt and its
    remainder waited behind the next head. Now it covers X's prompt from what X really reuses."""
    bs, n = 16, 12
    cfg = tiny_cfg(**{"cache.num_blocks": n, "cache.block_size": bs})
    kv = KVCacheManager(n, bs)
    book = TurnBook(cfg.model, cfg.scheduler, Recorder(), kv)
    rng = random.Random(4)
    base = rand_ids(rng, 40)
    _cache(kv, "old", base)
    assert kv.num_cached_blocks == 3
    h = _turn(book, loop, "H", base + rand_ids(rng, 20), 4)
    x = _turn(book, loop, "X", base + rand_ids(rng, 5), 2)
    pend = book.pending_view()
    assert [(p.request_id, p.remaining_tokens) for p in pend] == [("H.0", 20), ("X.0", 5)]
    chunks, admitted = plan_prefill(pend, 2048, book.available_blocks())
    assert admitted == ("H.0", "X.0")
    work = book.admit(chunks, admitted, 2048)      # the step's budget, as the engines pass it
    got = {t.request_id: (s, k) for t, s, k in work}
    assert got["H.0"] == (40, 20) and h.num_cached == 40
    assert x.num_cached == 32                          # the tail went to H
    s, k = got["X.0"]
    assert (s, k) == (32, 13), f"X's chunk ({s}, {k}) stops short of its prompt ({len(x.context)})"
    assert kv.check_no_leak()


def test_an_admitted_remainder_is_not_stuck_behind_a_head_that_does_not_fit(loop):
    """The state either way leads to: an admitted turn with prompt left to prefill, behind a
    waiting head that does not fit. Its chunks run; once it ended its blocks go back and the head
    is admitted: no leak, nothing stuck."""
    bs, n = 16, 12
    cfg = tiny_cfg(**{"cache.num_blocks": n, "cache.block_size": bs, "scheduler.max_prefill_tokens": 32})
    kv = KVCacheManager(n, bs)
    book = TurnBook(cfg.model, cfg.scheduler, Recorder(), kv)
    rng = random.Random(5)
    long = _turn(book, loop, "L", rand_ids(rng, 100), 4)        # 7 blocks, prefilled in 4 chunks
    chunks, admitted = plan_prefill(book.pending_view(), 32, book.available_blocks())
    work = book.admit(chunks, admitted)
    assert [(t.request_id, s, k) for t, s, k in work] == [("L.0", 0, 32)]
    book.finish_prefill(_plan(work, []), _logits(cfg, []))
    head = _turn(book, loop, "A", rand_ids(rng, 80), 16)         # 6 blocks: not while L holds 7
    book.waiting.rotate(1)                                        # A ahead of L (as a drained turn is)
    assert [t.request_id for t in book.waiting] == ["A.0", "L.0"]
    seen = []
    for _ in range(10):
        chunks, admitted = plan_prefill(book.pending_view(), 32, book.available_blocks())
        work = book.admit(chunks, admitted)
        if not work:
            break
        seen.append([(t.request_id, s, k) for t, s, k in work])
        done = [t for t, s, k in work if s + k == len(t.context)]
        book.finish_prefill(_plan(work, done), _logits(cfg, [7] * len(done)))
        while long in book.decoding:
            book.finish_decode(_plan([], [long]), _logits(cfg, [7]))
        if head in book.decoding:
            break
    assert seen[:3] == [[("L.0", 32, 32)], [("L.0", 64, 32)], [("L.0", 96, 4)]]
    assert long.future.done() and long.future.result().finish_reason == "length"
    assert head in book.decoding and kv.check_no_leak()
    book.close()
    assert kv.check_no_leak() and not kv.trajectories


def _plan(prefill, rows):
    from ainfer_pd.engine.runtime.runner import BatchPlan
    done = [t for t, s, k in prefill if s + k == len(t.context)]
    return BatchPlan(None, prefill, rows, done if prefill else rows)


def _logits(cfg, tokens):
    import torch
    out = torch.full((len(tokens), cfg.model.vocab_size), -10.0)
    for i, tok in enumerate(tokens):
        out[i, tok] = 10.0
    return out


# ====================================================================== the worker (end to end)
async def test_a_chunked_prompt_admitted_during_a_drain_finishes_when_the_drained_turn_does_not_fit():
    """The issue's reproduction on the tiny config (150 blocks, policy normal): A's aborted turn
    drains (its D iteration is held); A's next turn B is queued behind the drain; a long prompt L
    (prefilled in chunks) is admitted meanwhile and takes most of the pool. The drain ends, B is
    back at the head and does not fit beside L. Before: L's remaining chunks never ran, nothing
    decoded, every request waited forever. Now: L finishes, then B, with no block left behind."""
    cfg = tiny_cfg(**{"cache.num_blocks": 150, "scheduler.policy": "normal",
                      "scheduler.max_prefill_tokens": 256})
    rng = random.Random(10)
    async with RolloutWorker(cfg) as w:
        eng = w.engine
        a_task = asyncio.ensure_future(w.generate(rand_ids(rng, 600), SamplingParams(max_new_tokens=40, **GREEDY),
                                                  trajectory_id="A"))
        await until(lambda: "A" in w.trajectories and w.trajectories["A"].turn is not None
                    and len(w.trajectories["A"].turn.out_tokens) >= 2, "A decodes")
        d_hold = hold(w, "D")
        p_hold = []
        try:
            # A's iteration parked behind the hold (one launched before it completes, and its drain
            # would end before L arrives: then B, admitted, runs into the P hold and L never comes)
            await until(lambda: d_hold[0].reached.done() and eng.d.last is not None
                        and not eng.d.last.enqueued().done() and w.trajectories["A"].turn is not None
                        and w.trajectories["A"].turn.in_flight > 0, "A's D iteration parked behind the hold")
            assert await w.abort("A") is True
            assert (await bounded(a_task, "the aborted turn")).finish_reason == "abort"
            assert w.trajectories["A"].draining is not None
            b_task = asyncio.ensure_future(w.continue_("A", rand_ids(rng, 100), SamplingParams(max_new_tokens=8, **GREEDY)))
            await until(lambda: any(t.tid == "A" for t in eng.book.waiting), "B queued behind the drain")
            p_hold = hold(w, "P")
            l_task = asyncio.ensure_future(w.generate(rand_ids(rng, 1700), SamplingParams(max_new_tokens=8, **GREEDY),
                                                      trajectory_id="L"))
            await until(lambda: "L" in w.trajectories and w.trajectories["L"].turn is not None
                        and w.trajectories["L"].turn.lifetime and w.trajectories["L"].turn.in_flight > 0,
                        "L admitted, its first chunk submitted")
            release(d_hold)
            await until(lambda: w.trajectories["A"].draining is None, "the drain ends")
            b = next(t for t in eng.book.waiting if t.tid == "A")
            from ainfer_pd.engine.kv import prefix
            assert prefix.demand(eng.kv, b, eng.book.reserve, eng.book.ratio) > eng.kv.pool_blocks(), "B must not fit beside L for the repro"
        finally:
            release(d_hold)
            release(p_hold)
        out_l = await bounded(l_task, "L (chunked, admitted during the drain)")
        out_b = await bounded(b_task, "B (after L)")
        assert out_l.finish_reason == "length" and len(out_l.token_ids) == 8
        assert out_b.finish_reason == "length" and len(out_b.token_ids) == 8
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and eng.kv.num_free_blocks == 150


# ====================================================================== random storms
def _book_storm(seed: int, loop, *, num_blocks: int = 12, budget: int = 2048, steps: int = 3000) -> None:
    """Random short prompts, continuations of ended turns (their tails adoptable), GRPO-like
    siblings and aborts on a 12-block pool, driven through the real planner and book: every
    step either runs prefill or decode, or nothing is left; every turn ends; no block leaks."""
    bs = 16
    cfg = tiny_cfg(**{"cache.num_blocks": num_blocks, "cache.block_size": bs,
                      "scheduler.max_prefill_tokens": budget})
    kv = KVCacheManager(num_blocks, bs)
    book = TurnBook(cfg.model, cfg.scheduler, Recorder(), kv)
    rng = random.Random(seed)
    trajs: list[Trajectory] = []
    bases = [rand_ids(rng, 40) for _ in range(3)]
    turns: list[Turn] = []
    n_submit = 0

    def submit() -> None:
        nonlocal n_submit
        idle = [tr for tr in trajs if tr.turn is None and len(tr.tokens) < 100]   # draining ones too
        ended = [tr for tr in trajs if tr.tokens and len(tr.tokens) < 100]
        if ended and rng.random() < 0.3:
            # forks of an ended turn's whole context (a new request id for it, GRPO-like siblings
            # branching from it): they all count on its adoptable tail, which only one can take
            src = rng.choice(ended).tokens
            traj = Trajectory(f"T{len(trajs)}")
            trajs.append(traj)
            ctx = src + rand_ids(rng, rng.randint(1, 6))
        elif idle and rng.random() < 0.4:
            traj = rng.choice(idle)
            ctx = traj.tokens + rand_ids(rng, rng.randint(1, 20))
        else:
            traj = Trajectory(f"T{len(trajs)}")
            trajs.append(traj)
            base = rng.choice(bases)
            ctx = base[:rng.randint(1, 40)] + rand_ids(rng, rng.randint(0, 30))
        p = SamplingParams(max_new_tokens=rng.randint(1, 40), **GREEDY)
        t = Turn(request_id=f"r{n_submit}", traj=traj, params=p, context=ctx, prev_tokens=list(traj.tokens),
                 num_cached=0, future=loop.create_future(), t_submit=book.rec.now())
        n_submit += 1
        traj.turn = t
        traj.num_turns += 1
        book.submit(t)
        turns.append(t)

    inflight: tuple | None = None            # the pass launched last step: ("P", work) or ("D", rows)

    def complete() -> None:
        nonlocal inflight
        if inflight is None:
            return
        kind, what = inflight
        inflight = None
        if kind == "P":
            for t, _, _ in what:
                t.in_flight -= 1
            book.drain_cleanups()
            done = [t for t, s, k in what if s + k == len(t.context)]
            book.finish_prefill(_plan(what, done), _logits(cfg, [rng.randrange(2, 500) for _ in done]))
        else:
            for t in what:
                t.in_flight -= 1
            book.finish_decode(_plan([], what), _logits(cfg, [rng.randrange(2, 500) for _ in what]))
        book.drain_cleanups()

    for step in range(steps):
        complete()
        if n_submit < 60 and rng.random() < 0.5:
            for _ in range(rng.randint(1, 3)):
                submit()
        live = [t for t in turns if not t.future.done()]
        if live and rng.random() < 0.1:
            book.abort(rng.choice(live))              # maybe with a pass in flight: its trajectory drains
        before = {t.request_id for t in book.waiting if t.lifetime}
        partial = [t for t in book.waiting if t.lifetime and t.remaining_prompt and not t.abort_requested]
        chunks, admitted = plan_prefill(book.pending_view(), budget, book.available_blocks())
        work = book.admit(chunks, admitted, budget)
        # the two expectations, as invariants of every step:
        # an admitted turn with prompt left always gets a chunk (nothing stops it)
        assert not partial or work, f"seed {seed} step {step}: admitted turns {[t.request_id for t in partial]} " \
                                    f"get no chunk (waiting: {[(t.request_id, t.lifetime) for t in book.waiting]})"
        # a newly admitted turn's chunk is sized from the cache after the step's earlier admissions:
        # it runs to the end of its prompt unless the step's budget ran out
        used = sum(k for _, _, k in work)
        for t, s_, k in work:
            if t.request_id not in before:
                assert s_ + k == len(t.context) or used == budget, \
                    f"seed {seed} step {step}: {t.request_id} prefills [{s_}, {s_ + k}) of {len(t.context)} " \
                    f"with {budget - used} of the budget left"
        if work:
            for t, _, _ in work:
                t.in_flight += 1
            inflight = ("P", work)
        elif book.has_live_rows():
            rows = [t for t in book.decoding if not t.abort_requested]
            for t in rows:
                t.in_flight += 1
            inflight = ("D", rows)
        elif n_submit >= 60 and all(t.future.done() for t in turns) and not book.pending_cleanup:
            break
        assert kv.check_no_leak(), kv.audit()
    complete()
    unfinished = [t.request_id for t in turns if not t.future.done()]
    assert not unfinished, f"seed {seed}: stuck after {steps} steps: {unfinished} " \
                           f"(waiting {[(t.request_id, t.lifetime, t.remaining_prompt) for t in book.waiting]})"
    assert not kv.trajectories and kv.num_free_blocks == num_blocks and kv.check_no_leak()


@pytest.fixture
def one_thread():
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny sampler calls: threads only contend
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("budget", [2048, 24])
def test_random_storms_on_a_12_block_pool_never_get_stuck(loop, one_thread, budget):
    for seed in range(40):
        _book_storm(seed, loop, budget=budget)


async def _worker_storm(seed: int, policy: str, max_prefill: int) -> None:
    """Concurrent clients on a 12-block pool: short prompts (GRPO-like siblings of a few bases,
    continuations of their own trajectories), aborts of turns in flight. Every call ends within
    the bound, typed; afterwards no block is held or leaked."""
    from ainfer_pd import AInferPDError
    cfg = tiny_cfg(**{"cache.num_blocks": 12, "scheduler.policy": policy,
                      "scheduler.max_prefill_tokens": max_prefill, "mux.activation_threshold": 1})
    rng = random.Random(seed)
    bases = [rand_ids(rng, 40) for _ in range(2)]
    async with RolloutWorker(cfg) as w:
        async def client(c: int) -> None:
            r = random.Random(seed * 100 + c)
            tid = f"c{c}"
            have = False
            for _ in range(r.randint(2, 5)):
                p = SamplingParams(max_new_tokens=r.randint(1, 48), **GREEDY)
                if have and r.random() < 0.5 and len(w.trajectories[tid].tokens) < 110:
                    call = w.continue_(tid, rand_ids(r, r.randint(1, 12)), p)
                else:
                    if have:
                        await w.release(tid)
                    base = r.choice(bases)
                    call = w.generate(base[:r.randint(4, 40)] + rand_ids(r, r.randint(0, 24)), p, trajectory_id=tid)
                task = asyncio.ensure_future(call)
                if r.random() < 0.3:
                    await asyncio.sleep(r.random() * 0.01)
                    await w.abort(tid)
                try:
                    await task
                except AInferPDError:
                    pass
                have = tid in w.trajectories
        await bounded(asyncio.gather(*(client(c) for c in range(6))), f"storm seed {seed} ({policy})", 30.0)
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 12


@pytest.mark.parametrize("policy,max_prefill", [("normal", 2048), ("normal", 24), ("fine-grained", 24)])
async def test_random_worker_storms_on_a_12_block_pool_finish(policy, max_prefill):
    for seed in range(4):
        await _worker_storm(seed, policy, max_prefill)


def test_fifo_under_pressure_admits_a_continuation_on_retained_kv_before_a_head_that_evicts_it(loop):
    """A first turn H waits at the head and needs more blocks than are free; behind it, C continues
    a context whose KV is cached. With ``short_prefill_tokens`` C goes first and reuses its prefix
    (admitting H first would evict it: C would prefill its whole context again)."""
    bs, n = 16, 12
    for short, first in ((0, "H.0"), (64, "C.0")):
        cfg = tiny_cfg(**{"cache.num_blocks": n, "cache.block_size": bs, "scheduler.short_prefill_tokens": short})
        kv = KVCacheManager(n, bs)
        book = TurnBook(cfg.model, cfg.scheduler, Recorder(), kv)
        rng = random.Random(6)
        ctx = rand_ids(rng, 96)
        _cache(kv, "C", ctx)                                   # 6 blocks cached, 6 free
        _turn(book, loop, "H", rand_ids(rng, 120), 8)          # 8 blocks: evicts 2 of C's if admitted first
        c = _turn(book, loop, "C", ctx + rand_ids(rng, 10), 4)
        pend = book.pending_view()
        assert pend[0].request_id == first, (short, [p.request_id for p in pend])
        chunks, admitted = plan_prefill(pend, 2048, book.available_blocks())
        work = book.admit(chunks, admitted, 2048)
        if short:
            assert admitted[0] == "C.0" and c.num_cached == 96 and [t.request_id for t, _, _ in work][0] == "C.0"
        assert kv.check_no_leak()


def test_cached_blocks_no_waiting_turn_reuses_are_no_pressure(loop):
    """The same queue with 6 more cached blocks that no waiting turn reuses (an ended trajectory's):
    H's admission can take those, so fifo keeps H first."""
    bs, n = 16, 18
    cfg = tiny_cfg(**{"cache.num_blocks": n, "cache.block_size": bs, "scheduler.short_prefill_tokens": 64})
    kv = KVCacheManager(n, bs)
    book = TurnBook(cfg.model, cfg.scheduler, Recorder(), kv)
    rng = random.Random(7)
    _cache(kv, "old", rand_ids(rng, 96))
    ctx = rand_ids(rng, 96)
    _cache(kv, "C", ctx)
    _turn(book, loop, "H", rand_ids(rng, 120), 8)
    _turn(book, loop, "C", ctx + rand_ids(rng, 10), 4)
    assert kv.alloc.num_free == 6 and kv.num_cached_blocks == 12
    assert [p.request_id for p in book.pending_view()] == ["H.0", "C.0"]
