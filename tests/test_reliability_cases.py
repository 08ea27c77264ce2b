"""One named regression test per failure of issue 13 (the second reliability pass), and the
four decisions it asked for. Every wait is bounded; states are reached by holding a stream
(``Stream.hold``) or by fault injection, not by racing sleeps.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ainfer_pd import AInferPDError, RolloutWorker, SamplingParams
from ainfer_pd.engine.loop.d_driver import DDriver
from ainfer_pd.engine.loop import turns as turns_mod
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.engine.model.sampler import SampleRow, sample
from ainfer_pd.errors import (CapacityError, InvalidRequestError, SamplingError, TrajectoryBusyError,
                              UnknownTrajectoryError, WeightUpdateError, WorkerClosedError, WrongEventLoopError)
from ainfer_pd.request import MIN_TEMPERATURE
from ainfer_pd.sched.planner import PendingPrefill, fits, plan_prefill
from ainfer_pd.turnstile.rendezvous import LocalRendezvous
from ainfer_pd.turnstile.turnstile import Turnstile
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
POLICIES = ("normal", "global-complete", "global-enqueue", "fine-grained", "mixed-chunked")
BOUND_S = 20.0


async def bounded(aw, what: str, timeout_s: float = BOUND_S):
    try:
        async with asyncio.timeout(timeout_s):
            return await aw
    except TimeoutError:
        raise AssertionError(f"{what} did not finish within {timeout_s:g} s") from None


async def until(pred, what: str, timeout_s: float = BOUND_S) -> None:
    """Poll ``pred`` (a state of the engine, not a time) with a bound."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s")
        await asyncio.sleep(0.001)


def hold(w, *names):
    """Park the named streams at a FIFO point (work submitted later waits there)."""
    return [w.engine.device.streams[n].hold("test") for n in names]


def release(holds) -> None:
    for h in holds:
        h.release()


def idle_and_clean(w) -> bool:
    return w.kv_leak_free() and all(not kv.pinned for kv in w.engine.kv.trajectories.values())


@contextlib.asynccontextmanager
async def draining(w, tid: str, n: int = 60):
    """A trajectory whose aborted turn still has P work in flight (the P stream is held).
    Yields the release function; the hold is released on the way out whatever happens (a
    test that fails inside must not leave a parked stream for the worker's exit to join)."""
    holds = hold(w, "P")
    try:
        task = asyncio.ensure_future(w.generate(rand_ids(random.Random(n), n), SamplingParams(max_new_tokens=4, **GREEDY),
                                                trajectory_id=tid))
        await until(lambda: tid in w.trajectories and w.trajectories[tid].turn is not None
                    and w.trajectories[tid].turn.in_flight > 0, "the turn's P epoch started")
        assert await w.abort(tid) is True
        assert (await bounded(task, "the aborted turn")).finish_reason == "abort"
        assert w.trajectories[tid].draining is not None
        yield lambda: release(holds)
    finally:
        release(holds)


# ====================================================================== case 1
@pytest.mark.parametrize("policy", POLICIES)
async def test_case01_a_prompt_that_fits_only_by_reusing_the_trajectorys_own_blocks_is_admitted(policy):
    """generate(prompt, trajectory_id=existing) with a prompt that does not extend the retained
    tokens and fits only if the trajectory's own retained blocks are reused: admitted (before:
    never, and it blocked every later request; mixed-chunked spun a core)."""
    cfg = tiny_cfg(**{"scheduler.policy": policy, "cache.num_blocks": 12})
    rng = random.Random(1)
    async with RolloutWorker(cfg) as w:
        a = await bounded(w.generate(rand_ids(rng, 150), SamplingParams(max_new_tokens=8, **GREEDY), trajectory_id="A"),
                          "first turn")
        # idle: A holds no block, its 10 blocks are cached content (evictable), 2 are free
        kv = w.engine.kv
        assert "A" not in kv.trajectories and kv.num_cached_blocks == 10 and kv.alloc.num_free == 2
        prompt = rand_ids(rng, 150)               # 10 blocks: only with A's own 10
        behind = asyncio.ensure_future(w.generate(rand_ids(rng, 10), SamplingParams(max_new_tokens=2, **GREEDY)))
        out = await bounded(w.generate(prompt, SamplingParams(max_new_tokens=8, **GREEDY), trajectory_id="A"),
                            "generate replacing A's context")
        assert out.finish_reason == "length" and out.num_cached_tokens == 0
        assert out.token_ids == recompute_greedy(w.model, cfg, prompt, 8)[0]
        assert (await bounded(behind, "the request behind it")).finish_reason == "length"
        assert w.trajectories["A"].tokens == prompt + out.token_ids != a.token_ids
        for tid in list(w.trajectories):
            await w.release(tid)
        assert idle_and_clean(w) and w.engine.kv.num_free_blocks == 12


