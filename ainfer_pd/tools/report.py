"""Run summaries (SPEC section 5 metrics), median / IQR aggregation and comparison tables.

Pure functions over plain data: :func:`summarize` takes a
:class:`~ainfer_pd.tools.replay.ReplayResult` (or anything with the same fields),
:func:`aggregate` a list of summaries, :func:`format_table` a mapping
``label -> aggregate`` (or ``label -> summary``).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..metrics.overlap import device_split
from ..metrics.stats import SETUP_ITEMS, percentile, work_s  # noqa: F401  (re-exported)

NAN = float("nan")

#: Summary keys, in report order, with a short column title and a display unit scale.
COLUMNS: dict[str, tuple[str, float, str]] = {
    "makespan_s": ("makespan s", 1.0, "{:.2f}"),
    "requests_per_s": ("req/s", 1.0, "{:.2f}"),
    "ttft_p50_s": ("p50 TTFT s", 1.0, "{:.3f}"),
    "ttft_p99_s": ("p99 TTFT s", 1.0, "{:.3f}"),
    "request_completion_p99_s": ("p99 req s", 1.0, "{:.3f}"),
    "trajectory_completion_p99_s": ("p99 traj s", 1.0, "{:.2f}"),
    "d_wait_mean_s": ("D wait ms", 1e3, "{:.2f}"),
    "p_wait_permit_s": ("P permit-wait s", 1.0, "{:.3f}"),
    "d_boundary_wait_s": ("D boundary-wait s", 1.0, "{:.3f}"),
    "p_enqueue_s": ("P enqueue s", 1.0, "{:.3f}"),
    "rendezvous": ("rdv", 1.0, "{:.0f}"),
    "rendezvous_cost_mean_s": ("rdv ms", 1e3, "{:.3f}"),
    "busy_fraction": ("busy", 1.0, "{:.2f}"),
    "concurrent_fraction": ("concurrent", 1.0, "{:.2f}"),
    "bound_ratio": ("/bound", 1.0, "{:.2f}"),
    "failures": ("fail", 1.0, "{:.0f}"),
}

#: Columns of the default comparison table.
TABLE_METRICS = ("makespan_s", "requests_per_s", "ttft_p99_s", "request_completion_p99_s",
                 "trajectory_completion_p99_s", "d_wait_mean_s", "rendezvous", "concurrent_fraction",
                 "failures")

#: Metrics whose ratio against the baseline is printed next to the value.
RATIO_METRICS = ("makespan_s", "requests_per_s", "ttft_p99_s", "request_completion_p99_s",
                 "trajectory_completion_p99_s", "d_wait_mean_s")


def _mean(values: Iterable[float]) -> float:
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    return float(a.mean()) if a.size else NAN


def _num(m: Mapping[str, Any], *keys: str, default: float = NAN) -> float:
    for k in keys:
        v = m.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def optimistic_bound(*, p_work_s: float | None, d_work_s: float | None, chain_s: float | None) -> float:
    """max(sum of P work alone, sum of D work alone, longest chain incl. tool waits); absent terms skipped."""
    terms = [t for t in (p_work_s, d_work_s, chain_s) if t is not None and math.isfinite(t) and t > 0]
    return max(terms) if terms else NAN


def chain_lower_bound(result: Any, metrics: Mapping[str, Any] | None = None) -> float:
    """Longest single-trajectory chain: its tool waits plus, when the worker reports a
    decode iteration time alone (``d_iter_alone_s``), one such iteration per generated token.
    Without that key the chain is the tool waits alone (a looser lower bound)."""
    metrics = metrics if metrics is not None else (getattr(result, "metrics", None) or {})
    d_alone = _num(metrics, "d_iter_alone_s", default=0.0)
    gen: dict[int, int] = {}
    for r in getattr(result, "records", []):
        # the tokens it generated (a turn under a response budget asks for more than it writes)
        gen[r.conversation] = gen.get(r.conversation, 0) + int(r.num_output_tokens if r.ok else r.gen_tokens)
    best = 0.0
    for t in getattr(result, "trajectories", []):
        best = max(best, float(t.total_wait_s) + d_alone * gen.get(t.conversation, 0))
    return best


def completed(trajectories: Iterable[Any]) -> list[Any]:
    """The trajectories that ran every turn and did not fail."""
    return [t for t in trajectories if not t.failed and t.turns_total > 0 and t.turns_done == t.turns_total]


def last_chain(result: Any) -> dict[str, float]:
    """The measured chain of the trajectory that finished last (completed ones only): its output
    tokens, and its decode time, which is its duration less its tool waits and its turns' TTFTs.
    Also that decode time per token after each turn's first (``last_traj_token_ms``). When the
    makespan is this chain, the figure is what a D iteration costs along it (H200 trace cell:
    13.5 ms under normal, 11.8 ms under fine-grained; the B = 1 iteration the bound's chain
    term prices is ~4 ms)."""
    done = [t for t in completed(getattr(result, "trajectories", [])) if math.isfinite(t.end_s)]
    if not done:
        return {"last_traj_tokens": NAN, "last_traj_decode_s": NAN, "last_traj_token_ms": NAN}
    last = max(done, key=lambda t: t.end_s)
    recs = [r for r in getattr(result, "records", []) if r.conversation == last.conversation and r.ok]
    tokens = sum(r.num_output_tokens for r in recs)
    decode = last.duration_s - last.total_wait_s - sum(r.ttft_s for r in recs)
    after_first = tokens - len(recs)
    return {"last_traj_tokens": float(tokens), "last_traj_decode_s": decode,
            "last_traj_token_ms": 1000.0 * decode / after_first if after_first > 0 else NAN}


def summarize(result: Any, *, chain_s: float | None = None) -> dict[str, float]:
    """The SPEC section 5 metrics of one replay (flat dict of floats; NaN where unknown)."""
    m: Mapping[str, Any] = getattr(result, "metrics", None) or {}
    recs = list(getattr(result, "records", []))
    makespan = float(result.makespan_s)
    s = _client_metrics(result, recs, makespan)
    s["prefill_tokens"] = _num(m, "prefill_tokens")          # prompt tokens P computed (issue 15)
    s["prefix_reused_tokens"] = _num(m, "prefix_reused_tokens")
    s["failures"] = float(getattr(result, "failures", sum(1 for r in recs if not r.ok)))
    s.update(_worker_metrics(m))
    s["cached_fraction"] = s["cached_tokens"] / s["input_tokens"] if s["input_tokens"] > 0 else NAN
    s.update(_bound_terms(result, m, makespan, chain_s))
    s.update(last_chain(result))
    s.update(_device_split(getattr(result, "timeline", None)))
    return s


def _client_metrics(result: Any, recs: list[Any], makespan: float) -> dict[str, float]:
    """What the client measured: makespan, request rate, TTFT, request and trajectory completion
    times, token counts."""
    ok = [r for r in recs if r.ok]
    done_trajs = completed(getattr(result, "trajectories", []))
    return {
        "makespan_s": makespan,
        "requests": float(getattr(result, "planned_requests", 0) or len(recs)),
        "completed_requests": float(len(ok)),
        "requests_per_s": len(ok) / makespan if makespan > 0 else NAN,
        "ttft_p50_s": percentile((r.ttft_s for r in ok), 50),
        "ttft_p99_s": percentile((r.ttft_s for r in ok), 99),
        "ttft_mean_s": _mean(r.ttft_s for r in ok),
        "request_completion_p50_s": percentile((r.latency_s for r in ok), 50),
        "request_completion_p99_s": percentile((r.latency_s for r in ok), 99),
        "trajectory_completion_p50_s": percentile((t.end_s for t in done_trajs), 50),
        "trajectory_completion_p99_s": percentile((t.end_s for t in done_trajs), 99),
        "trajectory_duration_p99_s": percentile((t.duration_s for t in done_trajs), 99),
        "input_tokens": float(sum(r.num_prompt_tokens for r in ok)),
        "output_tokens": float(sum(r.num_output_tokens for r in ok)),
        "cached_tokens": float(sum(r.num_cached_tokens for r in ok)),
    }


def _worker_metrics(m: Mapping[str, Any]) -> dict[str, float]:
    """What the worker's ``metrics()`` reported: failures, D wait, P / D waits, rendezvous, device
    fractions, D iteration time."""
    return {
        "worker_failures": _num(m, "failures", default=0.0),
        "d_wait_mean_s": _num(m, "d_wait_s_mean"),
        "d_wait_count": _num(m, "d_wait_s_count"),
        "p_wait_permit_s": _num(m, "p_wait_permit_s_sum"),
        "d_boundary_wait_s": _num(m, "d_boundary_wait_s_sum"),
        "p_enqueue_s": _num(m, "p_enqueue_s_sum"),
        "rendezvous": _num(m, "rendezvous", "rendezvous_s_count", default=0.0),
        "rendezvous_cost_mean_s": _num(m, "rendezvous_s_mean"),
        "busy_fraction": _num(m, "busy_fraction"),
        "concurrent_fraction": _num(m, "concurrent_fraction"),
        "d_iter_mean_s": _num(m, "d_iter_s_mean"),
    }


def _bound_terms(result: Any, m: Mapping[str, Any], makespan: float, chain_s: float | None) -> dict[str, float]:
    """The optimistic bound's terms (P work, D work, the longest chain), the bound and the makespan's
    ratio to it."""
    p_work = _num(m, "p_work_s_sum")
    d_work = _num(m, "d_work_s_sum")
    chain = chain_lower_bound(result, m) if chain_s is None else float(chain_s)
    bound = optimistic_bound(p_work_s=p_work, d_work_s=d_work, chain_s=chain)
    return {"p_work_s": p_work, "d_work_s": d_work, "chain_s": chain, "bound_s": bound,
            "bound_ratio": makespan / bound if bound > 0 else NAN}


def _device_split(timeline: Any) -> dict[str, float]:
    """Where the device time went (metrics.overlap; NaN for a result without a timeline)."""
    if not timeline:
        return {"both_s": NAN, "d_alone_s": NAN, "p_alone_s": NAN, "idle_s": NAN}
    split = device_split(timeline)
    return {k: split[k] for k in ("both_s", "d_alone_s", "p_alone_s", "idle_s")}


def aggregate(summaries: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, quartiles and IQR (q3 - q1, linear interpolation) of every numeric metric."""
    keys: list[str] = []
    for s in summaries:
        for k, v in s.items():
            if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.append(k)
    out: dict[str, dict[str, float]] = {}
    for k in keys:
        vals = np.asarray([float(s[k]) for s in summaries
                           if isinstance(s.get(k), (int, float)) and math.isfinite(float(s[k]))], dtype=float)
        if vals.size == 0:
            out[k] = {"median": NAN, "q1": NAN, "q3": NAN, "iqr": NAN, "min": NAN, "max": NAN, "n": 0}
            continue
        q1, med, q3 = np.percentile(vals, [25, 50, 75])
        out[k] = {"median": float(med), "q1": float(q1), "q3": float(q3), "iqr": float(q3 - q1),
                  "min": float(vals.min()), "max": float(vals.max()), "n": int(vals.size)}
    return out


