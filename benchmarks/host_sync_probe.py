"""What stalls the host inside a turnstile round on a GPU: one bench run (default: fine-grained on the
ladder's P1 cell) with PyTorch's CUDA sync debug mode on, every synchronizing call counted by its
Python stack, the caching allocator's counters over the run (a retry frees the cache: a device-wide
sync), and the run's D launches (``metrics.overlap.d_launches``: how many found the D stream idle,
and the host's time from rendezvous 1 to the launch).

Why: on the H100 (8dd922a, fine-grained P1), half the D launches inside rounds found the D stream
idle, and rendezvous 1 -> launch, synchronous host code, took 12.9 ms at the median (0.4 ms on the
CPU stand-in): the event loop thread waited on something, and the overlapped D loop's gain is lost
in every gated epoch.

    python benchmarks/host_sync_probe.py [--policy fine-grained] [--conversations 64] [--set KEY=VALUE] \
        [--trace-dir /tmp/sync_probe] [--top 12]
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import io
import os
import pstats
import threading
import time
import traceback
import warnings

import torch

from ainfer_pd.engine.loop import d_driver
from ainfer_pd.engine.runtime.runner import ModelRunner
from ainfer_pd.metrics.overlap import d_launches, format_d_launches, format_split, split
from ainfer_pd.metrics.stats import percentile
from ainfer_pd.tools.cli import main as cli
from ainfer_pd.tools.timeline_cli import work_intervals
from ainfer_pd.tools.tracecheck import load_traces

ALLOC_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")


class SyncLog:
    """Counts the sync debug mode's warnings by (thread, the library's frames of the stack)."""

    def __init__(self, frames: int) -> None:
        self.frames = frames
        self.by_stack: collections.Counter = collections.Counter()
        self.first_s: dict = {}
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchroniz" not in text.lower():
            print(f"warning: {category.__name__}: {text}")
            return
        stack = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "ainfer_pd" in f.filename]
        key = (threading.current_thread().name.split("_")[0], text.splitlines()[0][:90], tuple(stack[-self.frames:]))
        with self._lock:
            self.by_stack[key] += 1
            self.first_s.setdefault(key, time.perf_counter() - self.t0)

    def report(self, top: int) -> list[str]:
        lines = [f"synchronizing calls: {sum(self.by_stack.values())} in {len(self.by_stack)} places"]
        for key, n in self.by_stack.most_common(top):
            thread, text, stack = key
            lines.append(f"  {n:6d} x thread {thread} (first at {self.first_s[key]:.1f} s): {text}")
            lines += [f"           {fr}" for fr in stack]
        return lines


class BuildTimer:
    """Wall time of each D build on the event loop (``ModelRunner.build`` without prefill rows, and
    the overlapped loop's ``feed_of``), one cProfile over them all: the synchronous host code between
    rendezvous 1 and the launch, with what it waited in (a sync, the GIL) inside its callees' time."""

    def __init__(self) -> None:
        self.prof = cProfile.Profile()
        self.calls: dict[str, list[float]] = {"build": [], "feed_of": []}

    def wrap(self, name: str, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            self.prof.enable()
            try:
                return fn(*args, **kw)
            finally:
                self.prof.disable()
                self.calls[name].append(time.perf_counter() - t0)
        return timed

    @contextlib.contextmanager
    def installed(self):
        build, feed = ModelRunner.build, d_driver.feed_of
        timed_build = self.wrap("build", build)

        def build_(runner, prefill, decode, *a, **kw):
            return build(runner, prefill, decode, *a, **kw) if prefill else timed_build(runner, prefill, decode, *a, **kw)
        ModelRunner.build, d_driver.feed_of = build_, self.wrap("feed_of", feed)
        try:
            yield self
        finally:
            ModelRunner.build, d_driver.feed_of = build, feed

    def report(self, top: int) -> list[str]:
        lines = []
        for name, xs in self.calls.items():
            if xs:
                lines.append(f"D {name}: {len(xs)} calls, p50 {percentile(xs, 50) * 1e3:.2f} ms, "
                             f"p90 {percentile(xs, 90) * 1e3:.2f} ms, max {max(xs) * 1e3:.2f} ms, total {sum(xs):.2f} s")
        buf = io.StringIO()
        pstats.Stats(self.prof, stream=buf).sort_stats("cumulative").print_stats(top)
        return lines + [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--policy", default="fine-grained")
    ap.add_argument("--cell", default="P1")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--trace-dir", default="/tmp/sync_probe")
    ap.add_argument("--frames", type=int, default=6, help="the library's innermost frames kept per stack")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--no-sync-debug", action="store_true", help="the allocator counters and launches only")
    ap.add_argument("--profile-build", action="store_true",
                    help="time each D build and feed on the event loop, with a cProfile of them (best without the sync debug mode)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_sync_probe: needs a CUDA device (the sync debug mode and allocator are CUDA's)")
    os.makedirs(a.trace_dir, exist_ok=True)
    sets = ["mux.span=measured", "device.graph_max_context=8192", f"trace_dir={a.trace_dir}", *a.set]
    argv = ["bench", "--config", a.config, "--cells", a.cell, "--policies", a.policy, "--priorities", "fifo",
            "--repeats", "1", "--conversations", str(a.conversations), "--max-turns", str(a.max_turns),
            "--token-scale", str(a.token_scale), "--seed", "0", "--no-progress"]
    for kv in sets:
        argv += ["--set", kv]
    log = SyncLog(a.frames)
    timer = BuildTimer()
    before = torch.cuda.memory_stats()
    warnings.simplefilter("always")
    warnings.showwarning = log.show
    if not a.no_sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with timer.installed() if a.profile_build else contextlib.nullcontext():
            rc = cli(argv)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after = torch.cuda.memory_stats()
    print(f"bench rc {rc}: {' '.join(argv)}")
    print("allocator over the run: " + ", ".join(f"{k} {after.get(k, 0) - before.get(k, 0)}" for k in ALLOC_KEYS))
    for line in log.report(a.top):
        print(line)
    if a.profile_build:
        for line in timer.report(2 * a.top):
            print(line)
    events = load_traces(a.trace_dir).get(0, [])
    ivs = work_intervals(events)
    if ivs:
        print("split: " + format_split(split(ivs, events)))
        print(format_d_launches(d_launches(ivs, events)))


if __name__ == "__main__":
    main()