_FAMILIES = [[(7 * f + 3 * i) % 500 + 2 for i in range(200)] for f in range(3)]
_seq = st.tuples(st.integers(0, 2), st.integers(1, 120), st.integers(0, 3), st.booleans(), st.integers(0, 200))
_kv_states = st.lists(_seq, min_size=0, max_size=6)


def _tokens(family: int, n: int, fork: int) -> list[int]:
    """Prompts of three families; ``fork`` > 0 changes the token at 16 * fork (siblings that share
    a prefix of ``fork`` blocks, then diverge)."""
    t = list(_FAMILIES[family][:n])
    if fork and 16 * fork < n:
        t[16 * fork] = 1
    return t


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(state=_kv_states, last=_seq)
def test_case01_the_planner_and_the_reservation_apply_one_admission_rule(state, last):
    """For any cache state, shared prefixes included (issue 15): ``fits(admission_demand,
    pool_blocks)`` (what the planner and the engine's admission both ask) holds exactly when
    ``reserve`` succeeds; accounting stays consistent."""
    kv = KVCacheManager(num_blocks=16, block_size=16)
    for i, (fam, n, fork, pinned, extra) in enumerate(state):
        toks = _tokens(fam, n, fork)
        total = n + extra
        if not fits(kv.admission_demand(f"t{i}", total, toks), kv.pool_blocks()):
            continue
        kv.reserve(f"t{i}", total, toks, now=float(i))
        lt = kv.trajectories[f"t{i}"].lifetime
        kv.mark_written(f"t{i}", lt, n)
        if not pinned:
            kv.finish_turn(f"t{i}", lt, n, now=float(i))
        assert kv.check_no_leak(), kv.audit()
    fam, n, fork, _, extra = last
    toks, total = _tokens(fam, n, fork), n + extra
    demand, pool = kv.admission_demand("new", total, toks), kv.pool_blocks()
    planned, _ = plan_prefill([PendingPrefill("r", n, False, demand)], 10_000, pool)
    assert bool(planned) == fits(demand, pool)
    try:
        kv.reserve("new", total, toks, now=100.0)
        reserved = True
    except CapacityError:
        reserved = False
    assert reserved == fits(demand, pool), (state, last, demand, pool)
    assert kv.check_no_leak(), kv.audit()


