"""``await worker.update_weights(...)``: off the event loop, safe next to trajectories in flight,
cancellation never leaves half-written weights; the stream hold it is built on."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.runtime.device import CpuDevice
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import WeightUpdateError
from ainfer_pd.metrics.recorder import Recorder
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _slow(named, delay_s: float, started: threading.Event | None = None):
    """A verl-style lazy (name, tensor) generator whose producer is slow (runs in the copy thread)."""
    for i, (n, t) in enumerate(named):
        if i == 0 and started is not None:
            started.set()
        time.sleep(delay_s)
        yield n, t.detach().clone()


async def _streams_idle(w, timeout_s: float = 2.0) -> bool:
    """Every stream of the worker drained: a released hold's launcher leaves its park on its own
    thread, a moment after ``update_weights`` returned."""
    streams = list(w.engine.device.streams.values())
    deadline = time.monotonic() + timeout_s
    while any(s.num_pending for s in streams):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


# ====================================================================== the stream hold
def test_stream_hold_parks_later_items_and_needs_no_residency_slot():
    dev = CpuDevice(Recorder(), residency_slots=1)
    try:
        order: list[str] = []
        gate = threading.Event()
        p, d = dev.stream("P"), dev.stream("D")
        first = p.submit(lambda: (gate.wait(5), order.append("P1")), label="P1")
        hp, hd = p.hold("w"), d.hold("w")              # one slot, two streams held at once
        later = p.submit(lambda: order.append("P2"), label="P2")
        d_later = d.submit(lambda: order.append("D2"), label="D2")
        assert hd.reached.result(2.0) is None          # D had nothing before its hold
        assert not hp.reached.done()                   # P's earlier item still runs
        gate.set()
        hp.reached.result(2.0)
        assert order == ["P1"] and first.enqueued().done()
        time.sleep(0.05)
        assert order == ["P1"] and not later.enqueued().done() and not d_later.enqueued().done()
        assert p.num_pending == 2 and d.num_pending == 2
        hp.release()
        hd.release()
        later.enqueued().result(2.0)
        d_later.enqueued().result(2.0)
        assert sorted(order) == ["D2", "P1", "P2"] and order[0] == "P1"
    finally:
        dev.shutdown()


# ====================================================================== the worker
async def test_update_weights_runs_off_the_event_loop_while_trajectories_continue():
    cfg = tiny_cfg()
    rng = random.Random(11)
    new = build_model(dataclasses.replace(cfg.model, seed=321))
    async with RolloutWorker(cfg) as w:
        prompt = rand_ids(rng, 24)
        before = await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        await w.release(before.trajectory_id)
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        params = list(new.named_parameters())
        in_flight = [w.generate(rand_ids(rng, rng.randrange(10, 60)), SamplingParams(max_new_tokens=12, **GREEDY))
                     for _ in range(4)]
        async with asyncio.TaskGroup() as tg:
            tk = tg.create_task(ticker())
            outs = [tg.create_task(c) for c in in_flight]
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            n = await w.update_weights(_slow(params, 0.4 / len(params)))
            took = time.perf_counter() - t0
            stop.set()
        assert n == len(params) and took >= 0.4
        # the loop kept ticking through the whole copy (a blocking update would give ~0 ticks)
        assert tk.result() is None and ticks >= 0.4 / 0.005 * 0.25, (ticks, took)
        for t in outs:                                 # the trajectories in flight finished normally
            o = t.result()
            assert o.finish_reason == "length" and len(o.token_ids) == 12
            await w.release(o.trajectory_id)
        after = await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        assert after.token_ids == recompute_greedy(new, cfg, prompt, 6)[0] != before.token_ids
        await w.release(after.trajectory_id)
        assert await _streams_idle(w)
        assert w.kv_leak_free()


async def test_cancelled_update_while_checking_writes_nothing_and_reraises():
    """Cancelled while its (slow, lazy) input is still being checked, nothing was written: every
    weight is the old one, the lock is free, and a later sync works."""
    cfg = tiny_cfg()
    rng = random.Random(12)
    new = build_model(dataclasses.replace(cfg.model, seed=99))
    async with RolloutWorker(cfg) as w:
        old = {n: p.detach().clone() for n, p in w.model.named_parameters()}
        params = list(new.named_parameters())
        started = threading.Event()
        upd = asyncio.create_task(w.update_weights(_slow(params, 0.3 / len(params), started)))
        while not started.is_set():
            await asyncio.sleep(0.005)
        gen = asyncio.create_task(w.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=4, **GREEDY)))
        await asyncio.sleep(0.02)
        upd.cancel()
        with pytest.raises(asyncio.CancelledError):
            await upd
        for name, p in w.model.named_parameters():
            assert torch.equal(p, old[name]), name
        out = await gen
        assert len(out.token_ids) == 4
        await w.release(out.trajectory_id)
        assert not w._weights_lock.locked()
        assert await w.update_weights(params) == len(params)
        for (name, p), (_, q) in zip(w.model.named_parameters(), params):
            assert torch.equal(p, q.to(p.dtype)), name
        assert await _streams_idle(w)
        assert w.kv_leak_free()


async def test_cancelled_update_finishes_its_copy_before_streams_move_and_reraises(monkeypatch):
    """Cancelled while the copies run (every stream parked), they finish before the streams move
    again - never half-written weights - and the cancellation is re-raised."""
    from ainfer_pd.engine.model import weights as weights_mod
    cfg = tiny_cfg()
    rng = random.Random(12)
    new = build_model(dataclasses.replace(cfg.model, seed=99))
    copying = threading.Event()
    real_apply = weights_mod.WeightStage.apply

    def slow_apply(stage):
        copying.set()
        time.sleep(0.3)
        return real_apply(stage)
    monkeypatch.setattr(weights_mod.WeightStage, "apply", slow_apply)
    async with RolloutWorker(cfg) as w:
        params = list(new.named_parameters())
        upd = asyncio.create_task(w.update_weights(params))
        while not copying.is_set():
            await asyncio.sleep(0.005)
        gen = asyncio.create_task(w.generate(rand_ids(rng, 30), SamplingParams(max_new_tokens=4, **GREEDY)))
        await asyncio.sleep(0.02)
        upd.cancel()
        with pytest.raises(asyncio.CancelledError):
            await upd
        # the copy ran to its end before the cancel was delivered: every weight is the new one
        for (name, p), (_, q) in zip(w.model.named_parameters(), params):
            assert torch.equal(p, q.to(p.dtype)), name
        out = await gen                                 # the turn queued behind the hold completes
        assert len(out.token_ids) == 4
        await w.release(out.trajectory_id)
        # a rejected update: nothing written, the worker serves on, the lock was released
        with pytest.raises(WeightUpdateError):
            await w.update_weights([(params[0][0], params[0][1]), ("no.such", params[0][1])])
        for (name, p), (_, q) in zip(w.model.named_parameters(), params):
            assert torch.equal(p, q.to(p.dtype)), name
        assert not w._weights_lock.locked()
        assert await _streams_idle(w)
        assert w.kv_leak_free()
