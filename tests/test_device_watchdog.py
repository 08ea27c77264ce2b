"""The single-rank device-progress watchdog (docs/RELIABILITY.md): a device that stops (the CPU
stand-in's ``faults.hang_d_iteration``: a D iteration's stream item never completes) fails the
engine with :class:`DeviceStallError` naming each stream's oldest unfinished item, within
``parallel.stall_timeout_s`` plus slack; in-flight requests get that error, the worker closes, its
threads join, no KV block is left. A slow run whose items keep completing is never flagged."""
import asyncio
import threading
import time

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import AInferPDError, DeviceStallError, StallError
from tests.conftest import tiny_cfg

GREEDY = {"temperature": 0.0}
STALL_S = 1.5


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("ainfer-")}


async def _threads_end(before: set[str], within_s: float = 10.0) -> set[str]:
    """The worker's threads left after ``within_s`` (a stalled device's shutdown does not join them:
    they end once what holds them lets go)."""
    deadline = time.monotonic() + within_s
    while _threads() - before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return _threads() - before


async def test_a_device_that_stops_fails_generate_with_a_typed_error_naming_the_stuck_item():
    before = _threads()
    cfg = tiny_cfg(**{"faults": {"hang_d_iteration": 3}, "parallel.stall_timeout_s": STALL_S})
    w = RolloutWorker(cfg)
    t0 = time.monotonic()
    with pytest.raises(DeviceStallError) as closed:
        async with w:
            with pytest.raises(DeviceStallError) as info:
                async with asyncio.timeout(STALL_S + 20):   # never a hang: the test fails instead
                    await w.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=16, **GREEDY))
            waited = time.monotonic() - t0
            assert w.kv_leak_free()
            assert w.engine.kv.num_free_blocks == cfg.cache.num_blocks
    exc = info.value
    assert closed.value is exc                          # the worker's exit re-raises the engine's failure
    assert isinstance(exc, StallError) and isinstance(exc, AInferPDError)
    assert STALL_S <= waited < STALL_S + 10, waited
    msg = str(exc)
    assert "stream D: oldest unfinished item D.iter" in msg and "phase D" in msg, msg
    assert "device-progress stall" in msg and "unfinished for" in msg, msg
    heads = {u["stream"]: u for u in exc.unfinished}
    assert heads["D"]["label"] == "D.iter" and heads["D"]["age_s"] >= STALL_S
    assert await _threads_end(before) == set()          # the hang, released at shutdown, let its thread go
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_a_slow_but_progressing_run_is_not_flagged():
    # every D iteration waits 0.5 s on its stream before taking the device (the fault injection's
    # device delay): 20 tokens take > 2x the stall timeout, but an item completes every ~0.5 s
    # (the timeout leaves room for a loaded 2-core VM); an idle pause is no stall either
    stall_s = 4.0
    cfg = tiny_cfg(**{"parallel.stall_timeout_s": stall_s})
    async with RolloutWorker(cfg) as w:
        w.engine.d.device_delay_s = 0.5
        t0 = time.monotonic()
        out = await w.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=20, **GREEDY))
        assert len(out.token_ids) == 20 and time.monotonic() - t0 > 2 * stall_s
        await asyncio.sleep(stall_s + 0.5)              # idle: nothing unfinished
        again = await w.generate([9, 10, 11], SamplingParams(max_new_tokens=2, **GREEDY))
        assert len(again.token_ids) == 2
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()


def test_where_launches_only_enqueue_an_item_in_its_launch_owes_no_progress():
    """CUDA's rule on the CPU device (``items_run_in_launch`` off, as on CudaDevice): an item still in
    its launch (a kernel's first compile) does not make the device owe progress; on the CPU device,
    whose launch runs the item, it does."""
    import threading

    from ainfer_pd.engine.runtime.device import CpuDevice
    from ainfer_pd.metrics.recorder import Recorder
    dev, gate = CpuDevice(Recorder()), threading.Event()
    try:
        w = dev.stream("D").submit(gate.wait, label="D.compiling")
        while w.t_started is None:
            gate.wait(0.001)
        assert dev.has_unfinished_work()
        dev.items_run_in_launch = False
        assert not dev.has_unfinished_work()
    finally:
        gate.set()
        w.enqueued().result(timeout=5)
        dev.shutdown()
    assert not dev.has_unfinished_work()


async def test_a_wedged_device_does_not_keep_the_worker_from_closing():
    """A hang the shutdown cannot end (a kernel that never finishes: ``hang_outlives_shutdown``):
    generate fails typed, the worker's exit does not join the thread stuck on the device (it
    would wait forever), the device is marked stalled, no KV block is left; the stuck thread is
    the only one left and ends with its hang."""
    before = _threads()
    cfg = tiny_cfg(**{"faults": {"hang_d_iteration": 3, "hang_outlives_shutdown": True},
                      "parallel.stall_timeout_s": STALL_S})
    w = RolloutWorker(cfg)
    t0 = time.monotonic()
    try:
        with pytest.raises(DeviceStallError):
            async with asyncio.timeout(STALL_S + 20):     # the exit included: never a hang
                async with w:
                    await w.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=16, **GREEDY))
        assert time.monotonic() - t0 < STALL_S + 10
        assert w.engine.device.stalled is not None and "D.iter" in w.engine.device.stalled
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == cfg.cache.num_blocks
        # the stuck D launcher stays; the others were not joined, so they end by themselves (soon)
        deadline = time.monotonic() + 10
        while any(not t.startswith("ainfer-D") for t in _threads() - before) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = _threads() - before
        assert left == {t for t in left if t.startswith("ainfer-D")} and left, left
    finally:
        w.engine.faults.end_hangs()
    assert await _threads_end(before) == set()


def test_a_waiter_stuck_in_a_blocking_call_does_not_keep_the_process_from_exiting(tmp_path):
    """The CUDA device's waiter threads (BlockingWaiters) are daemons: a stalled device's
    synchronize never returns, and a ThreadPoolExecutor's thread would be joined at interpreter
    exit forever. Here a wait that never returns, then the shutdown without join, then exit."""
    import subprocess
    import sys
    code = (
        "import asyncio, threading\n"
        "from ainfer_pd.engine.runtime.waiters import BlockingWaiters\n"
        "async def main():\n"
        "    ws = BlockingWaiters(2, 'ainfer-cuda-wait')\n"
        "    assert await ws.run(lambda: 7) == 7\n"
        "    try:\n"
        "        await ws.run(lambda: 1 / 0)\n"
        "    except ZeroDivisionError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError('no error')\n"
        "    never = threading.Event()\n"
        "    try:\n"
        "        async with asyncio.timeout(0.3):\n"
        "            await ws.run(never.wait)\n"
        "    except TimeoutError:\n"
        "        pass\n"
        "    stuck = ws.shutdown(wait=False)\n"
        "    assert len(stuck) == 1, stuck\n"
        "    print('closed', flush=True)\n"
        "asyncio.run(main())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "closed" in p.stdout, p.stderr