# ====================================================================== case 2
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("how", ["abort", "cancel", "release", "abort_all", "sleep"])
async def test_case02_the_last_decode_row_leaving_mid_epoch_opens_the_gate(how, overlap):
    """fine-grained: the last live decode row is aborted / cancelled / released (or abort_all,
    sleep) while a gated P epoch runs: the turnstile opens the epoch's gate and P finishes at
    once (before: P waited for a permit for the whole rendezvous timeout, 30 s, then it and
    later prefills failed with TurnstileTimeout). The receive counts are slowed down so the
    interruption lands while P is between boundaries and D waits for its next round. Both D loops:
    the overlapped one waits for its next round with the iteration before it still in flight."""
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "mux.activation_threshold": 1, "mux.span": "1",
                      "scheduler.overlap_decode": overlap, "faults": {"slow_counts_ms": 150.0}})
    rng = random.Random(2)
    async with RolloutWorker(cfg) as w:
        d = asyncio.ensure_future(w.generate(rand_ids(rng, 20), SamplingParams(max_new_tokens=4000 - 20, **GREEDY),
                                             trajectory_id="D"))
        await until(lambda: w.engine.book.decoding, "D decoding")
        p_prompt = rand_ids(rng, 300)
        p = asyncio.ensure_future(w.generate(p_prompt, SamplingParams(max_new_tokens=3, **GREEDY), trajectory_id="P"))
        ts, ctl = w.engine.turnstile, w.engine.turnstile.controller
        # D waits for P's next boundary (its iteration is done, P is between boundaries, in the
        # slowed counts wait): the window in which a vanishing last row left P without permits
        await until(lambda: ts.gated_epoch_active and ts.rounds >= 2 and (overlap or not w.engine.d.in_flight)
                    and ctl.epoch is not None and ctl.reached < ctl.permit, "D waiting for P's next boundary")
        t0 = time.monotonic()
        if how == "abort":
            assert await w.abort("D")
        elif how == "cancel":
            d.cancel()
        elif how == "release":
            await bounded(w.release("D"), "release")
        elif how == "abort_all":
            assert await w.abort_all() == 2
        else:
            sleeping = asyncio.ensure_future(w.sleep())
        if how in ("abort_all", "sleep"):
            out = await bounded(p, "the prefill")
            assert out.finish_reason == "abort"
            if how == "sleep":
                await bounded(sleeping, "sleep")
            p_prompt = rand_ids(rng, 300)            # an unrelated prefill after it
            out = await bounded(w.generate(p_prompt, SamplingParams(max_new_tokens=3, **GREEDY)), "a later prefill")
        else:
            out = await bounded(p, "the prefill")
        took = time.monotonic() - t0
        assert out.finish_reason == "length" and out.token_ids == recompute_greedy(w.model, cfg, p_prompt, 3)[0]
        assert took < cfg.parallel.rendezvous_timeout_s / 3, took
        try:
            await d
        except asyncio.CancelledError:
            pass
        for tid in list(w.trajectories):
            await w.release(tid)
        assert idle_and_clean(w)


async def test_case02_turnstile_open_gate_releases_a_waiting_permit_and_ends_the_epochs_rounds():
    """The turnstile's defined behaviour when D empties mid-epoch: ``open_gate`` lets a P that
    waits for a permit pass at once, and D owes the epoch no further round."""
    ts = Turnstile(rendezvous=LocalRendezvous(), span=lambda _i: 1, timeout_s=5.0)
    async with ts.epoch(1, gated=True, d_enqueued=False) as ep:
        waiting = asyncio.ensure_future(ep.permit(0))     # publishes boundary 0 and waits (p = 0)
        rnd = await bounded(ts.before_decode(), "D round 1")
        assert rnd is not None and (rnd.boundary, rnd.permit) == (0, 0)
        await ts.after_decode(rnd)                  # one round: permit 0 -> 1
        await bounded(waiting, "permit 0")
        ep.publish(1)
        blocked = asyncio.ensure_future(ep.permit(1))
        await asyncio.sleep(0.01)
        assert not blocked.done()                   # at the endpoint: waits for a D round
        ts.open_gate()                              # D has no rows any more
        await bounded(blocked, "the permit after open_gate", 1.0)
        assert not ts.gated_epoch_active and await ts.before_decode() is None
        ep.publish(5, final=True)
        await ep.permit(5)


