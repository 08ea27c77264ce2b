"""Run recorder: work intervals per stream, control events, samples and counters.

The engine calls it from the event loop and from stream threads (thread-safe).
Control events go to an optional per-rank JSONL trace (the ordering-contract
regression baseline); intervals feed the timeline plot and the busy /
concurrent-work fractions.
"""
from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .overlap import intersect, total, union


class Recorder:
    def __init__(self, *, rank: int = 0, trace_path: str | Path | None = None,
                 keep_intervals: bool = True) -> None:
        self.rank = rank
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.counters: dict[str, float] = defaultdict(float)
        self.intervals: list[tuple[str, str, float, float, dict]] = []
        self.keep_intervals = keep_intervals
        self._seq = 0
        self._trace = None
        if trace_path is not None:
            path = Path(trace_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._trace = path.open("w", buffering=1)

    def now(self) -> float:
        """Seconds since the recorder started (monotonic)."""
        return time.perf_counter() - self.t0

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self.samples[name].append(float(value))

    def count(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[name] += value

    def interval(self, name: str, stream: str, start: float, end: float, **attrs: Any) -> None:
        """A piece of work ran on ``stream`` from ``start`` to ``end`` (recorder seconds)."""
        if not self.keep_intervals:
            return
        with self._lock:
            self.intervals.append((name, stream, start, end, attrs))

    def event(self, name: str, **attrs: Any) -> None:
        """A control event for the cross-rank trace (epoch / boundary / permit / rendezvous / launch)."""
        if self._trace is None:
            return
        with self._lock:
            self._seq += 1
            rec = {"seq": self._seq, "t": round(self.now(), 7), "rank": self.rank, "ev": name, **attrs}
            self._trace.write(json.dumps(rec, default=str) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._trace is not None:
                self._trace.close()
                self._trace = None

    # ---------------------------------------------------------------- summaries
    def busy_fractions(self, streams: tuple[str, str] = ("P", "D"), window: tuple[float, float] | None = None) -> dict[str, float]:
        """Fraction of the window in which any stream / both streams were busy."""
        with self._lock:
            ivs = [(s, a, b) for (_, s, a, b, _) in self.intervals if s in streams]
        if not ivs:
            return {"busy_fraction": 0.0, "concurrent_fraction": 0.0}
        lo = window[0] if window else min(a for _, a, _ in ivs)
        hi = window[1] if window else max(b for _, _, b in ivs)
        if hi <= lo:
            return {"busy_fraction": 0.0, "concurrent_fraction": 0.0}
        first, second = (intersect(union((a, b) for s, a, b in ivs if s == st), [(lo, hi)]) for st in streams)
        busy, both = total(union(first + second)), total(intersect(first, second))
        span = hi - lo
        return {"busy_fraction": busy / span, "concurrent_fraction": both / span}

    def summary(self) -> dict[str, Any]:
        with self._lock:
            samples = {k: list(v) for k, v in self.samples.items()}
            counters = dict(self.counters)
        out: dict[str, Any] = dict(counters)
        for k, v in samples.items():
            out[f"{k}_count"] = len(v)
            out[f"{k}_sum"] = float(sum(v))
            out[f"{k}_mean"] = float(sum(v) / len(v)) if v else 0.0
        out.update(self.busy_fractions())
        return out