def _median_of(entry: Any, key: str) -> tuple[float, float]:
    """(value, iqr) of ``key`` in an aggregate or a plain summary."""
    v = entry.get(key) if isinstance(entry, Mapping) else None
    if isinstance(v, Mapping):
        return float(v.get("median", NAN)), float(v.get("iqr", NAN))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v), NAN
    return NAN, NAN


def ratios(results: Mapping[str, Any], baseline: str = "normal",
           metrics: Sequence[str] = RATIO_METRICS) -> dict[str, dict[str, float]]:
    """``label -> metric -> median(label) / median(baseline)`` (NaN when the baseline is missing or 0)."""
    base = results.get(baseline)
    out: dict[str, dict[str, float]] = {}
    for label, entry in results.items():
        row = {}
        for k in metrics:
            v, _ = _median_of(entry, k)
            b, _ = _median_of(base, k) if base is not None else (NAN, NAN)
            row[k] = v / b if math.isfinite(v) and math.isfinite(b) and b != 0 else NAN
        out[label] = row
    return out


def _fmt(value: float, fmt: str, scale: float) -> str:
    return "-" if not math.isfinite(value) else fmt.format(value * scale)


def format_table(results: Mapping[str, Any], *, baseline: str = "normal",
                 metrics: Sequence[str] = TABLE_METRICS, ratio_metrics: Sequence[str] = RATIO_METRICS,
                 title: str | None = None) -> str:
    """A fixed-width table, one row per label: ``median ±IQR`` and ``(ratio vs baseline)``."""
    rat = ratios(results, baseline, [m for m in metrics if m in ratio_metrics])
    have_base = baseline in results
    headers = ["policy"] + [COLUMNS.get(m, (m, 1.0, "{:.3g}"))[0] for m in metrics]
    rows = []
    for label, entry in results.items():
        row = [label]
        for m in metrics:
            _, scale, fmt = COLUMNS.get(m, (m, 1.0, "{:.3g}"))
            v, iqr = _median_of(entry, m)
            cell = _fmt(v, fmt, scale)
            if math.isfinite(iqr) and iqr > 0:
                cell += " ±" + _fmt(iqr, fmt, scale)
            if have_base and label != baseline and m in rat.get(label, {}):
                r = rat[label][m]
                if math.isfinite(r):
                    cell += f" ({r:.3f}x)"
            row.append(cell)
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if have_base and len(results) > 1:
        lines.append(f"(ratios in parentheses: median / median of {baseline!r}; ± is the IQR)")
    return "\n".join(lines)