# ====================================================================== cases 3 and 4
async def test_case03_abort_ends_a_turn_queued_behind_a_drain():
    """abort(tid) while a continue_(tid) waits for the previous aborted turn to drain: the
    queued turn ends with "abort" (before: abort returned True and the continue_ ran)."""
    async with RolloutWorker(tiny_cfg()) as w:
        async with draining(w, "A"):
            queued = asyncio.ensure_future(w.continue_("A", [5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY)))
            await until(lambda: w.trajectories["A"].turn is not None, "the continue_ is queued")
            assert w.trajectories["A"].turn.lifetime == 0          # not admitted: behind the drain
            assert await w.abort("A") is True
            out = await bounded(queued, "the queued continue_", 2.0)
            assert out.finish_reason == "abort" and out.token_ids == []
        await until(lambda: w.trajectories["A"].draining is None, "the drain")
        # issue 15 (partial rollout): an aborted turn commits its prompt and what it produced (here
        # nothing) to the trajectory: the first turn's 60-token prompt, then the queued [5, 6, 7]
        assert w.trajectories["A"].turn is None
        assert w.trajectories["A"].tokens == rand_ids(random.Random(60), 60) + [5, 6, 7]
        await w.release("A")
        assert idle_and_clean(w) and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


async def test_case04_leaving_async_with_ends_a_turn_queued_behind_a_drain():
    """Leaving ``async with`` while a continue_ waits for a drain: the continue_ ends with
    "abort" (before: it was submitted into the stopped engine and never resolved)."""
    w = RolloutWorker(tiny_cfg())
    async with w:
        async with draining(w, "A") as release_hold:
            queued = asyncio.ensure_future(w.continue_("A", [5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY)))
            await until(lambda: w.trajectories["A"].turn is not None, "the continue_ is queued")
            release_hold()                           # the drain completes while the worker closes
    out = await bounded(queued, "the queued continue_ after exit", 5.0)
    assert out.finish_reason == "abort"
    assert not [t for t in threading.enumerate() if t.name.startswith(("ainfer-P", "ainfer-D"))]


async def test_decide_release_during_the_drain_window_aborts_the_queued_turn():
    """Decision: release(tid) while a turn of it waits for a drain aborts that turn (its caller
    gets "abort"), waits for the drain and forgets the trajectory (before: TrajectoryBusyError,
    though the docstring said it aborts the turn first)."""
    async with RolloutWorker(tiny_cfg()) as w:
        async with draining(w, "A") as release_hold:
            queued = asyncio.ensure_future(w.continue_("A", [5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY)))
            await until(lambda: w.trajectories["A"].turn is not None, "the continue_ is queued")
            releasing = asyncio.ensure_future(w.release("A"))
            out = await bounded(queued, "the queued continue_", 2.0)
            assert out.finish_reason == "abort"
            await asyncio.sleep(0)
            with pytest.raises(UnknownTrajectoryError):       # being released: no new turn
                await w.continue_("A", [8], SamplingParams(max_new_tokens=2))
            with pytest.raises(TrajectoryBusyError):
                await w.generate([8, 9], SamplingParams(max_new_tokens=2), trajectory_id="A")
            assert not releasing.done()                        # it waits for the drain
            release_hold()
            await bounded(releasing, "release")
        assert "A" not in w.trajectories and idle_and_clean(w)
        assert w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


# ====================================================================== case 5
@pytest.mark.parametrize("t", [1e-45, 1.2e-38, 1e-30, 1e-8, MIN_TEMPERATURE / 2])
def test_case05_temperatures_below_the_floor_are_rejected(t):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=t)
    for p in (1e-45, 1e-3, 1e3, 1e300):
        with pytest.raises(InvalidRequestError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=p)


