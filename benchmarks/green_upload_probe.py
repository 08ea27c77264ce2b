"""Does a blocking host-to-device upload on the host's default stream wait for work queued on another
stream? The D build's ``torch.tensor(..., device=cuda)`` uploads run on the event loop thread, and
inside turnstile rounds (where gated P runs on a green context's stream) its launch came ~1 ms after
the device drained. For each kind of stream: queue ~``--busy-ms`` of matmuls on it, then time one
such upload at once on the default stream, and one under a side pool stream.

Then the waiter cases. The H100 fine-grained trace at 8dd922a shows that the event loop thread, stalled
after rendezvous 1 (131 of the 142 rounds that took over 8 ms), went on within 0.36 ms (median) of a P
segment's completion on the device, while 107 fast rounds also had P running and did not wait. The
engine awaits every item on a waiter thread blocked in its end event's ``synchronize``; P's items in
rounds run on the green context's stream. So for each kind of stream, with and without another
thread blocked in ``synchronize`` on an event recorded after the queued matmuls, time on this thread
one of: a blocking upload; ``query()`` of a completed event; a pinned non-blocking upload, a small
kernel and an event record, each on a side pool stream. A case that takes about the queue's length
with the waiter on one kind of stream and ~0 without it is the stall.

    python benchmarks/green_upload_probe.py [--sms 96] [--busy-ms 50] [--reps 3]
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def queue_busy(stream, x, n: int) -> None:
    with torch.cuda.stream(stream):
        for _ in range(n):
            torch.mm(x, x)


def upload_ms(vals, side=None) -> float:
    t0 = time.perf_counter()
    if side is None:
        torch.tensor(vals, dtype=torch.int64, device="cuda")
    else:
        with torch.cuda.stream(side):
            torch.tensor(vals, dtype=torch.int64, device="cuda")
    return (time.perf_counter() - t0) * 1e3


def timed_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def side_ops(side, vals) -> dict:
    """The calls timed on this thread while the other stream is busy (each on a fresh queue)."""
    done = torch.cuda.Event(enable_timing=True)
    done.record(side)
    done.synchronize()
    small = torch.ones(64, device="cuda")
    pinned = torch.tensor(vals, dtype=torch.int64).pin_memory()

    def on_side(fn):
        def run():
            with torch.cuda.stream(side):
                fn()
        return run
    return {
        "blocking upload": lambda: torch.tensor(vals, dtype=torch.int64, device="cuda"),
        "query of a done event": done.query,
        "pinned upload (side)": on_side(lambda: pinned.to("cuda", non_blocking=True)),
        "small kernel (side)": on_side(lambda: small.add_(1)),
        "event record (side)": on_side(lambda: torch.cuda.Event(enable_timing=True).record()),
    }


def waiter_cases(streams: dict, x, n: int, reps: int, side, vals) -> None:
    """Each op timed right after ``n`` matmuls were queued on the busy stream, with and without a
    thread blocked in ``synchronize`` on an event recorded after them (as the engine's waiters are)."""
    ops = side_ops(side, vals)
    for name, s in streams.items():
        for waiter in (False, True):
            for op, fn in ops.items():
                ts = []
                for _ in range(reps):
                    queue_busy(s, x, n)
                    th = None
                    if waiter:
                        ev = torch.cuda.Event(enable_timing=True)
                        ev.record(s)
                        started = threading.Event()

                        def wait(ev=ev, started=started):
                            started.set()
                            ev.synchronize()
                        th = threading.Thread(target=wait, daemon=True)
                        th.start()
                        started.wait()
                        time.sleep(0.002)          # the waiter is inside synchronize now
                    ts.append(timed_ms(fn))
                    if th is not None:
                        th.join()
                    torch.cuda.synchronize()
                print(f"{name:8s} busy, waiter {'on ' if waiter else 'off'}, {op}: "
                      + " / ".join(f"{t:.2f}" for t in ts) + " ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=96)
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("green_upload_probe: needs a CUDA device")
    x = torch.randn(4096, 4096, device="cuda")
    torch.mm(x, x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.mm(x, x)
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    n = max(1, int(a.busy_ms / max(one, 1e-3)))
    streams = {"pool": torch.cuda.Stream()}
    try:
        from torch.cuda.green_contexts import GreenContext
        g = GreenContext.create(num_sms=a.sms, device_id=0)
        streams[f"green{a.sms}"] = g.Stream()
    except Exception as e:  # noqa: BLE001 - reported, the pool stream still measured
        print(f"no green context: {e!r}")
    side = torch.cuda.Stream()
    vals = list(range(64))
    print(f"one mm {one:.2f} ms; {n} queued a case (~{n * one:.0f} ms)")
    for name, s in streams.items():
        for where, sd in (("default stream", None), ("side pool stream", side)):
            ts = []
            for _ in range(a.reps):
                queue_busy(s, x, n)
                ts.append(upload_ms(vals, sd))
                torch.cuda.synchronize()
            print(f"{name:8s} busy, upload on the {where}: " + " / ".join(f"{t:.2f}" for t in ts) + " ms")
    ts = [upload_ms(vals) for _ in range(a.reps)]
    print("idle device, upload on the default stream: " + " / ".join(f"{t:.2f}" for t in ts) + " ms")
    waiter_cases(streams, x, n, a.reps, side, vals)


if __name__ == "__main__":
    main()
