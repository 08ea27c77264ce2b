"""The policy ladder of record (issue 16): every policy x priority on one trace, repeated, as rows.

Runs ``ainfer-pd bench`` (fresh worker per run, same trace and seed for every variant) and turns
its ``results.json`` into the rows of ``docs/results/ladder/latest.json``::

    {"commit": ..., "config": ..., "machine": ..., "workload": {...},
     "rows": [{"cell", "policy", "priority", "span", "makespan_s", "p99_ttft_s", "mean_d_wait_ms",
               "bound_ratio", "rendezvous"}],      # each figure {"median": x, "iqr": y, "n": repeats}
     "targets": [{"name", "value", "target", "met"}]}

    python benchmarks/ladder.py run --commit HASH --part NAME --out DIR [--cells P1,trace] \
        [--policies ...] [--priorities fifo,critical-path] [--repeats 3] [--spans 1,2,3,4,auto] \
        [--decode-only] [--conversations 64 --max-turns 4 --token-scale 1] [--set KEY=VALUE ...]
    python benchmarks/ladder.py merge PART.json [PART.json ...] --out docs/results/ladder/latest.json \
        [--data-path KEY=VALUE[+KEY=VALUE...]]
    python benchmarks/ladder.py from-log LADDER.log --commit HASH --part NAME --out DIR
    python benchmarks/ladder.py plan [--latest docs/results/ladder/latest.json] [--commit HASH] [--budget-s 520] [--run-s S] [--span-run-s 41]

``plan`` lists the issue's rows (cells P1 and trace x five policies x two priorities, 3 repeats,
and the span sweep; the long-context workload's rows, below) that ``latest.json`` lacks, and packs them into device calls of ``h200_ladder.sh``
that fit ``budget-s`` each, at the measured cost of a run of each policy (``RUN_S``; ``--run-s`` one
figure for all) plus ``PART_S`` a part and ``WARMUP_S`` a call. With ``--commit`` only that commit's
rows count as measured (parts pool only under one commit label).

The long-context agentic workload (issue 33 item 4; ``run --workload grpo-long``: GRPO groups
of 8 siblings sharing a prompt, retained contexts on the paper's distribution up to 14.8K,
:func:`ainfer_pd.tools.trace_gen.grpo_agentic_trace`) gives rows of its own beside the trace's:
their cell is ``grpo-long/P1`` or ``grpo-long/trace`` (the trace's rows keep ``P1`` / ``trace``,
as decode-only's are ``decode-only/P1``), owed for the five policies with fifo and for normal and
fine-grained with critical-path (:data:`GRPO_ROWS`), judged by the same ratio targets and by
makespan / optimistic bound <= 1.2 for every policy (``targets``); ``plan --workloads`` picks
which workloads it owes.

``from-log`` rebuilds a part when a bench was cut before ``run`` wrote it: from its runs.jsonl (every
figure), or from the per-run lines it printed (makespan, p99 TTFT and D wait only; the bound and
the rendezvous stay unknown).

``run`` writes ``DIR/ladder_NAME.json`` (one part); ``merge`` joins parts (their rows, workloads
and commits; two rows of one key and one commit pool their runs) and evaluates the targets over the
joined rows; with ``--data-path`` a second time (``targets_data_path``) over the rows run on that
lever set (``data_path_view``: a policy that refuses it stands in with its plain row, named). The
targets are the issue's: pure functions of the rows (``targets``), so a part that lacks a row leaves that target unjudged.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ainfer_pd.config import POLICIES                 # (their one homes)
from ainfer_pd.sched.priority import PRIORITIES
from ainfer_pd.sched.span import FIXED_SPANS

FIGURES = {"makespan_s": "makespan_s", "p99_ttft_s": "ttft_p99_s", "mean_d_wait_ms": "d_wait_mean_s",
           "bound_ratio": "bound_ratio", "rendezvous": "rendezvous"}
"""Row figure -> summary metric of :func:`ainfer_pd.tools.report.summarize`."""
RUN_DETAIL = ("bound_s", "p_work_s", "d_work_s", "chain_s", "busy_fraction", "concurrent_fraction",
              "both_s", "d_alone_s", "p_alone_s", "idle_s", "d_iter_mean_s", "ttft_p50_s", "requests_per_s",
              "last_traj_tokens", "last_traj_decode_s", "last_traj_token_ms")
"""Summary metrics each run of a row keeps besides its figures: the bound's terms, the device's
busy and concurrent fractions and its window split (P beside D, each alone, idle: metrics.overlap),
and the last trajectory's decode chain (report.last_chain), so that a row says where its time went
without its log."""


def parse_variant(name: str) -> tuple[str, str, str | None]:
    """``fine-grained/K=2+critical-path`` -> (policy, priority, span)."""
    base, _, prio = name.partition("+")
    policy, _, span = base.partition("/K=")
    return policy, prio or "fifo", span or None


def _figure(agg: dict[str, Any], metric: str, scale: float = 1.0) -> dict[str, Any]:
    m = agg.get(metric) or {}
    med, iqr = m.get("median"), m.get("iqr")
    ok = isinstance(med, (int, float)) and math.isfinite(med)
    return {"median": med * scale if ok else None,
            "iqr": iqr * scale if ok and isinstance(iqr, (int, float)) and math.isfinite(iqr) else None,
            "n": int(m.get("n", 0) or 0)}


def _figures(agg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every row figure of an aggregate (:func:`ainfer_pd.tools.report.aggregate`), D wait in ms."""
    return {fig: _figure(agg, metric, 1e3 if fig == "mean_d_wait_ms" else 1.0) for fig, metric in FIGURES.items()}