def test_case05_the_sampler_isolates_a_row_that_is_not_a_distribution():
    V = 32
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    logits[1] = math.nan
    logits[2, 3] = math.inf
    rows = [SampleRow(SamplingParams(temperature=0.0))] * 4
    toks, lps, bad = sample(logits, rows)                       # the vectorised greedy path
    assert set(bad) == {1, 2} and toks[0] == int(logits[0].argmax()) and toks[3] == int(logits[3].argmax())
    sampled = SamplingParams(temperature=MIN_TEMPERATURE, top_k=5, top_p=0.9, seed=3)
    rows = [SampleRow(sampled, seed=3) for _ in range(4)]
    toks, lps, bad = sample(logits * 50.0, rows)               # per row, at the temperature floor
    assert set(bad) == {1, 2} and all(math.isfinite(lps[i]) for i in (0, 3))
    assert toks[0] == int(logits[0].argmax())                   # T at the floor: the mode


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("where", ["prefill", "decode"])
async def test_case05_one_request_whose_distribution_is_nan_fails_alone(policy, where, monkeypatch):
    """A request whose logits turn non-finite (in its prefill or later in decode) ends alone
    with SamplingError; greedy requests batched with it finish and equal a recompute, the
    worker keeps serving and leaves ``async with`` cleanly (before: the whole P epoch failed;
    in decode or under mixed-chunked the engine died and an ExceptionGroup came out). The plain
    D loop; P's head item and D's item sample on their streams (``sample_on_device``), the
    mixed-chunked loop through ``turns.sample`` (tests/test_overlap_decode.py has the overlapped
    loop's NaN case)."""
    from ainfer_pd.engine.loop import d_overlap, p_walk
    cfg = tiny_cfg(**{"scheduler.policy": policy, "scheduler.overlap_decode": False})
    steps = {"n": 0}

    def poisoned(real):
        def run(logits, rows, **kw):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.seed == 4242:
                    steps["n"] += 1
                    if where == "prefill" or steps["n"] > 3:
                        logits[i] = math.nan
            return real(logits, rows, **kw)
        return run

    monkeypatch.setattr(turns_mod, "sample", poisoned(turns_mod.sample))
    for mod in (d_overlap, p_walk):
        monkeypatch.setattr(mod, "sample_on_device", poisoned(mod.sample_on_device))
    rng = random.Random(5)
    async with RolloutWorker(cfg) as w:
        prompts = [rand_ids(rng, 30) for _ in range(3)]
        bad = asyncio.ensure_future(w.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=12, temperature=0.7,
                                                                                 seed=4242, ignore_eos=True)))
        good = [asyncio.ensure_future(w.generate(p, SamplingParams(max_new_tokens=12, **GREEDY))) for p in prompts]
        with pytest.raises(SamplingError):
            await bounded(bad, "the poisoned request")
        for p, g in zip(prompts, good):
            out = await bounded(g, "a bystander")
            assert out.finish_reason == "length" and out.token_ids == recompute_greedy(w.model, cfg, p, 12)[0]
        after = await bounded(w.generate(prompts[0], SamplingParams(max_new_tokens=4, **GREEDY)), "a later request")
        assert after.finish_reason == "length"
        assert w.metrics()["failures"] == 1
        for tid in list(w.trajectories):
            await w.release(tid)
        assert idle_and_clean(w) and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


async def test_case05_the_temperature_floor_samples_without_nan_next_to_greedy_rows(worker):
    rng = random.Random(6)
    outs = await bounded(asyncio.gather(*(
        worker.generate(rand_ids(rng, 20), SamplingParams(max_new_tokens=16, temperature=t, seed=s, ignore_eos=True))
        for t, s in ((MIN_TEMPERATURE, 1), (0.0, None), (MIN_TEMPERATURE, 2), (1.0, 3)))), "sampling")
    for o in outs:
        assert o.finish_reason == "length" and all(math.isfinite(lp) for lp in o.logprobs)


# ====================================================================== case 6
async def test_case06_two_concurrent_releases_one_succeeds_the_other_is_unknown(worker):
    task = asyncio.ensure_future(worker.generate(rand_ids(random.Random(7), 40),
                                                 SamplingParams(max_new_tokens=200, **GREEDY), trajectory_id="R"))
    await until(lambda: worker.engine.book.decoding, "decoding")
    res = await bounded(asyncio.gather(worker.release("R"), worker.release("R"), return_exceptions=True), "releases")
    assert res.count(None) == 1 and sum(isinstance(r, UnknownTrajectoryError) for r in res) == 1, res
    assert (await task).finish_reason == "abort"
    assert "R" not in worker.trajectories and idle_and_clean(worker)


