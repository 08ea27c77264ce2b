"""The stall dump (ainfer_pd/tools/stall_dump.py): a run that stops making progress leaves each
thread's stack and each asyncio task's awaited coroutine chain in its log."""
import asyncio
import io
import os
import subprocess
import sys
import textwrap

from ainfer_pd.tools.stall_dump import ENV, arm, dump, seconds_from_env


async def _never_set(ev: asyncio.Event) -> None:
    await ev.wait()


def test_dump_names_the_task_and_the_frame_it_waits_in():
    async def main() -> str:
        ev = asyncio.Event()
        t = asyncio.create_task(_never_set(ev), name="stuck-turn")
        await asyncio.sleep(0.01)
        out = io.StringIO()
        dump(asyncio.get_running_loop(), out)
        t.cancel()
        return out.getvalue()
    text = asyncio.run(main())
    assert "threads =====" in text and "-- thread MainThread" in text and "in dump" in text
    assert "-- stuck-turn" in text and "_never_set" in text


def test_dump_names_each_streams_oldest_unfinished_item():
    """A device that stops: the dump lists each stream's unfinished items, oldest first, with their
    labels and state (the CPU device runs an item in its launch, so a stuck one is "in its launch")."""
    import threading

    from ainfer_pd.engine.runtime.device import CpuDevice
    from ainfer_pd.metrics.recorder import Recorder
    dev, gate = CpuDevice(Recorder()), threading.Event()
    try:
        stuck = dev.stream("D").submit(gate.wait, label="D.stuck-item", attrs={"phase": "D"})
        behind = dev.stream("D").submit(lambda: None, label="D.behind-item")
        done = dev.stream("P").submit(lambda: None, label="P.done-item")
        done.enqueued().result(timeout=5)
        while stuck.t_started is None:
            gate.wait(0.001)
        out = io.StringIO()
        from ainfer_pd.tools.stall_dump import dump_stream_items
        dump_stream_items(out)
        text = out.getvalue()
    finally:
        gate.set()
        behind.enqueued().result(timeout=5)
        dev.shutdown()
    # (a process's other devices may have unfinished items too: only this device's are asserted)
    assert "-- stream D: " in text and text.index("D.stuck-item") < text.index("D.behind-item"), text
    stuck_line = next(ln for ln in text.splitlines() if "D.stuck-item" in ln)
    assert "in its launch" in stuck_line and "'phase': 'D'" in stuck_line
    assert "queued" in next(ln for ln in text.splitlines() if "D.behind-item" in ln)
    assert "P.done-item" not in text


def test_seconds_from_env(monkeypatch):
    for raw, want in (("", None), ("x", None), ("0", None), ("-3", None), ("2.5", 2.5)):
        monkeypatch.setenv(ENV, raw)
        assert seconds_from_env() == want


def test_the_cli_runner_arms_it_from_the_environment():
    """``bench.run_async`` (the CLI's loop) arms the dump from AINFER_PD_STALL_DUMP_S: a coroutine
    stuck past it is named in stderr, and the run goes on (here it ends by itself)."""
    code = textwrap.dedent("""
        import asyncio
        from ainfer_pd.tools.bench import run_async
        async def waits_for_a_turn_that_never_ends():
            await asyncio.sleep(1.5)
            return 7
        assert run_async(waits_for_a_turn_that_never_ends()) == 7
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, ENV: "0.5"})
    assert p.returncode == 0, p.stderr
    assert "stall dump" in p.stderr and "waits_for_a_turn_that_never_ends" in p.stderr


def test_arm_is_a_daemon_that_writes_once():
    out = io.StringIO()
    t = arm(0.05, None, out)
    assert t.daemon
    t.join(2)
    assert out.getvalue().count("stall dump") == 1
