"""Issue 34, the worker's side of weight syncs and sleep / wake:

* item 1: ``update_weights`` takes sync and async iterables of (name, tensor) pairs or of buckets,
  consumed bucket by bucket, all-or-nothing (an async source that reuses its buffer, as verl's
  checkpoint engines do, still lands the intended values);
* item 11: leaving ``async with`` while ``update_weights()`` or ``wake_up()`` waits for the streams
  to park completes within seconds; the pending call completes or raises WorkerClosedError;
* item 12: ``update_weights()`` racing ``sleep(2)`` raises WorkerAsleepError (or runs first), and
  later syncs succeed (no name table built from released parameters).

Every wait is bounded; the races are set up with stream holds, not timing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import WeightUpdateError, WorkerAsleepError, WorkerClosedError
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

from tests.test_reliability_cases import GREEDY, bounded, until  # noqa: E402  (one home for the bounded waits)


def parking(w) -> bool:
    """A control call holds the lock and has queued its holds: P (held by the test) has the test
    hold and the call's park, D runs the call's park."""
    streams = w.engine.device.streams
    return w._weights_lock.locked() and streams["P"].num_pending >= 2 and streams["D"].num_pending >= 1


def _new_weights(cfg, seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in build_model(dataclasses.replace(cfg.model, seed=seed)).named_parameters()]


def _buckets(named, size: int) -> list[list[tuple[str, torch.Tensor]]]:
    return [list(named[i:i + size]) for i in range(0, len(named), size)]


def _same(model, named) -> bool:
    params = dict(model.named_parameters())
    return all(torch.equal(params[n], t.to(params[n].dtype)) for n, t in named)


async def _agen(items, delay_s: float = 0.0):
    for it in items:
        if delay_s:
            await asyncio.sleep(delay_s)
        yield it


async def _reusing_buffer_source(named, per_bucket: int):
    """Like verl's nccl / hccl checkpoint engines: each bucket's tensors are views into one
    buffer that the next bucket overwrites (only the pairs of the current bucket are valid)."""
    total = max(sum(t.numel() for _, t in named[i:i + per_bucket]) for i in range(0, len(named), per_bucket))
    buf = torch.empty(total, dtype=named[0][1].dtype)
    for i in range(0, len(named), per_bucket):
        off = 0
        views = []
        for n, t in named[i:i + per_bucket]:
            v = buf[off:off + t.numel()].view(t.shape)
            v.copy_(t)
            views.append((n, v))
            off += t.numel()
        for pair in views:
            yield pair
        await asyncio.sleep(0)


# ====================================================================== item 1: the forms of a sync
@pytest.mark.parametrize("form", ["async_pairs", "async_buckets", "async_dict_buckets", "sync_buckets",
                                  "sync_bucket_generator", "async_reused_buffer"])
async def test_item01_sync_and_async_iterables_of_pairs_or_buckets(form):
    cfg = tiny_cfg()
    rng = random.Random(1)
    named = _new_weights(cfg, 77)
    src = {
        "async_pairs": lambda: _agen(named),
        "async_buckets": lambda: _agen(_buckets(named, 5)),
        "async_dict_buckets": lambda: _agen([dict(b) for b in _buckets(named, 4)]),
        "sync_buckets": lambda: _buckets(named, 3),
        "sync_bucket_generator": lambda: (b for b in _buckets(named, 6)),
        "async_reused_buffer": lambda: _reusing_buffer_source(named, 4),
    }[form]
    prompt = rand_ids(rng, 20)
    async with RolloutWorker(cfg) as w:
        before = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY))
        await w.release(before.trajectory_id)
        n = await bounded(w.update_weights(src()), f"update_weights({form})")
        assert n == len(named)
        assert _same(w.model, named), form
        after = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY))
        await w.release(after.trajectory_id)
        new = build_model(dataclasses.replace(cfg.model, seed=77))
        assert after.token_ids == recompute_greedy(new, cfg, prompt, 5)[0]
        assert w.kv_leak_free()


@pytest.mark.parametrize("defect", ["bad_last_bucket", "source_raises", "incomplete", "not_pairs"])
async def test_item01_an_async_sync_is_all_or_nothing(defect):
    """The last bucket is bad, the source raises mid-way, a bucket is missing, an item is not a
    pair: WeightUpdateError and not one weight written (buckets before it were fine)."""
    cfg = tiny_cfg()
    named = _new_weights(cfg, 78)
    buckets = _buckets(named, 4)

    async def src():
        for i, b in enumerate(buckets):
            if i == len(buckets) - 1:
                if defect == "bad_last_bucket":
                    b = [(b[0][0], b[0][1].flatten()[:-1])] + b[1:]
                elif defect == "source_raises":
                    raise RuntimeError("the checkpoint engine's broadcast failed")
                elif defect == "incomplete":
                    return
                elif defect == "not_pairs":
                    b = [b[0][0]]
            yield b
            await asyncio.sleep(0)

    async with RolloutWorker(cfg) as w:
        old = {n: p.detach().clone() for n, p in w.model.named_parameters()}
        with pytest.raises(WeightUpdateError):
            await bounded(w.update_weights(src()), f"update_weights({defect})")
        for n, p in w.model.named_parameters():
            assert torch.equal(p, old[n]), (defect, n)
        assert not w._weights_lock.locked()
        assert await bounded(w.update_weights(_agen(buckets)), "a good sync after") == len(named)
        assert _same(w.model, named)


async def test_item01_an_async_sync_runs_off_the_loop_while_turns_continue():
    """A slow async source: the loop keeps running and turns in flight finish while it is consumed."""
    cfg = tiny_cfg()
    rng = random.Random(3)
    named = _new_weights(cfg, 79)
    async with RolloutWorker(cfg) as w:
        async with asyncio.TaskGroup() as tg:
            turns = [tg.create_task(w.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=8, **GREEDY)))
                     for _ in range(3)]
            await asyncio.sleep(0.01)
            n = await bounded(w.update_weights(_agen(_buckets(named, 2), delay_s=0.01)), "slow async sync")
        assert n == len(named) and _same(w.model, named)
        for t in turns:
            o = t.result()
            assert len(o.token_ids) == 8
            await w.release(o.trajectory_id)
        assert w.kv_leak_free()


# ====================================================================== item 11: exit while waiting to park
async def _exit_with_pending(call: str):
    """Leave ``async with`` while ``call`` waits for the streams to park: a test hold keeps the P
    stream busy (as a prefill segment would) and is let go a moment after the exit began."""
    cfg = tiny_cfg()
    named = _new_weights(cfg, 80)
    w = RolloutWorker(cfg)
    pending: asyncio.Task | None = None
    test_hold = None
    t_exit = 0.0
    try:
        async with w:
            if call == "wake_up":
                await w.sleep(1)
            test_hold = w.engine.device.streams["P"].hold("test")
            await bounded(asyncio.wrap_future(test_hold.reached), "the test hold")
            pending = asyncio.ensure_future(w.update_weights(named) if call == "update_weights" else w.wake_up())
            await until(lambda: parking(w), f"{call} parking the streams")
            threading.Timer(0.3, test_hold.release).start()      # the "prefill" ends during the exit
            t_exit = time.monotonic()
        took = time.monotonic() - t_exit
    finally:
        if test_hold is not None:
            test_hold.release()
    return pending, took, named, w


@pytest.mark.parametrize("call", ["update_weights", "wake_up"])
async def test_item11_leaving_async_with_while_a_control_call_waits_for_the_streams(call):
    pending, took, named, w = await bounded(_exit_with_pending(call), f"leaving async with during {call}")
    assert took < 5.0, took
    try:
        res = await bounded(pending, f"the pending {call}", 5.0)
    except WorkerClosedError:
        res = "closed"
    assert res == "closed" or (call == "update_weights" and res == len(named)) or (call == "wake_up" and res is None)
    assert not [t.name for t in w.engine.device.live_threads() if t.name.startswith(("ainfer-P", "ainfer-D"))]


async def test_item11_a_control_call_queued_behind_the_lock_at_exit_is_refused():
    """A second update queued behind the first one's lock when the worker leaves: WorkerClosedError."""
    cfg = tiny_cfg()
    named = _new_weights(cfg, 81)
    w = RolloutWorker(cfg)
    first = second = None
    hold = None
    async with w:
        hold = w.engine.device.streams["P"].hold("test")
        first = asyncio.ensure_future(w.update_weights(named))
        await until(lambda: parking(w), "the first update parking the streams")
        second = asyncio.ensure_future(w.update_weights(named))
        await asyncio.sleep(0.01)
        threading.Timer(0.3, hold.release).start()
    hold.release()
    for fut in (first, second):
        with pytest.raises(WorkerClosedError):
            await bounded(fut, "a pending update")