def cell_prefix(workload: str | None = None, *, decode_only: bool = False) -> str:
    """What a row's cell starts with for its workload: ``""`` for the paper trace (the ladder's
    rows of record), ``decode-only/`` for the control, ``WORKLOAD/`` for any other (``grpo-long/``)."""
    if decode_only or workload == "decode-only":
        return "decode-only/"
    return "" if workload in (None, "paper") else f"{workload}/"


def rows_of(results: dict[str, Any], *, decode_only: bool = False, variant: str | None = None,
            workload: str | None = None) -> list[dict[str, Any]]:
    """The ladder rows of one ``ainfer-pd bench`` results.json; ``variant`` labels rows run with a
    lever set on top of the ladder's settings (e.g. a stream priority): the targets skip them.
    ``workload``: the bench's ``--workload`` (its rows' cells get :func:`cell_prefix`)."""
    rows = []
    prefix = cell_prefix(workload, decode_only=decode_only)
    for cell, per_variant in results["aggregates"].items():
        for name, agg in per_variant.items():
            policy, prio, span = parse_variant(name)
            row: dict[str, Any] = {"cell": prefix + cell, "policy": policy,
                                   "priority": prio, "span": span, "variant": variant, **_figures(agg)}
            row["output_mismatches"] = results.get("output_mismatches", {}).get(cell, {}).get(name)
            runs = results.get("summaries", {}).get(cell, {}).get(name)
            if runs:                     # each run's figures, so that merge can pool repeats of two parts
                row["runs"] = [{m: s[m] for m in (*FIGURES.values(), *RUN_DETAIL) if isinstance(s.get(m), (int, float))}
                               for s in runs]
            rows.append(row)
    return rows


