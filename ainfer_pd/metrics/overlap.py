"""Where a run's device time went: P beside D, each alone, or idle, and P's time alone split by
why its epoch ran without D (pure functions over a run's intervals and its control trace).

``ainfer-pd timeline RUN_DIR --split`` prints it for a run made with ``trace_dir`` set, with
:func:`d_launches`: whether each D launch found the D stream still busy (the overlapped D loop's
next iteration queued behind the one running) or idle, inside a turnstile round and outside.
An epoch's cause is its ``p_epoch`` event's: ``gated`` (multiplexed, D could enter at its
boundaries: P alone there means D had nothing ready or was between iterations), else the
engine's ``why`` (``no-d``, ``policy``, ``inactive``, ``backlog``, ``wait``, ``cost``).
"""
from __future__ import annotations

import bisect
import collections
from typing import Any, Iterable, Mapping, Sequence

from .stats import SETUP_ITEMS, percentile

Span = tuple[float, float]
IDLE_GAP_S = 5e-5
"""A D item that starts more than this after the stream's last one ended found it idle (one queued
behind starts within microseconds of its predecessor's end)."""
STALL_S = 5e-3
"""A turnstile round whose host took more than this from rendezvous 1 to D's launch stalled (on the
CPU stand-in that stretch is 0.4 ms at the median; the build it covers, ~0.5 ms on a GPU host)."""


def union(spans: Iterable[Span]) -> list[Span]:
    """Disjoint, sorted spans covering the same time as ``spans``."""
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersect(x: Sequence[Span], y: Sequence[Span]) -> list[Span]:
    """The time in both of two disjoint sorted span lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Sequence[Span], y: Sequence[Span]) -> list[Span]:
    """The time of ``x`` outside ``y`` (both disjoint and sorted)."""
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def total(spans: Iterable[Span]) -> float:
    return sum(b - a for a, b in spans)


def epoch_windows(events: Iterable[Mapping[str, Any]]) -> list[tuple[float, float, str]]:
    """(start, end, cause) of every P epoch in a control trace (its p_epoch -> p_epoch_done)."""
    open_: dict[Any, tuple[float, str]] = {}
    out = []
    for ev in events:
        if ev.get("ev") == "p_epoch":
            cause = "gated" if ev.get("gated") else str(ev.get("why") or "exclusive")
            open_[ev["epoch"]] = (float(ev["t"]), cause)
        elif ev.get("ev") == "p_epoch_done" and ev.get("epoch") in open_:
            t0, cause = open_.pop(ev["epoch"])
            out.append((t0, float(ev["t"]), cause))
    return sorted(out)


def _streams(intervals: Iterable[Sequence[Any]]) -> tuple[list[Span], list[Span]]:
    """P's and D's busy time (set-up left out), each as disjoint sorted spans."""
    ivs = [(str(iv[1]), float(iv[2]), float(iv[3])) for iv in intervals if str(iv[0]) not in SETUP_ITEMS]
    return union((a, b) for s, a, b in ivs if s == "P"), union((a, b) for s, a, b in ivs if s == "D")


def device_split(intervals: Iterable[Sequence[Any]]) -> dict[str, float]:
    """The run's window (first to last work item, set-up left out) in seconds: ``both_s`` (P beside
    D), ``d_alone_s``, ``p_alone_s`` and ``idle_s``, which add up to ``window_s``."""
    return _split_streams(*_streams(intervals))


def _split_streams(p: list[Span], d: list[Span]) -> dict[str, float]:
    busy = union(p + d)
    if not busy:
        return {"window_s": 0.0, "both_s": 0.0, "d_alone_s": 0.0, "p_alone_s": 0.0, "idle_s": 0.0}
    window = busy[-1][1] - busy[0][0]
    return {"window_s": window, "both_s": total(intersect(p, d)), "d_alone_s": total(subtract(d, p)),
            "p_alone_s": total(subtract(p, d)), "idle_s": window - total(busy)}


def split(intervals: Iterable[Sequence[Any]], events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`device_split` with P's time alone by its epoch's cause (``outside`` for P work past
    every epoch's end), and the epochs' count and time per cause."""
    p, d = _streams(intervals)
    out: dict[str, Any] = _split_streams(p, d)
    p_alone = subtract(p, d)
    by_cause: dict[str, float] = {}
    epochs: dict[str, dict[str, float]] = {}
    covered: list[Span] = []
    for a, b, cause in epoch_windows(events):
        by_cause[cause] = by_cause.get(cause, 0.0) + total(intersect(p_alone, [(a, b)]))
        e = epochs.setdefault(cause, {"n": 0, "s": 0.0})
        e["n"] += 1
        e["s"] += b - a
        covered.append((a, b))
    rest = total(subtract(p_alone, union(covered)))     # a device item ending after its epoch's host end
    if rest:
        by_cause["outside"] = rest
    out.update(p_alone_s=by_cause, epochs=epochs)
    return out


def format_split(s: Mapping[str, Any]) -> str:
    causes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["p_alone_s"].items(), key=lambda kv: -kv[1]))
    epochs = ", ".join(f"{k} {v['n']} ({v['s']:.2f} s)" for k, v in sorted(s["epochs"].items()))
    return (f"window {s['window_s']:.2f} s: P beside D {s['both_s']:.2f}, D alone {s['d_alone_s']:.2f}, "
            f"P alone {sum(s['p_alone_s'].values()):.2f} ({causes or '-'}), idle {s['idle_s']:.2f} | epochs: {epochs or '-'}")


