"""What one GIL release costs a thread while another thread launches (the GIL convoy), on this host.

The D build on the event loop releases the GIL at each blocking upload (``torch.tensor(...,
device=cuda)``), ~9 a build; inside turnstile rounds P's launcher thread is launching beside it
(Python, then a short GIL-free launch call). A thread that gives up the GIL for a moment may get it
back only after the busy thread's next release it wins, or after the switch interval. This times
one release-and-reacquire (``time.sleep(0)``) alone and beside such a thread, at a few switch
intervals. Host only, ~5 s.

    python benchmarks/gil_convoy_probe.py [--reps 300] [--python-us 30]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
import zlib

from ainfer_pd.metrics.stats import percentile


def one_release_ms() -> float:
    t0 = time.perf_counter()
    time.sleep(0)               # releases the GIL and takes it back, as a blocking copy's C call does
    return (time.perf_counter() - t0) * 1e3


def quantiles(reps: int) -> tuple[float, float]:
    xs = [one_release_ms() for _ in range(reps)]
    return percentile(xs, 50), percentile(xs, 90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--python-us", type=float, default=30.0, help="the busy thread's Python between its C calls")
    a = ap.parse_args()
    spin = max(1, int(a.python_us * 10))        # ~0.1 us a loop step in CPython
    buf = b"x" * 4096
    stop = threading.Event()

    def launcher() -> None:
        while not stop.is_set():
            s = 0
            for i in range(spin):
                s += i
            zlib.compress(buf, 1)               # a short GIL-free C call (a kernel launch)

    p50, p90 = quantiles(a.reps)
    print(f"alone: one GIL release p50 {p50:.3f} ms, p90 {p90:.3f} ms")
    t = threading.Thread(target=launcher, daemon=True)
    t.start()
    default = sys.getswitchinterval()
    try:
        for si in (default, 0.001, 0.0001):
            sys.setswitchinterval(si)
            p50, p90 = quantiles(a.reps)
            print(f"beside a launching thread, switch interval {si * 1e3:g} ms: p50 {p50:.3f} ms, p90 {p90:.3f} ms")
    finally:
        sys.setswitchinterval(default)
        stop.set()
        t.join()


if __name__ == "__main__":
    main()