def pooled(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One row from two rows of the same (cell, policy, priority, span, variant) and commit, each
    with its ``runs``: every figure's median and IQR over the runs of both (repeats measured in two
    parts or two device calls)."""
    from ainfer_pd.tools.report import aggregate
    runs = [*a["runs"], *b["runs"]]
    row = {**a, "runs": runs, **_figures(aggregate(runs))}
    mism = [r.get("output_mismatches") for r in (a, b) if r.get("output_mismatches") is not None]
    row["output_mismatches"] = sum(mism) if mism else None
    return row


def _results(summaries: dict[str, dict[str, list]]) -> dict[str, Any]:
    """What results.json would hold for per-run ``summaries`` (cell -> variant -> [summary])."""
    from ainfer_pd.tools.report import aggregate
    return {"summaries": summaries, "trace": None,
            "aggregates": {c: {v: aggregate(ss) for v, ss in per.items()} for c, per in summaries.items()}}


def results_from_runs(path: Path) -> dict[str, Any]:
    """What results.json would hold, from the per-run lines of runs.jsonl (a bench cut short)."""
    summaries: dict[str, dict[str, list]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            summaries.setdefault(d["cell"], {}).setdefault(d["variant"], []).append(d["summary"])
    return _results(summaries)


RUN_LINE = re.compile(r"^\[\d+/\d+\] (?P<cell>\S+) (?P<variant>\S+) #\d+: makespan (?P<makespan>[\d.]+) s, "
                      r"[\d.]+ req/s, p99 TTFT (?P<ttft>[\d.]+) s, D wait (?P<dwait>[\d.]+) ms")


def results_from_log(text: str) -> dict[str, Any]:
    """What results.json would hold, from a bench log's per-run lines after its last timed command
    (the warm-up's lines before it are skipped)."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("+ ") and "warm-up" not in ln]
    summaries: dict[str, dict[str, list]] = {}
    for ln in lines[(starts[-1] if starts else 0):]:
        m = RUN_LINE.match(ln)
        if m:
            summaries.setdefault(m["cell"], {}).setdefault(m["variant"], []).append(
                {"makespan_s": float(m["makespan"]), "ttft_p99_s": float(m["ttft"]),
                 "d_wait_mean_s": float(m["dwait"]) / 1e3})
    return _results(summaries)


def from_log(args: argparse.Namespace) -> int:
    if args.log.endswith(".jsonl"):
        res, cmd, source = results_from_runs(Path(args.log)), None, f"runs of {args.log}"
    else:
        text = Path(args.log).read_text()
        res, source = results_from_log(text), f"printed per-run lines of {args.log}"
        cmd = next((ln[2:] for ln in reversed(text.splitlines()) if ln.startswith("+ ") and "warm-up" not in ln), None)
    if not res["summaries"]:
        print(f"{args.log}: no per-run lines", file=sys.stderr)
        return 1
    part = {"commit": args.commit, "config": args.config, "machine": args.machine, "part": args.part,
            "command": cmd, "rc": None, "wall_s": None, "source": source,
            "workload": None if args.workload == "paper" else {"workload": args.workload},
            "variant": args.variant,
            "rows": rows_of(res, decode_only=args.decode_only, variant=args.variant, workload=args.workload)}
    part["targets"] = targets(part["rows"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ladder_{args.part}.json").write_text(json.dumps(part, indent=1))
    _print(part)
    return 0


CELLS = ("P1", "trace")
GRPO = "grpo-long"
"""The long-context agentic workload's name (``ainfer-pd bench --workload grpo-long``) and its rows' cell prefix."""
GRPO_CELLS = tuple(f"{GRPO}/{c}" for c in CELLS)
GRPO_ROWS = (*((p, "fifo") for p in POLICIES), ("normal", "critical-path"), ("fine-grained", "critical-path"))
"""The (policy, priority) rows owed on the long-context workload: every policy with fifo (the bound
target judges each), normal and fine-grained with critical-path."""
WORKLOADS = ("paper", GRPO)
"""The workloads ``plan`` owes rows for by default."""
GRPO_BOUND_TARGET = 1.2
"""Issue 33: makespan / optimistic bound on the long-context workload, every policy."""
GRPO_WORKLOAD = {"conversations": 64, "group_size": 8, "max_turns": 6, "token_scale": 1.0}
"""The long-context workload of record (h200_ladder.sh's grpo-long parts): 8 groups x 8 siblings,
2-6 turns, token scale 1 (~240 requests, ~290K prefilled / ~41K generated tokens)."""
SPANS = (*(str(k) for k in FIXED_SPANS), "auto")
"""The span sweep; its ``measured`` point is the plain fine-grained row (the ladder sets mux.span=measured)."""
WARMUP_S = 45.0
"""The untimed warm-up run of a call's first ``ladder.py run`` (Triton compile cache; the later parts
of a call skip it). H200, session 12: a first part's time less a later part's of the same runs, 42-48 s."""
PART_S = 18.0
"""What every part pays besides its runs: the bench process's start and the plots (H200, session 12:
a part's time less its bench's per-run walls, 15-20 s)."""
RUN_S = {"normal": 47.0, "global-complete": 48.0, "global-enqueue": 40.0, "fine-grained": 40.0,
         "mixed-chunked": 50.0}
"""One run of a policy inside one bench process, fresh worker included (H200, sessions 11-12 at
d8f52c0: three runs in 139-151 s for normal / global-complete / mixed-chunked, in 108-125 s for
fine-grained / global-enqueue; a makespan of 38-42 s against 32-34 s)."""
SPAN_RUN_S = 41.0
"""One run of the span sweep (H200, session 12: ten runs in 412 s of one bench process)."""
GRPO_RUN_S = {"normal": 51.0, "global-complete": 52.0, "global-enqueue": 47.0, "fine-grained": 47.0,
              "mixed-chunked": 55.0}
"""One run of a policy on the long-context workload (H200 at 339f36e, grpo-long/P1 n=1: normal and
fine-grained in 96 s of one bench process, makespans 43.9 and 39.8 s; the other three scaled from
their trace runs, not measured)."""


def missing_runs(rows: list[dict[str, Any]], repeats: int = 3, commit: str | None = None,
                 workloads: Iterable[str] = WORKLOADS) -> list[tuple[str, str, str, str | None, int]]:
    """(cell, policy, priority, span, runs still owed) of every issue row with fewer than ``repeats``
    makespan repeats in ``rows`` (labelled lever rows do not count; with ``commit``, nor do rows of
    another commit). The span sweep is fine-grained critical-path on P1. ``workloads``: ``paper``
    (the trace's rows and the span sweep) and / or ``grpo-long`` (:data:`GRPO_ROWS` on its cells)."""
    workloads = tuple(workloads)
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}: expected some of {', '.join(WORKLOADS)}")
    have: dict[tuple, int] = {}
    for r in rows:
        if r.get("variant") is None and (commit is None or r.get("commit") == commit):
            key = (r["cell"], r["policy"], r["priority"], r["span"])
            have[key] = max(have.get(key, 0), int(r["makespan_s"].get("n") or 0))
    want: list[tuple[str, str, str, str | None]] = []
    if "paper" in workloads:
        want += [(c, p, q, None) for c in CELLS for p in POLICIES for q in PRIORITIES]
        want += [("P1", "fine-grained", "critical-path", k) for k in SPANS]
    if GRPO in workloads:
        want += [(c, p, q, None) for c in GRPO_CELLS for p, q in GRPO_ROWS]
    return [(*k, repeats - have.get(k, 0)) for k in want if have.get(k, 0) < repeats]


def plan_calls(missing: list[tuple[str, str, str, str | None, int]], *, budget_s: float = 520.0,
               run_s: float | None = None, span_run_s: float = SPAN_RUN_S) -> list[list[dict[str, Any]]]:
    """Pack the owed runs into device calls of at most ``budget_s``: each call a list of
    ``h200_ladder.sh`` parts ``{"part", "env", "runs", "est_s"}``, one part per (cell, priority,
    repeats) with the policies (or spans) that share them. A part that does not fit a call is split
    by policy. A part's estimate is the warm-up (:data:`WARMUP_S`; ``ladder_call.sh`` takes it off
    every part after a call's first), :data:`PART_S` and its runs: :data:`RUN_S` of the policy
    (``run_s``: one figure for every policy instead) or ``span_run_s`` a span; on the long-context
    workload (parts ``grpo-long-p1`` / ``grpo-long-trace``) :data:`GRPO_RUN_S`."""
    def cost(kind: str, name: str) -> float:
        if kind == "spans":
            return span_run_s
        table = GRPO_RUN_S if kind.startswith(f"{GRPO}-") else RUN_S
        return run_s if run_s is not None else table.get(name, max(table.values()))

    def est(kind: str, owed: int, names: list[str]) -> float:
        return WARMUP_S + PART_S + owed * sum(cost(kind, n) for n in names)

    groups: dict[tuple, list[str]] = {}
    for cell, policy, prio, span, owed in missing:
        kind = "spans" if span is not None else cell.lower().replace("/", "-")     # grpo-long/P1: grpo-long-p1
        groups.setdefault((kind, prio, owed), []).append(span if span is not None else policy)
    parts: list[dict[str, Any]] = []
    for (kind, prio, owed), names in groups.items():
        chunks: list[list[str]] = [[]]
        for name in names:          # names in order, a new part when the next would not fit a call
            if chunks[-1] and est(kind, owed, [*chunks[-1], name]) > budget_s:
                chunks.append([])
            chunks[-1].append(name)
        for chunk in chunks:
            env = {"REPEATS": str(owed), "PRIORITIES": prio}
            env["SPANS" if kind == "spans" else "POLICIES"] = ",".join(chunk)
            env["SUFFIX"] = f"{prio}-{len(parts)}"      # unique: two parts of a call never share a file
            parts.append({"part": "spans" if kind == "spans" else kind, "env": env, "runs": owed * len(chunk),
                          "est_s": est(kind, owed, chunk)})
    calls: list[list[dict[str, Any]]] = []
    for part in sorted(parts, key=lambda p: -p["est_s"]):          # first fit, largest first
        for call in calls:
            if sum(p["est_s"] for p in call) + part["est_s"] <= budget_s:
                call.append(part)
                break
        else:
            calls.append([part])
    return calls


def plan(args: argparse.Namespace) -> int:
    doc = json.loads(Path(args.latest).read_text())
    owed = missing_runs(doc["rows"], args.repeats, commit=args.commit, workloads=_csv(args.workloads))
    calls = plan_calls(owed, budget_s=args.budget_s, run_s=args.run_s, span_run_s=args.span_run_s)
    total = sum(p["runs"] for c in calls for p in c)
    print(f"{len(owed)} rows owed, {total} runs, {len(calls)} device calls of <= {args.budget_s:.0f} s "
          f"(~{sum(p['est_s'] for c in calls for p in c) / 60:.0f} device-minutes):")
    for i, call in enumerate(calls, 1):
        print(f"call {i} (~{sum(p['est_s'] for p in call):.0f} s):")
        specs = []
        for p in call:
            env = " ".join(f"{k}={v}" for k, v in p["env"].items())
            print(f"  {env} bash benchmarks/h200_ladder.sh COMMIT {p['part']}")
            specs.append(f'"{p["est_s"]:.0f}|{env}|{p["part"]}"')
        print(f"  as one call: OUT=$OUT bash benchmarks/ladder_call.sh COMMIT {args.budget_s:.0f} {' '.join(specs)}")
    return 0


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _med(rows: Iterable[dict[str, Any]], fig: str, **match: Any) -> float | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            v = r[fig]["median"]
            return v if isinstance(v, (int, float)) else None
    return None


def _find(rows: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _settings(variant: str | None) -> frozenset[str]:
    """The KEY=VALUE settings of a variant label (``run``'s --variant; h200_ladder.sh joins them with +)."""
    return frozenset(variant.split("+")) if variant else frozenset()


DEFAULT_PATH = "default"
"""``--data-path default``: the data path is the commit's defaults (the plain rows), and fine-grained's
lever rows on top of it are judged too."""


def _path_settings(data_path: str) -> frozenset[str]:
    """The settings a data path's rows were run with on top of the commit's defaults."""
    return frozenset() if data_path == DEFAULT_PATH else _settings(data_path)


def without_defaults(variant: str | None, defaults: str | None) -> str | None:
    """``variant`` less the settings ``defaults`` names (KEY=VALUE[+...], the settings that are the
    defaults of the rows' commits); ``None`` where nothing is left: the row is a plain row."""
    left = [kv for kv in (variant.split("+") if variant else []) if kv not in _settings(defaults)]
    return "+".join(left) or None


def data_path_view(rows: list[dict[str, Any]], data_path: str) -> list[dict[str, Any]]:
    """The plain rows (no span) as they stand on the data path ``data_path`` (a variant label, e.g.
    ``scheduler.overlap_decode=true``): per (cell, policy, priority), the row run with exactly
    those settings; for fine-grained, every row run with those settings and any more on top (its
    scheduling levers), fastest first, each judged by the targets; where a policy has no such row
    (mixed-chunked refuses the overlapped loop), its plain row stands in, marked ``"stand_in": True``."""
    base = _path_settings(data_path)
    plain = [r for r in rows if r["span"] is None and not r["cell"].startswith("decode-only/")]
    keys = sorted({(r["cell"], r["policy"], r["priority"]) for r in plain})
    view = []
    for cell, policy, prio in keys:
        same = [r for r in plain if (r["cell"], r["policy"], r["priority"]) == (cell, policy, prio)]
        on = [r for r in same if _settings(r.get("variant")) == base or (
              policy == "fine-grained" and _settings(r.get("variant")) > base)]
        on = [r for r in on if r["makespan_s"]["median"] is not None]
        if on and policy == "fine-grained":
            view += sorted(on, key=lambda r: r["makespan_s"]["median"])
        elif on:
            view.append(min(on, key=lambda r: r["makespan_s"]["median"]))
        elif (p := _find(same, variant=None)) is not None:
            view.append({**p, "stand_in": True})
    return view


def targets(rows: list[dict[str, Any]], data_path: str | None = None) -> list[dict[str, Any]]:
    """The issue's targets over ``rows``; one entry per (cell, target) whose rows exist. With
    ``data_path`` (a variant label), the ratio targets over :func:`data_path_view` instead of the
    plain rows: each entry's name starts with ``[data_path]``, names the fine-grained row's extra
    settings, and lists the stand-ins it compares."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, target: float, le: bool = True,
            of: Iterable[dict] = ()) -> dict[str, Any] | None:
        """One target (returned; None without a value); ``of``: the rows a ratio compares. Rows
        measured at different commits (a merge of parts) are not compared: the entry says so and
        is neither met nor missed."""
        if value is None:
            return None
        commits = sorted({r["commit"] for r in of if r is not None and r.get("commit")})
        t = {"name": name, "value": round(value, 4), "target": target,
             "met": bool(value <= target if le else value >= target)}
        if len(commits) > 1:
            t.update(met=None, commits=commits)
        if data_path is not None:
            t["name"] = f"[{data_path}] {name}"
            t["stand_ins"] = [f"{r['policy']}-{r['priority']}: its plain row (no {data_path} row)"
                              for r in of if r is not None and r.get("stand_in")]
        out.append(t)
        return t

    if data_path is not None:
        plain = data_path_view(rows, data_path)
        rows = []                                   # the span sweep and decode-only: plain rows only
    else:
        rows = [r for r in rows if r.get("variant") is None]
        plain = [r for r in rows if r["span"] is None]
    for cell in sorted({r["cell"] for r in plain if not r["cell"].startswith("decode-only/")}):
        c = [r for r in plain if r["cell"] == cell]
        normal = _med(c, "makespan_s", policy="normal", priority="fifo")
        mixed = _med(c, "makespan_s", policy="mixed-chunked", priority="fifo")
        enq_row = min((r for p in ("fifo", "critical-path")
                       if (r := _find(c, policy="global-enqueue", priority=p)) is not None
                       and _med([r], "makespan_s") is not None),
                      key=lambda r: r["makespan_s"]["median"], default=None)
        enq = enq_row["makespan_s"]["median"] if enq_row is not None else None
        fg_rows = [r for r in c if r["policy"] == "fine-grained" and _med([r], "makespan_s") is not None]
        if data_path is None:        # the best priority; on a data path, every fine-grained row on it (its levers)
            fg_rows = sorted(fg_rows, key=lambda r: r["makespan_s"]["median"])[:1]
        else:
            fg_rows = [r for r in fg_rows if not r.get("stand_in")]
        n_row = _find(c, policy="normal", priority="fifo")
        for fg_row in fg_rows:
            best, prio = fg_row["makespan_s"]["median"], fg_row["priority"]
            label = prio            # the row's priority, and on a data path its levers on top
            if data_path is not None and fg_row.get("variant"):
                label += "".join(f", {kv}" for kv in sorted(_settings(fg_row["variant"]) - _path_settings(data_path)))
            fg_bound = _med([fg_row], "bound_ratio")
            if normal:
                t = add(f"{cell}: fine-grained ({label}) / normal-fifo makespan", best / normal, 0.80,
                        of=(fg_row, n_row))
                if fg_bound:       # fine-grained's own optimistic bound (SPEC §5) over normal: the ratio's floor
                    t["floor"] = round(best / fg_bound / normal, 4)
                ttft_n = _med(c, "p99_ttft_s", policy="normal", priority="fifo")
                ttft_f = _med([fg_row], "p99_ttft_s")
                if ttft_n and ttft_f is not None:
                    add(f"{cell}: fine-grained ({label}) / normal-fifo p99 TTFT", ttft_f / ttft_n, 1.05,
                        of=(fg_row, n_row))
            if mixed:
                add(f"{cell}: fine-grained ({label}) / mixed-chunked-fifo makespan", best / mixed, 0.90,
                    of=(fg_row, _find(c, policy="mixed-chunked", priority="fifo")))
            if enq:
                add(f"{cell}: fine-grained ({label}) faster than global-enqueue by", 1 - best / enq, 0.15, le=False,
                    of=(fg_row, enq_row))
            if not cell.startswith(f"{GRPO}/"):        # there: every policy's, below
                add(f"{cell}: fine-grained ({label}) makespan / optimistic bound", fg_bound, 1.3)
        if cell.startswith(f"{GRPO}/"):
            for r in c:
                label = r["priority"] + "".join(f", {kv}" for kv in sorted(
                    _settings(r.get("variant")) - (_path_settings(data_path) if data_path else frozenset())))
                add(f"{cell}: {r['policy']} ({label}) makespan / optimistic bound", _med([r], "bound_ratio"),
                    GRPO_BOUND_TARGET, of=(r,))
    spans = [r for r in rows if r["span"] is not None and r["policy"] == "fine-grained"]
    for cell in sorted({r["cell"] for r in spans}):
        fixed_rows = [r for r in spans if r["cell"] == cell and r["span"] in "1234"
                      and r["makespan_s"]["median"] is not None]
        fixed = [r["makespan_s"]["median"] for r in fixed_rows]
        auto = _med(spans, "makespan_s", cell=cell, span="auto")
        if fixed and auto is not None:
            add(f"{cell}: span auto / best fixed span makespan", auto / min(fixed), 1.01,
                of=[*fixed_rows, _find(spans, cell=cell, span="auto")])
        # the ladder's own span is mux.span=measured (h200_ladder.sh): its plain fine-grained row
        prio = next(r["priority"] for r in spans if r["cell"] == cell)
        measured = _med(plain, "makespan_s", cell=cell, policy="fine-grained", priority=prio)
        if fixed and measured is not None:
            add(f"{cell}: span measured ({prio}) / best fixed span makespan", measured / min(fixed), 1.01,
                of=[*fixed_rows, _find(plain, cell=cell, policy="fine-grained", priority=prio)])
    for r in rows:
        if r["cell"].startswith("decode-only/") and r["policy"] == "fine-grained":
            n = _med(rows, "makespan_s", cell=r["cell"], policy="normal", priority=r["priority"])
            if n and r["makespan_s"]["median"] is not None:
                add(f"{r['cell']}: fine-grained / normal makespan (decode only)", r["makespan_s"]["median"] / n, 1.01,
                    of=(r, _find(rows, cell=r["cell"], policy="normal", priority=r["priority"])))
                add(f"{r['cell']}: fine-grained rendezvous (decode only)", r["rendezvous"]["median"], 0.0)
    return out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bdir = Path(args.work) / args.part
    cmd = [sys.executable, "-m", "ainfer_pd.tools.cli", "bench", "--config", args.config,
           "--cells", args.cells, "--policies", args.policies, "--priorities", args.priorities,
           "--repeats", str(args.repeats), "--conversations", str(args.conversations),
           "--max-turns", str(args.max_turns), "--token-scale", str(args.token_scale),
           "--seed", str(args.seed), "--out", str(bdir), "--no-progress"]
    if args.time_scale is not None:
        cmd += ["--time-scale", str(args.time_scale)]
    if args.spans:
        cmd += ["--spans", args.spans]
    if args.decode_only:
        cmd += ["--workload", "decode-only"]
    elif args.workload != "paper":
        cmd += ["--workload", args.workload]
        if args.group_size:
            cmd += ["--group-size", str(args.group_size)]
    for kv in args.set:
        cmd += ["--set", kv]
    budget = []                          # a trainer's response budget: turns end at the model's EOS
    if args.response_budget:
        budget = ["--response-budget", str(args.response_budget)]
        budget += ["--eos-every", str(args.eos_every)] if args.eos_every else []
    cmd += budget
    if args.warmup:                      # Triton's compile cache (on disk) filled before the timed runs
        warm = cmd[:cmd.index("--repeats")] + ["--repeats", "1", "--conversations", "4", "--max-turns", "2",
                                               "--token-scale", str(args.token_scale), "--seed", "99",
                                               "--out", str(bdir) + "-warmup", "--no-progress"]
        warm = [a if a != args.cells else args.cells.split(",")[0] for a in warm]
        if args.workload != "paper" and not args.decode_only:
            # its kernels and graphs (the long-context workload's graphs cover 16K: --set) compiled too
            warm += ["--workload", args.workload, *(["--group-size", str(args.group_size)] if args.group_size else [])]
            for kv in args.set:
                warm += ["--set", kv]
        warm += budget
        print("+ (warm-up)", " ".join(warm), flush=True)
        subprocess.call(warm, stdout=subprocess.DEVNULL)
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    res_file, runs_file = bdir / "results.json", bdir / "runs.jsonl"
    if res_file.exists():
        res = json.loads(res_file.read_text())
    elif runs_file.exists() and runs_file.stat().st_size:
        res = results_from_runs(runs_file)          # cut short: the runs that completed
        print(f"bench ended early (rc {rc}): rows from the {sum(len(v) for c in res['summaries'].values() for v in c.values())}"
              " runs it completed", file=sys.stderr)
    else:
        print(f"bench wrote no results (rc {rc})", file=sys.stderr)
        return rc or 1
    part = {"commit": args.commit, "config": args.config, "machine": _machine(), "part": args.part,
            "command": " ".join(cmd), "rc": rc, "wall_s": round(wall, 1),
            "workload": {"conversations": args.conversations, "max_turns": args.max_turns,
                         "token_scale": args.token_scale, "seed": args.seed, "sets": args.set,
                         "decode_only": args.decode_only, "trace": res.get("trace"),
                         **({"workload": args.workload, "group_size": args.group_size}
                            if args.workload != "paper" else {})},
            "variant": args.variant,
            "rows": rows_of(res, decode_only=args.decode_only, variant=args.variant, workload=args.workload)}
    part["targets"] = targets(part["rows"])
    (out / f"ladder_{args.part}.json").write_text(json.dumps(part, indent=1))
    # beside it: the per-request records, and bench's plots (the first repeat's timeline per variant)
    if runs_file.exists():
        shutil.copyfile(runs_file, out / f"runs_{args.part}.jsonl")
    for png in sorted(bdir.glob("*.png")):
        shutil.copyfile(png, out / f"{args.part}_{png.name}")
    _print(part)
    return rc


def merge(args: argparse.Namespace) -> int:
    parts = [json.loads(Path(p).read_text()) for p in args.parts]
    # each row keeps its part's commit; a later part's row of the same (cell, policy, priority,
    # span, variant) supersedes an earlier one (a re-measure after a data-path change), unless both
    # are of one commit and carry their runs: then they are pooled (repeats of two parts)
    by_key: dict[tuple, dict[str, Any]] = {}
    superseded = []
    for p in parts:
        for r in p["rows"]:
            if args.defaults:
                r = {**r, "variant": without_defaults(r.get("variant"), args.defaults)}
            key = tuple(r.get(k) for k in ("cell", "policy", "priority", "span", "variant"))
            old = by_key.get(key)
            if old is not None and old["commit"] == p["commit"] and old.get("runs") and r.get("runs"):
                by_key[key] = pooled(old, {**r, "commit": p["commit"]})
                continue
            if old is not None:
                superseded.append({**by_key.pop(key), "superseded_by": p["commit"]})
            by_key[key] = {**r, "commit": p["commit"]}
    rows = list(by_key.values())
    commits = sorted({p["commit"] for p in parts})
    doc = {"commit": commits[0] if len(commits) == 1 else commits, "config": sorted({p["config"] for p in parts}),
           "machine": parts[0]["machine"] if parts else None,
           "parts": [{k: p.get(k) for k in ("part", "commit", "command", "rc", "wall_s", "workload", "source")}
                     for p in parts],
           "rows": rows, "targets": targets(rows), "superseded": superseded}
    if args.defaults:
        doc["defaults"] = args.defaults
    if args.data_path:
        doc["data_path"] = args.data_path
        doc["targets_data_path"] = targets(rows, data_path=args.data_path)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    _print(doc)
    return 0


def _machine() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def _fmt(f: dict[str, Any]) -> str:
    if f["median"] is None:
        return "-"
    return f"{f['median']:.3f}" + (f" ±{f['iqr']:.3f}" if f["iqr"] else "")


def chain_ms(row: dict[str, Any]) -> str:
    """The row's ms a token along its last trajectory's decode chain (``report.last_chain``): the
    median over the runs that carry it, with how many of the row's runs do ("-" when none)."""
    v = [x["last_traj_token_ms"] for x in row.get("runs", [])
         if isinstance(x.get("last_traj_token_ms"), (int, float))]
    if not v:
        return "-"
    return f"{statistics.median(v):.2f} ({len(v)}/{len(row['runs'])})"


def _print(doc: dict[str, Any]) -> None:
    print(f"{'cell':<16}{'policy':<17}{'priority':<14}{'span':<6}{'makespan s':<18}{'p99 TTFT s':<18}"
          f"{'D wait ms':<16}{'/bound':<14}{'rdv':<18}chain ms/token")
    for r in doc["rows"]:
        cell = r["cell"] + (f"[{r['variant']}]" if r.get("variant") else "")
        print(f"{cell:<16}{r['policy']:<17}{r['priority']:<14}{r['span'] or '-':<6}{_fmt(r['makespan_s']):<18}"
              f"{_fmt(r['p99_ttft_s']):<18}{_fmt(r['mean_d_wait_ms']):<16}{_fmt(r['bound_ratio']):<14}"
              f"{_fmt(r['rendezvous']):<18}{chain_ms(r)}")
    for t in [*doc["targets"], *doc.get("targets_data_path", [])]:
        verdict = "N/A " if t["met"] is None else "MET " if t["met"] else "MISS"
        across = f"; not compared: rows of commits {', '.join(c[:7] for c in t['commits'])}" if t["met"] is None else ""
        stand_in = f"; {'; '.join(t['stand_ins'])}" if t.get("stand_ins") else ""
        stand_in += f"; floor {t['floor']} (fine-grained's optimistic bound / normal)" if t.get("floor") else ""
        print(f"{verdict} {t['name']}: {t['value']} (target {t['target']}{across}{stand_in})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--commit", default="unknown")
    r.add_argument("--part", default="p1")
    r.add_argument("--out", default="docs/results/ladder")
    r.add_argument("--work", default="/tmp/ladder", help="bench output (plots, runs.jsonl) stays here")
    r.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    r.add_argument("--cells", default="P1")
    r.add_argument("--policies", default=",".join(POLICIES))
    r.add_argument("--priorities", default="fifo,critical-path")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--spans")
    r.add_argument("--decode-only", action="store_true")
    r.add_argument("--workload", choices=WORKLOADS, default="paper",
                   help="grpo-long: the long-context agentic workload (rows grpo-long/CELL; --conversations "
                        "trajectories in groups of --group-size)")
    r.add_argument("--group-size", type=int, help="grpo-long: siblings per prompt group (bench's default 8)")
    r.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short untimed run that fills Triton's compile cache first")
    r.add_argument("--conversations", type=int, default=64)
    r.add_argument("--max-turns", type=int, default=4)
    r.add_argument("--token-scale", type=float, default=1.0)
    r.add_argument("--time-scale", type=float)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--response-budget", type=int, help="bench's --response-budget: each turn asks for R tokens and "
                   "ends at the model's EOS (label the rows with --variant)")
    r.add_argument("--eos-every", type=int, help="bench's --eos-every: the random-weight model's EOS set, a turn's mean length")
    r.add_argument("--variant", help="label of the rows (a lever set with --set on top of the ladder's); "
                                     "labelled rows are reported, not judged by the targets")
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="+")
    m.add_argument("--out", default="docs/results/ladder/latest.json")
    m.add_argument("--data-path", help="a variant (KEY=VALUE[+KEY=VALUE...]) that is the data path of record: "
                                       "the targets are judged a second time over its rows (see targets); "
                                       "'default': the plain rows, fine-grained's lever rows on top")
    m.add_argument("--defaults", help="KEY=VALUE[+...]: settings that are the defaults at the rows' commits; "
                                      "they are dropped from each row's variant (a row left with none is plain)")
    pl = sub.add_parser("plan")
    pl.add_argument("--latest", default="docs/results/ladder/latest.json")
    pl.add_argument("--budget-s", type=float, default=520.0)
    pl.add_argument("--commit", help="count only this commit's rows as measured")
    pl.add_argument("--run-s", type=float, default=None, help="one run's seconds for every policy (default: RUN_S by policy)")
    pl.add_argument("--span-run-s", type=float, default=SPAN_RUN_S)
    pl.add_argument("--repeats", type=int, default=3)
    pl.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated workloads whose rows are owed (default {','.join(WORKLOADS)})")
    g = sub.add_parser("from-log")
    g.add_argument("log")
    g.add_argument("--commit", required=True)
    g.add_argument("--part", required=True)
    g.add_argument("--out", default="docs/results/ladder")
    g.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    g.add_argument("--machine", default="NVIDIA H200")
    g.add_argument("--variant", help="label of the rows, as run's --variant")
    g.add_argument("--decode-only", action="store_true", help="the rows of a decode-only run, as run's --decode-only")
    g.add_argument("--workload", choices=WORKLOADS, default="paper", help="the rows' workload, as run's --workload")
    args = ap.parse_args(argv)
    return {"run": run, "merge": merge, "from-log": from_log, "plan": plan}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