def compare_outputs(a: Mapping[Any, Sequence[int]], b: Mapping[Any, Sequence[int]]) -> list[Any]:
    """Keys whose greedy outputs differ (or exist on one side only)."""
    return sorted((k for k in set(a) | set(b) if list(a.get(k, [])) != list(b.get(k, []))
                   or (k in a) != (k in b)), key=str)


def breakdown(m: dict[str, Any]) -> str:
    """One line of where a run's time went: D iterations (host build, launch->done and its split,
    post), P epochs, and the device busy / concurrent fractions."""
    def ms(key: str) -> str:
        return f"{m.get(key + '_mean', 0.0) * 1e3:.2f}"
    split = ""
    if m.get("d_device_s_count"):
        split = (f" (pickup {ms('d_pickup_s')}, to start {ms('d_to_start_s')}, device {ms('d_device_s')}, "
                 f"resume {ms('d_resume_s')}; launch call {ms('d_launch_call_s')})")
    return (f"D iters {int(m.get('d_iter_s_count', 0))}: build {ms('d_build_s')} ms, launch->done {ms('d_iter_s')} ms"
            f"{split}, post {ms('d_post_s')} ms, sum {m.get('d_iter_s_sum', 0.0):.2f} s | "
            f"P epochs {int(m.get('p_epoch_s_count', 0))}: {ms('p_epoch_s')} ms mean, "
            f"{m.get('p_epoch_tokens_mean', 0.0):.0f} tokens mean, sum {m.get('p_epoch_s_sum', 0.0):.2f} s | "
            f"busy {m.get('busy_fraction', 0.0):.2f}, concurrent {m.get('concurrent_fraction', 0.0):.2f}")


def item_kind(label: Any) -> str:
    """A stream item's kind: its label without the layer number (``P.attn3`` -> ``P.attn``)."""
    return str(label).rstrip("0123456789")


def interval_stats(intervals: Iterable[Sequence[Any]] | None, top: int = 6) -> str:
    """The stream items that took the most device time, grouped by :func:`item_kind`
    (``P.attn``, ``P.experts``, ``D.iter``): count, mean, max and total ms."""
    groups: dict[str, list[float]] = {}
    for iv in intervals or ():
        name, dur = item_kind(iv[0]), float(iv[3]) - float(iv[2])
        groups.setdefault(name, []).append(dur)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    slow = sorted(((float(iv[3]) - float(iv[2]), str(iv[0]), float(iv[2])) for iv in intervals or ()
                   if str(iv[0]) not in SETUP_ITEMS), reverse=True)[:3]
    return ("; ".join(f"{k} n={len(v)} mean {1e3 * sum(v) / len(v):.2f} max {1e3 * max(v):.1f} "
                      f"sum {sum(v):.2f} s" for k, v in rows)
            + " | slowest: " + ", ".join(f"{n} at {a:.2f} s {1e3 * d:.1f} ms" for d, n, a in slow))
