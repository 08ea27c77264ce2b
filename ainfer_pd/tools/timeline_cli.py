"""``ainfer-pd timeline RUN_DIR``: draw every rank's P / D / rendezvous timeline.

Reads ``timeline_rank*.json`` (written by each worker with ``trace_dir`` set, also when the run
failed) and writes one PNG per rank; the last interval of each stream marks where it stopped. A rank
whose run was killed before it wrote that file is drawn from its trace's ``work`` events (a worker
deletes its rank's file from an earlier run in the same ``trace_dir`` when it starts).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..metrics.overlap import d_launches, format_d_launches, format_split, split
from .plots import plot_timeline
from .report import item_kind
from .tracecheck import load_traces


def setup_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's trace_dir")
    p.add_argument("--out", help="output folder for the PNGs (default: the run dir)")
    p.add_argument("--last-s", type=float, default=None, help="only the last N seconds of each rank")
    p.add_argument("--split", action="store_true",
                   help="also print where each rank's device time went (P beside D, alone by cause, idle), and "
                        "how many D launches found the D stream idle, in turnstile rounds and outside")
    p.add_argument("--items", action="store_true",
                   help="also print each stream's device time by item kind (labels without their layer number): "
                        "count, total and mean ms; two runs' lines compare item by item")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    runs = {d["rank"]: d for d in (json.loads(f.read_text()) for f in sorted(run_dir.glob("timeline_rank*.json")))}
    traces = load_traces(run_dir)
    for rank, evs in traces.items():
        if rank not in runs and (ivs := work_intervals(evs)):
            runs[rank] = {"rank": rank, "cut": True, "intervals": ivs}     # cut before its dump
    if not runs:
        print(f"ainfer-pd timeline: no timeline_rank*.json, nor a trace with work events, in {run_dir}")
        return 2
    out = Path(args.out) if args.out else run_dir
    out.mkdir(parents=True, exist_ok=True)
    for _, data in sorted(runs.items()):
        ivs = data["intervals"]
        window = None
        if ivs and args.last_s:
            end = max(b for _, _, _, b in ivs)
            window = (end - args.last_s, end)
        stops = {}
        for name, stream, a, b in ivs:
            if b >= stops.get(stream, (None, -1.0))[1]:
                stops[stream] = (name, b)
        state = ("cut before its dump: from its trace's work events, set-up items absent" if data.get("cut")
                 else "FAILED" if data.get("failed") else "ok")
        title = f"rank {data['rank']} ({state}); last: " + ", ".join(f"{s}={n}@{t:.3f}s" for s, (n, t) in sorted(stops.items()))
        path = plot_timeline(ivs, out / f"timeline_rank{data['rank']}.png", title=title, window=window)
        print(f"rank {data['rank']}: {state}, {len(ivs)} intervals -> {path}; {title}")
        evs = traces.get(data["rank"], [])
        if args.split:
            print(f"rank {data['rank']} split: " + format_split(split(ivs, evs)))
            print(f"rank {data['rank']} {format_d_launches(d_launches(ivs, evs))}")
        if args.items:
            for line in item_lines(ivs, evs):
                print(f"rank {data['rank']} {line}")
    return 0


def work_intervals(events) -> list[list]:
    """A rank's device intervals from its trace's ``work`` events (items with trace attributes: every
    P and D item of the engine's loops), for a run cut before it wrote its timeline."""
    return [[e["what"], e["stream"], e["t0"], e["t1"]] for e in events
            if e.get("ev") == "work" and isinstance(e.get("t0"), (int, float)) and isinstance(e.get("t1"), (int, float))]


def _tally(pairs) -> dict[tuple[str, str], tuple[int, float]]:
    """(key, seconds) pairs -> key -> (count, total seconds)."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for key, sec in pairs:
        n, t = out.get(key, (0, 0.0))
        out[key] = (n + 1, t + sec)
    return out


def item_kinds(intervals) -> dict[tuple[str, str], tuple[int, float]]:
    """(stream, :func:`~.report.item_kind`) -> (count, device seconds) of a rank's recorded
    intervals (``P.attn12`` and ``P.attn3`` are one kind, ``P.attn``)."""
    return _tally(((str(stream), item_kind(name)), float(b) - float(a)) for name, stream, a, b in intervals)


def launch_kinds(events) -> dict[tuple[str, str], tuple[int, float]]:
    """(stream, item kind) -> (count, host seconds) of the launch calls the control trace's ``work``
    events record (``launch_s``: the host enqueueing the item's kernels)."""
    return _tally(((str(e.get("stream")), item_kind(e.get("what"))), float(e["launch_s"])) for e in events
                  if e.get("ev") == "work" and isinstance(e.get("launch_s"), (int, float)))


def item_lines(intervals, events=(), top: int = 12) -> list[str]:
    """The ``--items`` lines: per stream, its ``top`` item kinds by device time, with the host's
    launch call of each kind where the control trace holds it."""
    kinds, launches = item_kinds(intervals), launch_kinds(events)
    lines = []
    for stream in sorted({s for s, _ in kinds}):
        rows = sorted(((k, v) for (s, k), v in kinds.items() if s == stream), key=lambda kv: -kv[1][1])
        total = sum(t for _, (_, t) in rows)
        lines.append(f"{stream}: {total * 1e3:.1f} ms in {sum(n for _, (n, _) in rows)} items")
        for k, (n, t) in rows[:top]:
            ln, lt = launches.get((stream, k), (0, 0.0))
            host = f"; host launch {lt / ln * 1e3:.3f} ms each ({ln})" if ln else ""
            lines.append(f"  {stream} {k}: {n} items, {t * 1e3:.1f} ms, {t / n * 1e3:.3f} ms each{host}")
    return lines
