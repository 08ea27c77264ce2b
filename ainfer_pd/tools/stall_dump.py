"""A stall's evidence: after ``seconds``, every thread's stack, every asyncio task's stack and every
device stream's unfinished items.

A run that makes no progress (on the H200 a bench process twice printed nothing for 240-280 s)
cannot be told from a slow one by its log. Thread stacks alone (``PYTHONFAULTHANDLER`` with
SIGABRT) show the event loop's thread idle in its poll; what is stuck is the coroutine chain a task
awaits, which only the tasks' own stacks show. :func:`arm` starts a daemon thread that writes both
to ``stream`` once, then lets the run go on (the harness's own timeout ends it). When the device
itself stops (an FP8 run on the H200: both streams' waiter threads in ``synchronize``), the stacks
only say that something waits; the oldest unfinished item of each stream names what the device was
running (its label, lane, trace attributes, and whether its launch call returned).

    AINFER_PD_STALL_DUMP_S=200 ainfer-pd bench ...     # the CLI's run_async arms it from the variable
"""
from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import traceback
from typing import TextIO

ENV = "AINFER_PD_STALL_DUMP_S"


def seconds_from_env() -> float | None:
    """The dump's delay from :data:`ENV` (unset, empty or not a positive number: None)."""
    raw = os.environ.get(ENV, "").strip()
    try:
        s = float(raw)
    except ValueError:
        return None
    return s if s > 0 else None


def dump(loop: asyncio.AbstractEventLoop | None, stream: TextIO, *, limit: int = 16) -> None:
    """Write every thread's stack, then each of ``loop``'s tasks with the coroutine frames it waits in."""
    print(f"===== stall dump at {time.strftime('%H:%M:%S')}: threads =====", file=stream)
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        print(f"-- thread {names.get(ident, ident)}", file=stream)
        for line in traceback.format_stack(frame, limit=limit):
            print("   " + line.rstrip().replace("\n", "\n   "), file=stream)
    stream.flush()
    if loop is None:
        return
    tasks: list[asyncio.Task] = []
    for _ in range(5):                     # read from another thread: the set may change under us
        try:
            tasks = list(asyncio.all_tasks(loop))
            break
        except RuntimeError:
            time.sleep(0.01)
    print(f"===== stall dump: {len(tasks)} asyncio tasks =====", file=stream, flush=True)
    for t in sorted(tasks, key=lambda t: t.get_name()):
        print(f"-- {t.get_name()}", file=stream)
        for line in await_chain(t.get_coro(), limit):
            print(f"     {line}", file=stream)
    stream.flush()
    dump_stream_items(stream)


def unfinished_items() -> list[tuple[str, list]]:
    """(stream name, its items not finished yet, oldest first:
    :meth:`~ainfer_pd.engine.runtime.streams.Stream.unfinished`) for every live device stream that has
    some, by name. The streams are found by walking the collector's objects: this runs once, in a
    stalled process, and needs nothing registered beforehand."""
    from ..engine.runtime.streams import Stream
    found = [(obj.name, obj.unfinished()) for obj in gc.get_objects() if type(obj) is Stream]
    return sorted(((name, items) for name, items in found if items), key=lambda e: e[0])


def dump_stream_items(stream: TextIO, *, per_stream: int = 4) -> None:
    """The oldest ``per_stream`` unfinished items of each device stream (:func:`unfinished_items`)."""
    items = unfinished_items()
    print(f"===== stall dump: unfinished stream items ({sum(len(ws) for _, ws in items)}) =====", file=stream)
    for name, ws in items:
        print(f"-- stream {name}: {len(ws)} unfinished", file=stream)
        for w in ws[:per_stream]:
            print(f"     {w.label} lane={w.lane} enqueued_at={w.enqueued_at:.3f} started={w.t_started} "
                  f"launched={w.t_launched}: {w.state} attrs={w.attrs}", file=stream)
    stream.flush()


def await_chain(coro, limit: int = 16) -> list[str]:
    """The frames of ``coro`` and of what it awaits, outermost first (``Task.get_stack`` gives only a
    coroutine's own frame), ending with the awaited object that is not a coroutine (a future, a task)."""
    lines: list[str] = []
    while coro is not None and len(lines) < limit:
        nxt = getattr(coro, "cr_await", getattr(coro, "gi_yieldfrom", _NOT_A_COROUTINE))
        if nxt is _NOT_A_COROUTINE:        # a future, a task: the end of the chain
            lines.append(f"awaits {coro!r}")
            break
        f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if f is not None:                  # None: the coroutine has finished
            lines.append(f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}")
        coro = nxt
    return lines


_NOT_A_COROUTINE = object()


def arm(seconds: float, loop: asyncio.AbstractEventLoop | None, stream: TextIO | None = None) -> threading.Thread:
    """Dump once after ``seconds`` unless the process has ended; returns the (daemon) thread."""
    def run() -> None:
        time.sleep(seconds)
        dump(loop, stream or sys.stderr)
    t = threading.Thread(target=run, name="stall-dump", daemon=True)
    t.start()
    return t
