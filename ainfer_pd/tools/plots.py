"""PNG plots of a benchmark: makespan bars, TTFT / D-wait CDFs, P/D/rendezvous timeline.

Uses matplotlib's object API with the Agg canvas (no pyplot global state, no display).
Every function returns the written path, or ``None`` when there is nothing to draw.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def _figure(w: float = 7.0, h: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _stat(entry: Any, key: str) -> tuple[float, float, float]:
    """(median, q1, q3) from an aggregate entry or a plain summary."""
    v = entry.get(key) if isinstance(entry, Mapping) else None
    if isinstance(v, Mapping):
        return float(v.get("median", math.nan)), float(v.get("q1", math.nan)), float(v.get("q3", math.nan))
    if isinstance(v, (int, float)):
        return float(v), float(v), float(v)
    return math.nan, math.nan, math.nan


def plot_makespan_bars(results: Mapping[str, Any], path: str | Path, *, metric: str = "makespan_s",
                       title: str = "", ylabel: str = "makespan (s)") -> Path | None:
    """One bar per label (median) with IQR error bars; ``results``: label -> aggregate or summary."""
    labels = [k for k in results if math.isfinite(_stat(results[k], metric)[0])]
    if not labels:
        return None
    med = np.array([_stat(results[k], metric)[0] for k in labels])
    q1 = np.array([_stat(results[k], metric)[1] for k in labels])
    q3 = np.array([_stat(results[k], metric)[2] for k in labels])
    lo = np.nan_to_num(med - q1, nan=0.0).clip(min=0)
    hi = np.nan_to_num(q3 - med, nan=0.0).clip(min=0)
    fig = _figure(max(4.0, 1.2 * len(labels) + 2), 4.0)
    ax = fig.add_subplot(111)
    x = np.arange(len(labels))
    ax.bar(x, med, yerr=np.vstack([lo, hi]), capsize=4, color=[f"C{i % 10}" for i in range(len(labels))])
    for xi, v in zip(x, med):
        ax.annotate(f"{v:.2f}", (xi, v), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{metric} (median, IQR)")
    return _save(fig, path)


def plot_cdfs(samples: Mapping[str, Sequence[float]], path: str | Path, *, xlabel: str,
              title: str = "", scale: float = 1.0, logx: bool = False) -> Path | None:
    """Empirical CDF per label; labels without finite samples are skipped."""
    series = {}
    for label, vals in samples.items():
        a = np.asarray([v for v in (vals or []) if v is not None and math.isfinite(v)], dtype=float) * scale
        if a.size:
            series[label] = np.sort(a)
    if not series:
        return None
    fig = _figure()
    ax = fig.add_subplot(111)
    for label, a in series.items():
        y = np.arange(1, a.size + 1) / a.size
        ax.step(a, y, where="post", label=f"{label} (n={a.size})")
    if logx and all(a.min() > 0 for a in series.values()):
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("CDF")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def ttft_samples(results: Sequence[Any]) -> list[float]:
    """TTFTs of every successful request of the given replay results."""
    return [r.ttft_s for res in results for r in res.records if r.ok]


def d_wait_samples(results: Sequence[Any]) -> list[float]:
    """Per-iteration D waits, when the worker reported them (``d_wait_s_samples``)."""
    out: list[float] = []
    for res in results:
        v = (getattr(res, "metrics", None) or {}).get("d_wait_s_samples")
        if isinstance(v, (list, tuple)):
            out.extend(float(x) for x in v)
    return out


def plot_ttft_cdf(results_by_label: Mapping[str, Sequence[Any]], path: str | Path, *, title: str = "") -> Path | None:
    return plot_cdfs({k: ttft_samples(v) for k, v in results_by_label.items()}, path,
                     xlabel="TTFT (s)", title=title or "TTFT CDF")


def plot_d_wait_cdf(results_by_label: Mapping[str, Sequence[Any]], path: str | Path, *, title: str = "") -> Path | None:
    return plot_cdfs({k: d_wait_samples(v) for k, v in results_by_label.items()}, path,
                     xlabel="D wait per iteration (ms)", scale=1e3, title=title or "D wait CDF")


_COLORS = {"P": "C0", "D": "C1", "R": "C3", "rendezvous": "C3"}


def plot_timeline(timeline: Sequence[Sequence[Any]] | None, path: str | Path, *, title: str = "",
                  window: tuple[float, float] | None = None, max_items: int = 20000) -> Path | None:
    """Gantt chart of ``(name, stream, start, end, attrs)`` intervals: one row per stream.

    Rendezvous (names containing ``rendezvous``/``rdv``) get their own row. ``window``
    restricts the time range; at most ``max_items`` intervals are drawn (the first ones).
    """
    if not timeline:
        return None
    rows: dict[str, list[tuple[float, float, str]]] = {}
    n = 0
    for item in timeline:
        try:
            name, stream, start, end = item[0], item[1], float(item[2]), float(item[3])
        except (TypeError, ValueError, IndexError):
            continue
        if window and (end < window[0] or start > window[1]):
            continue
        row = "rendezvous" if ("rendezvous" in str(name) or "rdv" in str(name)) else str(stream)
        rows.setdefault(row, []).append((start, max(end - start, 1e-6), str(name)))
        n += 1
        if n >= max_items:
            break
    if not rows:
        return None
    order = sorted(rows, key=lambda r: {"P": 0, "D": 1, "rendezvous": 2}.get(r, 3))
    fig = _figure(10.0, 1.0 + 0.7 * len(order))
    ax = fig.add_subplot(111)
    names = sorted({nm for r in rows.values() for _, _, nm in r})
    name_color = {nm: f"C{i % 10}" for i, nm in enumerate(names)}
    for yi, row in enumerate(order):
        segs = rows[row]
        colors = [_COLORS.get(row) if len(names) > 8 else name_color[nm] for _, _, nm in segs]
        ax.broken_barh([(s, w) for s, w, _ in segs], (yi - 0.4, 0.8), facecolors=colors, edgecolor="none")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels(order)
    ax.set_xlabel("time (s)")
    if window:
        ax.set_xlim(*window)
    if len(names) <= 8:
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color=name_color[nm], label=nm) for nm in names], fontsize=7,
                  loc="upper right", ncol=min(4, len(names)))
    ax.set_title(title or "timeline")
    return _save(fig, path)


def overlap_window(timeline: Sequence[Sequence[Any]] | None, length_s: float) -> tuple[float, float] | None:
    """A ``length_s`` window starting where a P interval first overlaps a D interval (else at the first P)."""
    if not timeline:
        return None
    ps = sorted((float(x[2]), float(x[3])) for x in timeline if len(x) >= 4 and x[1] == "P")
    ds = sorted((float(x[2]), float(x[3])) for x in timeline if len(x) >= 4 and x[1] == "D")
    if not ps:
        return None
    start = ps[0][0]
    j = 0
    for a, b in ps:
        while j < len(ds) and ds[j][1] <= a:
            j += 1
        if j < len(ds) and ds[j][0] < b:
            start = max(a, ds[j][0]) - 0.1 * length_s
            break
    return (start, start + length_s)


def plot_all(out_dir: str | Path, aggregates: Mapping[str, Any], results_by_label: Mapping[str, Sequence[Any]],
             *, prefix: str = "", title: str = "", zoom_s: float | None = 0.25) -> list[Path]:
    """Makespan bars, TTFT and D-wait CDFs and the first run's timeline per label into ``out_dir``.

    With ``zoom_s``, a second timeline per label shows a window of that length where P and D
    first overlap (the whole-run timeline is too dense to read segments in).
    """
    out_dir = Path(out_dir)
    pre = f"{prefix}_" if prefix else ""
    written = [plot_makespan_bars(aggregates, out_dir / f"{pre}makespan.png", title=title),
               plot_ttft_cdf(results_by_label, out_dir / f"{pre}ttft_cdf.png", title=title),
               plot_d_wait_cdf(results_by_label, out_dir / f"{pre}d_wait_cdf.png", title=title)]
    for label, results in results_by_label.items():
        if results and getattr(results[0], "timeline", None):
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
            tl = results[0].timeline
            written.append(plot_timeline(tl, out_dir / f"{pre}timeline_{safe}.png",
                                         title=f"{title} {label}".strip()))
            win = overlap_window(tl, zoom_s) if zoom_s else None
            if win is not None:
                written.append(plot_timeline(tl, out_dir / f"{pre}timeline_{safe}_zoom.png", window=win,
                                             title=f"{title} {label} ({zoom_s:g} s window)".strip()))
    return [p for p in written if p is not None]