# ====================================================================== item 12: update racing sleep(2)
@pytest.mark.parametrize("keep_weights", [False, True])
async def test_item12_update_racing_sleep2_is_refused_and_later_syncs_succeed(keep_weights):
    cfg = tiny_cfg()
    rng = random.Random(12)
    named = _new_weights(cfg, 82)
    prompt = rand_ids(rng, 25)
    async with RolloutWorker(cfg) as w:
        # sleep(2) takes the control lock and waits for the streams (P is held by the test), then
        # update_weights is called: it used to pass its residency check here, before the lock
        hold = w.engine.device.streams["P"].hold("test")
        await bounded(asyncio.wrap_future(hold.reached), "the test hold")
        sleeping = asyncio.ensure_future(w.sleep(2, keep_weights=keep_weights))
        await until(lambda: parking(w), "sleep parking the streams")
        racing = asyncio.ensure_future(w.update_weights(named))
        await asyncio.sleep(0.01)
        hold.release()
        await bounded(sleeping, "sleep(2)")
        with pytest.raises(WorkerAsleepError):
            await bounded(racing, "the racing update")
        await bounded(w.wake_up(), "wake_up")
        # every later complete sync succeeds (a name table of (0,) shapes used to be cached)
        assert await bounded(w.update_weights(named), "the sync after wake_up") == len(named)
        assert await bounded(w.update_weights(dict(named)), "a second sync") == len(named)
        out = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY))
        await w.release(out.trajectory_id)
        new = build_model(dataclasses.replace(cfg.model, seed=82))
        assert out.token_ids == recompute_greedy(new, cfg, prompt, 5)[0]