# ====================================================================== case 7
async def test_case07_malformed_weight_updates_raise_weight_update_error_and_write_nothing(worker, cfg):
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    name, p = next(iter(worker.model.named_parameters()))
    bad_inputs = [
        [(name, p.detach().clone(), "extra")],                 # a 3-tuple
        [(name,)], [name], [(3, p.detach().clone())],           # not a pair, a bare name, a non-str name
        [(name, torch.empty(p.shape, device="meta"))],          # no values
        [(name, p.detach().clone().to_sparse())],               # sparse
        [(name, p.detach().tolist())],                          # not a tensor
        "weights", p.detach().clone(), 42, None,                # not an iterable of pairs at all
        {name: torch.zeros(3)},                                  # a mapping with a wrong shape
    ]
    for arg in bad_inputs:
        with pytest.raises(WeightUpdateError):
            await bounded(worker.update_weights(arg), f"update_weights({type(arg).__name__})")
    for n, t in worker.model.named_parameters():
        assert torch.equal(t, before[n]), n
    new = build_model(dataclasses.replace(cfg.model, seed=99))
    sd = {k: v for k, v in new.state_dict().items() if k in before}
    assert await worker.update_weights(sd) == len(sd)           # a state_dict (mapping) is accepted
    for n, t in worker.model.named_parameters():
        if n in sd:
            assert torch.equal(t, sd[n])


# ====================================================================== case 8
async def test_case08_seed_range_and_stop_token_ids_none(worker):
    for s in (2 ** 64, -1, 2 ** 70):
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(seed=s)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[np.int64(5)]).stop_token_ids == (5,)
    for bad in ("ab", 5, {1: 2}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(stop_token_ids=bad)
    sp = SamplingParams(max_new_tokens=2, temperature=1.0, seed=2 ** 64 - 1)
    out = await bounded(worker.generate([3, 4, 5], sp, trajectory_id="edge"), "largest seed")
    assert out.finish_reason in ("length", "stop")
    object.__setattr__(sp, "seed", 2 ** 64)                    # a caller that bypassed validation
    with pytest.raises(InvalidRequestError, match="seed"):
        await worker.generate([3, 4, 5], sp, trajectory_id="never-registered")
    assert "never-registered" not in worker.trajectories


# ====================================================================== case 9
async def test_case09_a_call_from_another_threads_loop_raises_wrong_event_loop_error(worker):
    def other_thread():
        async def go():
            out = {}
            for name, call in [("generate", lambda: worker.generate([3, 4], SamplingParams(max_new_tokens=2))),
                               ("abort_all", worker.abort_all), ("sleep", worker.sleep),
                               ("update_weights", lambda: worker.update_weights([]))]:
                try:
                    async with asyncio.timeout(2.0):
                        await call()
                    out[name] = "accepted"
                except TimeoutError:
                    out[name] = "hang"
                except BaseException as exc:      # noqa: BLE001
                    out[name] = exc
            try:
                worker.metrics()
                out["metrics"] = "accepted"
            except BaseException as exc:          # noqa: BLE001
                out["metrics"] = exc
            return out
        return asyncio.run(go())

    res = await bounded(asyncio.to_thread(other_thread), "calls from another thread")
    assert all(isinstance(v, WrongEventLoopError) for v in res.values()), res
    out = await worker.generate([3, 4], SamplingParams(max_new_tokens=2, **GREEDY))   # still serving
    assert out.finish_reason == "length"


def test_case09_a_later_asyncio_run_raises_wrong_event_loop_error():
    w = RolloutWorker(tiny_cfg())
    try:
        asyncio.run(w.__aenter__())            # entered on a loop that then ends

        async def later():
            async with asyncio.timeout(2.0):
                return await w.generate([3, 4], SamplingParams(max_new_tokens=2))
        with pytest.raises(WrongEventLoopError):
            asyncio.run(later())
    finally:
        w.engine.shutdown()


# ====================================================================== case 10
async def test_case10_the_users_own_exception_leaves_async_with_unchanged():
    with pytest.raises(KeyError) as ei:
        async with RolloutWorker(tiny_cfg()) as w:
            asyncio.ensure_future(w.generate([3, 4, 5], SamplingParams(max_new_tokens=50, **GREEDY)))
            await asyncio.sleep(0.01)
            raise KeyError("mine")
    assert type(ei.value) is KeyError and ei.value.args == ("mine",)
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.05):
            async with RolloutWorker(tiny_cfg()):
                await asyncio.sleep(10)           # the user's own cancellation (a timeout) passes through


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
async def test_case10_an_engine_failure_is_typed_for_waiters_and_at_exit(overlap, monkeypatch):
    """The engine itself fails (the D launch both loops share raises): waiters get
    WorkerClosedError, the user's task is not cancelled, and leaving ``async with`` raises a typed
    error (not an ExceptionGroup)."""
    async def broken(self, *a, **k):
        raise RuntimeError("decode exploded")
    monkeypatch.setattr(DDriver, "_launch", broken)
    with pytest.raises(WorkerClosedError, match="decode exploded"):
        async with RolloutWorker(tiny_cfg(**{"scheduler.overlap_decode": overlap})) as w:
            with pytest.raises(WorkerClosedError):
                await bounded(w.generate([3, 4, 5], SamplingParams(max_new_tokens=5, **GREEDY)), "generate")
            await asyncio.sleep(0.01)              # the user's task goes on (not cancelled)
            with pytest.raises(WorkerClosedError):
                await w.generate([3, 4, 5], SamplingParams(max_new_tokens=5))