def d_launches(intervals: Iterable[Sequence[Any]], events: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """D's launches (``d_launch`` events) inside a turnstile round (``round``) and outside
    (``free``): ``n``; ``idle``, those whose item found the D stream idle (it started after a gap:
    the overlapped loop's next iteration was not queued behind the running one), and ``idle_s``,
    those gaps (the D stream's time lost: P alone, or nothing); and, in rounds,
    ``rdv_to_launch_s`` (sorted), the host's time from rendezvous 1 to the launch call's return (its
    build and submit: on one rank no await lies between); ``stalls``, those rounds whose wait passed
    ``STALL_S``, and ``after_p_end_s`` (sorted), for each stall in which a P item completed on the
    device, the time from the last such completion to the launch (a host held until P's device work
    drained goes on right after it). ``settles`` (top level): the ``d_settle`` events by reason (the
    D loop read its iteration in flight outside an iteration, giving up the overlap); each part's
    ``after_settle``, its idle launches that came after one. The k-th launch made the k-th
    ``D.iter`` item (FIFO); a run cut short may have fewer items; the first item has no gap. On the
    CPU stand-in an item runs inside its launch call, so nearly every one finds the stream idle."""
    intervals = [iv for iv in intervals if str(iv[0]) not in SETUP_ITEMS]
    gap_before = _d_gaps(intervals)
    p_ends = sorted(float(iv[3]) for iv in intervals if str(iv[1]) == "P")
    out = {k: {"n": 0, "idle": 0, "idle_s": 0.0, "after_settle": 0} for k in ("round", "free")}
    waits: list[tuple[float, float]] = []      # (rendezvous 1, launch) of each round's launch
    rdv1: float | None = None
    k, settled, whys = 0, False, collections.Counter()
    for ev in events:
        kind = ev.get("ev")
        if kind == "d_settle":
            settled = True
            whys[str(ev.get("why"))] += 1
        elif kind == "rdv1":
            rdv1 = float(ev["t"])
        elif kind == "rdv2":
            rdv1 = None
        elif kind == "d_launch":
            key = "round" if ev.get("round") else "free"
            o = out[key]
            o["n"] += 1
            if k < len(gap_before) and gap_before[k] > 0:
                o["idle"] += 1
                o["idle_s"] += gap_before[k]
                o["after_settle"] += settled
            k, settled = k + 1, False
            if key == "round" and rdv1 is not None:
                waits.append((rdv1, float(ev["t"])))
                rdv1 = None
    out["round"]["rdv_to_launch_s"] = sorted(t - r for r, t in waits)
    stalls = [(r, t) for r, t in waits if t - r > STALL_S]
    out["round"]["stalls"] = len(stalls)
    out["round"]["after_p_end_s"] = sorted(t - e for r, t in stalls if (e := _last_before(p_ends, t)) is not None
                                           and e > r)
    out["settles"] = dict(whys.most_common())      # by count, the most first
    return out


def _d_gaps(intervals: list[Sequence[Any]]) -> list[float]:
    """Each ``D.iter`` item's idle D stream before it, in order (0: queued behind the one before)."""
    gaps: list[float] = []
    end = None
    for a, b, name in sorted((float(iv[2]), float(iv[3]), str(iv[0])) for iv in intervals if str(iv[1]) == "D"):
        if name == "D.iter":
            gaps.append(0.0 if end is None or a - end <= IDLE_GAP_S else a - end)
        end = b if end is None else max(end, b)
    return gaps


def _last_before(sorted_ts: list[float], t: float) -> float | None:
    i = bisect.bisect_left(sorted_ts, t) - 1
    return sorted_ts[i] if i >= 0 else None


def format_d_launches(s: Mapping[str, Mapping[str, Any]]) -> str:
    def part(k: str) -> str:
        o = s[k]
        return f"{o['n']} {'in rounds' if k == 'round' else 'outside'}, {o['idle']} at an idle D stream ({o['idle_s']:.2f} s idle before them)"
    g = s["round"].get("rdv_to_launch_s") or []
    host = (f"; rendezvous 1 -> launch p50 {percentile(g, 50) * 1e3:.1f} ms, p90 {percentile(g, 90) * 1e3:.1f} ms"
            if g else "")
    a = s["round"].get("after_p_end_s") or []
    if s["round"].get("stalls"):
        host += (f"; {s['round']['stalls']} waits over {STALL_S * 1e3:g} ms, {len(a)} of them went on after a P item"
                 f" completed inside the wait" + (f" ({percentile(a, 50) * 1e3:.2f} ms after it at the median)"
                                                    if a else ""))
    if s.get("settles"):
        host += (f"; {sum(s['settles'].values())} reads gave up the overlap (" +
                 ", ".join(f"{w} {n}" for w, n in s["settles"].items()) +
                 f"), before {s['round']['after_settle']} of the idle launches in rounds and {s['free']['after_settle']} outside")
    return f"D launches: {part('round')}; {part('free')}{host}"