async def test_item12_a_name_table_of_released_weights_is_never_used():
    """A table built while the weights were released (by any caller of ``name_table``) is not
    trusted after wake_up: the stage rebuilds it; a stage on released weights is refused."""
    from ainfer_pd.engine.model.weights import WeightStage
    from ainfer_pd.hf.names import name_table
    cfg = tiny_cfg()
    named = _new_weights(cfg, 83)
    async with RolloutWorker(cfg) as w:
        await w.sleep(2)
        name_table(w.model)                            # cached from (0,) shapes
        with pytest.raises(WorkerAsleepError):
            WeightStage(w.model)
        with pytest.raises(WorkerAsleepError):
            await w.update_weights(named)
        await w.wake_up()
        assert await bounded(w.update_weights(named), "the sync after wake_up") == len(named)
        assert _same(w.model, named)


# ====================================================================== item 9: the pinned host buffer is kept
async def test_item09_sleep2_reuses_one_host_buffer_across_sleeps():
    """sleep(2, keep_weights=True) allocates the (pinned, on CUDA) host buffer once and reuses it at
    every later sleep; after each wake_up the parameters have their own device storage (not views
    of the buffer the next sleep overwrites) and the outputs are those before."""
    cfg = tiny_cfg()
    rng = random.Random(9)
    prompt = rand_ids(rng, 30)
    sp = SamplingParams(max_new_tokens=6, **GREEDY)
    async with RolloutWorker(cfg) as w:
        res = w.engine.residency
        before = await w.generate(prompt, sp)
        await w.release(before.trajectory_id)
        weights = {n: p.detach().clone() for n, p in w.model.named_parameters()}
        first = None
        for cycle in range(3):
            await bounded(w.sleep(2, keep_weights=True), f"sleep(2) #{cycle}")
            assert res.state.weights == "host"
            if first is None:
                first = res._buffer
            assert res._buffer is first and res.host_allocations == 1, cycle     # allocated once
            assert res.host_bytes() >= sum(p.numel() * p.element_size() for p in weights.values())
            await bounded(w.wake_up(), f"wake_up #{cycle}")
            lo, hi = first.data_ptr(), first.data_ptr() + first.numel()
            for n, p in w.model.named_parameters():
                assert not lo <= p.data_ptr() < hi, f"{n} is a view of the host buffer"
                assert torch.equal(p, weights[n]), n
            out = await w.generate(prompt, sp)
            await w.release(out.trajectory_id)
            assert out.token_ids == before.token_ids, cycle
        # a weight sync between sleeps lands, and the next sleep / wake keeps the synced values
        named = _new_weights(cfg, 90)
        await w.update_weights(named)
        await w.sleep(2, keep_weights=True)
        await w.wake_up()
        assert _same(w.model, named) and res.host_allocations == 1
        assert res.free_host_buffer() > 0 and res.host_bytes() == 0


async def test_item09_reserve_sleep_buffer_pins_it_before_the_first_sleep():
    cfg = tiny_cfg()
    async with RolloutWorker(cfg) as w:
        res = w.engine.residency
        n = await w.reserve_sleep_buffer()
        buf = res._buffer
        assert n == res.host_bytes() > 0 and res.host_allocations == 1
        await w.sleep(2)
        assert res._buffer is buf and res.host_allocations == 1
        with pytest.raises(WorkerAsleepError):
            await w.reserve_sleep_buffer()
        await w.wake_up()
        assert await w.reserve_sleep_buffer() == n and res.host_allocations == 1


async def test_item12_wake_up_discards_a_name_table_built_while_asleep():
    """Any caller of ``name_table`` while the weights are released (verl's bucket checks) caches
    (0,) shapes; wake_up discards that table, so the next lookup sees the real shapes."""
    from ainfer_pd.hf.names import name_table
    cfg = tiny_cfg()
    async with RolloutWorker(cfg) as w:
        await w.sleep(2, keep_weights=False)
        assert name_table(w.model).lookup("embed").shape == (0,)
        await w.wake_up()
        assert name_table(w.model).lookup("embed").shape == tuple(w.model.embed.shape)