class _StartFailed(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["stream_item", "after_stream_item"])
def test_a_failed_engine_start_leaves_no_stream_thread(where, monkeypatch):
    """Engine start fails after its stream threads started (here: the speculator's verify cost
    table is measured on the D stream; the failure is that item itself, or a later host step):
    the original error propagates and no stream thread is left (before: they were never joined,
    and the process could not exit)."""
    from ainfer_pd.engine import engine as engine_mod
    from ainfer_pd.engine.runtime import verify_costs
    seen = []

    def failing(*a, **k):
        seen.extend(t.name for t in threading.enumerate() if t.name.startswith("ainfer-"))
        raise _StartFailed(f"injected at {where}")
    if where == "stream_item":
        monkeypatch.setattr(verify_costs, "measure_verify_costs", failing)
    else:
        monkeypatch.setattr(engine_mod, "DDriver", failing)
    before = set(threading.enumerate())
    cfg = tiny_cfg(**{"spec.method": "suffix", "spec.num_draft_tokens": 2, "scheduler.max_decode_batch": 4,
                      "model.num_layers": 1})
    with pytest.raises(_StartFailed, match=f"injected at {where}"):
        RolloutWorker(cfg)
    assert any(n.startswith("ainfer-D") for n in seen), seen       # the D stream's thread had started
    left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("ainfer-")]
    assert not left, f"stream threads left behind by the failed start: {left}"


# ====================================================================== case 11
async def test_case11_sleep_aborts_a_turn_started_while_it_waits_for_a_drain():
    """sleep() waits for an aborted turn to drain; a turn started meanwhile is aborted too
    (before: it was admitted, then sleep freed its KV and it failed with EpochFailedError)."""
    async with RolloutWorker(tiny_cfg()) as w:
        async with draining(w, "A") as release_hold:
            sleeping = asyncio.ensure_future(w.sleep())
            await asyncio.sleep(0)
            b = asyncio.ensure_future(w.generate(rand_ids(random.Random(8), 50),
                                                 SamplingParams(max_new_tokens=4, **GREEDY), trajectory_id="B"))
            await until(lambda: "B" in w.trajectories, "B submitted")
            release_hold()
            await bounded(sleeping, "sleep")
            out = await bounded(b, "B")
        assert out.finish_reason == "abort"
        assert w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks and idle_and_clean(w)
        await w.wake_up()
        again = await bounded(w.continue_("B", [9], SamplingParams(max_new_tokens=3, **GREEDY)), "after wake_up")
        assert again.finish_reason == "length"
        for tid in list(w.trajectories):
            await w.release(tid)


# ====================================================================== the other decisions
@pytest.mark.parametrize("given_as", ["list", "tuple", "range", "torch_int64", "torch_int32", "numpy_int64",
                                      "numpy_uint16", "numpy_scalars"])
async def test_decide_token_ids_are_sequences_or_1d_integer_arrays_torch_and_numpy_alike(worker, given_as):
    ids = list(range(3, 23))
    arg = {"list": ids, "tuple": tuple(ids), "range": range(3, 23), "torch_int64": torch.tensor(ids),
           "torch_int32": torch.tensor(ids, dtype=torch.int32), "numpy_int64": np.array(ids),
           "numpy_uint16": np.array(ids, dtype=np.uint16), "numpy_scalars": [np.int64(i) for i in ids]}[given_as]
    out = await worker.generate(arg, SamplingParams(max_new_tokens=3, **GREEDY), trajectory_id="x")
    assert out.num_prompt_tokens == 20 and worker.trajectories["x"].tokens[:20] == ids
    again = await worker.continue_("x", arg, SamplingParams(max_new_tokens=2, **GREEDY))
    assert again.num_prompt_tokens == 20 + 3 + 20


@pytest.mark.parametrize("bad", [{3: 4, 5: 6}, b"\x03\x04", bytearray(b"\x03"), {3, 4}, frozenset({3}), "34",
                                 (i for i in (3, 4)), iter([3, 4]), [3.0, 4.0], [True, 3], [torch.tensor(3)],
                                 torch.tensor([[3, 4]]), torch.tensor([3.0]), torch.tensor([True]),
                                 np.array([[3, 4]]), np.array([3.5]), np.array([True]), None, 3])
async def test_decide_prompts_as_dict_bytes_set_and_other_non_sequences_are_rejected(worker, bad):
    with pytest.raises(InvalidRequestError):
        await worker.generate(bad, SamplingParams(max_new_tokens=2), trajectory_id="never")
    assert "never" not in worker.trajectories
    out = await worker.generate([3, 4], SamplingParams(max_new_tokens=1, **GREEDY), trajectory_id="ok")
    with pytest.raises(InvalidRequestError):
        await worker.continue_("ok", bad, SamplingParams(max_new_tokens=2))
    assert worker.trajectories["ok"].tokens == [3, 4] + out.token_ids and worker.trajectories["ok"].turn is None


async def test_decide_retained_kv_does_not_survive_update_weights(cfg):
    """Decision: after update_weights the next turn of an idle trajectory recomputes its
    context with the new weights (its retained KV was dropped); a turn in flight during the
    update keeps no KV when it ends."""
    new = build_model(dataclasses.replace(cfg.model, seed=77))
    rng = random.Random(9)
    async with RolloutWorker(cfg) as w:
        prompt = rand_ids(rng, 40)
        a = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY), trajectory_id="idle")
        running = asyncio.ensure_future(w.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=300, **GREEDY),
                                                   trajectory_id="busy"))
        await until(lambda: w.engine.book.decoding, "decoding")
        await w.update_weights(list(new.named_parameters()))
        assert "idle" not in w.engine.kv.trajectories or not w.engine.kv.trajectories["idle"].blocks
        obs = rand_ids(rng, 7)
        b = await w.continue_("idle", obs, SamplingParams(max_new_tokens=5, **GREEDY))
        assert b.num_cached_tokens == 0
        assert b.token_ids == recompute_greedy(new, cfg, prompt + a.token_ids + obs, 5)[0]
        assert (await bounded(running, "the turn in flight")).finish_reason == "length"
        assert "busy" not in w.engine.kv.trajectories     # its stale KV was not cached
        c = await w.continue_("busy", [5], SamplingParams(max_new_tokens=2, **GREEDY))
        assert c.num_cached_tokens == 0
        for tid in list(w.trajectories):
            await w.release(tid)
        assert idle_and_clean(w)
