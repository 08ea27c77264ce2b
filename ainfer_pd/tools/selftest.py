"""``ainfer-pd selftest``: the SPEC section 7 ordering-contract acceptance list as one command.

Runs the real lockstep engine on the tiny model (``configs/tiny-crossed-cpu.yaml``: the CPU
stand-in's device model of ARCHITECTURE.md; real CPU rank processes, gloo) through the multi-rank replay
(:mod:`ainfer_pd.tools.world`) over :func:`~.selftest_scenarios.table4_trace` (twin conversations on
the two replicas) and prints / saves a summary table:

1. the paper's Table 4 grid (:mod:`.selftest_grid`): ATP2 x ADP2 (g = 4), ATP2 x ADP1 and ATP1 x ADP2
   (g = 2), each under ``none`` / ``global-implicit`` / ``selective`` with the ranks out of phase
   (``faults.phase_skew_ms``, by rank parity unless ``--grid-skew-by replica``): each cell completes
   (tokens vs world size 1, trace-check) or stalls (the watchdog's cycle: ranks and collectives; the
   frontier: completed requests), with its wall time; one table (:func:`format_grid`), each cell
   marked where it differs from the paper;
2. ``selective`` under 20 ms phase skew + random rank skew x ``--seeds`` (5) seeds: completes,
   greedy tokens equal world size 1 on the same trace;
3. ``trace-check`` of every completed run: no violation, registered pairs never overlap while
   other P work overlaps D (and it flags the isolation-only crossed trace);
4. extra checks registered by other modules (:data:`EXTRA_CHECKS`, e.g. the ownership audit).

The table goes to ``--out DIR`` as ``selftest.json`` and ``selftest.md``. Exit code 0 when
every row passed, 1 otherwise. Runtime about 8 minutes on 2 cores (``--no-grid``: about 3).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .selftest_grid import GRID_ORDERINGS, GRID_TOPOLOGIES, format_grid, run_grid
from .selftest_scenarios import TIME_SCALE, crossed_config, single_rank_outputs, small_trace, table4_trace

__all__ = ["EXTRA_CHECKS", "register_check", "crossed_config", "small_trace", "single_rank_outputs", "run_selftest",
           "format_table", "setup_parser", "run"]

Row = dict[str, Any]

EXTRA_CHECKS: list[Callable[[argparse.Namespace], Row | list[Row]]] = []
"""Hook: callables ``check(args) -> row | [rows]`` appended to the table (row keys: ``check``,
``expect``, ``result``, ``ok``; optional ``runs``, ``stalls``, ``violations``)."""


def register_check(fn: Callable[[argparse.Namespace], Row | list[Row]]) -> Callable:
    """Decorator / function adding an extra self-test row producer."""
    EXTRA_CHECKS.append(fn)
    return fn


# ---------------------------------------------------------------------- runner
def _row(check: str, expect: str, result: str, ok: bool, **extra: Any) -> Row:
    return {"check": check, "expect": expect, "result": result, "ok": bool(ok), **extra}


def _stall_row(out: Path, runs: int, timeout_s: float) -> Row:
    from ..errors import RankFailedError, StallError
    from ..launch import spawn
    from .world import rank_replay
    stalled, named = 0, 0
    first = ""
    for i in range(runs):
        cfg = crossed_config(out / f"none-crossed-{i}", **{"parallel.ordering": "none", "parallel.stall_timeout_s": 3.0,
                                                           "parallel.rendezvous_timeout_s": 10.0,
                                                           "faults": {"phase_skew_ms": 30.0, "seed": i}})
        try:
            spawn(rank_replay, 4, (cfg.to_dict(), table4_trace(), "trace", 0, TIME_SCALE), timeout_s,
                  fail_grace_s=20)
            continue
        except RankFailedError as exc:
            errs = exc.results
        if all(isinstance(e, StallError) for e in errs):
            stalled += 1
            msg = str(errs[0])
            named += "peers not joined" in msg and "P all_reduce attn_tp.P" in msg and "attn_dp.D" in msg
            first = first or msg.splitlines()[-1]
    return _row("crossed g=4 ATP2/ADP2, ordering none, replicas out of phase", "stalls; watchdog names the frontier",
                f"stalled {stalled}/{runs} (every rank StallError), frontier named in {named}/{runs}; {first}",
                stalled == named == runs, runs=runs, stalls=stalled)


def _complete(name: str, out: Path, cfg: Any, trace: Any, ref: dict, timeout_s: float) -> tuple[Row, Path | None]:
    from .world import run_world
    ws = cfg.parallel.world_size
    try:
        res = run_world(cfg, trace, ws, cell="trace", seed=0, time_scale=TIME_SCALE, timeout_s=timeout_s)
    except Exception as exc:  # a failed run is a failed row
        return _row(name, "completes, tokens = world size 1", f"FAILED: {type(exc).__name__}: {str(exc)[:300]}",
                    False, runs=1, stalls=1), None
    same = res.outputs == ref
    return _row(name, "completes, tokens = world size 1",
                f"{res.completed}/{res.planned_requests} requests in {res.makespan_s:.1f} s; greedy tokens equal "
                f"world size 1: {same}", res.failures == 0 and same, runs=1, stalls=0), Path(cfg.trace_dir)


# ---------------------------------------------------------------------- the acceptance list
def run_selftest(out: str | Path, *, stall_runs: int = 2, seeds: int = 5, skew_ms: float = 20.0,
                 timeout_s: float = 200.0, args: argparse.Namespace | None = None, grid: bool = True,
                 grid_skew_ms: float = 30.0, grid_skew_by: str = "rank",
                 progress: Callable[[str], None] | None = None) -> dict:
    """Run the acceptance list; returns ``{"rows": [...], "grid": [...], "ok": bool, "wall_s": ...}``
    and writes ``selftest.json`` / ``selftest.md`` into ``out``.

    1. the Table 4 grid (:func:`run_grid`; ``grid=False`` skips it and runs the older crossed-stall
       row ``stall_runs`` times instead);
    2. ``selective`` under ``skew_ms`` phase skew + 5 ms random rank skew x ``seeds`` seeds;
    3. trace-check of every completed run, and of the isolation-only crossed trace;
    4. the extra checks (:data:`EXTRA_CHECKS`)."""
    say = progress or (lambda s: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    trace = table4_trace()
    ref = single_rank_outputs(trace)
    rows, traced, cells, isolation_dir = _isolation_rows(out, say, grid=grid, stall_runs=stall_runs,
                                                         timeout_s=timeout_s, grid_skew_ms=grid_skew_ms,
                                                         grid_skew_by=grid_skew_by, trace=trace, ref=ref)
    say(f"2/4 selective under {skew_ms:g} ms phase skew + 5 ms random rank skew x {seeds} seeds ...")
    for s_ in range(seeds):
        cfg = crossed_config(out / f"selective-skew-{s_}", faults={"phase_skew_ms": skew_ms, "d_skew_random_ms": 5.0,
                                                                  "seed": s_})
        row, d_ = _complete(f"crossed, selective, skew seed {s_}", out, cfg, trace, ref, timeout_s)
        rows.append(row)
        traced += [d_] if d_ else []
    say("3/4 trace-check ...")
    rows += _trace_check_rows(traced, isolation_dir)
    say("4/4 extra checks ...")
    rows += _extra_rows(args if args is not None else argparse.Namespace(out=str(out)))
    summary = {"rows": rows, "grid": cells, "ok": all(r["ok"] for r in rows), "wall_s": time.perf_counter() - t0,
               "out": str(out)}
    _write_summary(out, summary)
    return summary


def _isolation_rows(out: Path, say: Callable[[str], None], *, grid: bool, stall_runs: int, timeout_s: float,
                    grid_skew_ms: float, grid_skew_by: str, trace: Any = None,
                    ref: dict | None = None) -> tuple[list[Row], list[Path], list[Row], Path | None]:
    """Step 1: the Table 4 grid (or the older crossed-stall row): its rows, the ordered runs whose
    traces must be clean, the grid's cells, and the isolation-only crossed run trace-check must flag."""
    rows: list[Row] = []
    traced: list[Path] = []
    cells: list[Row] = []
    isolation_dir: Path | None = None
    if grid:
        say(f"1/4 the Table 4 grid: {len(GRID_TOPOLOGIES)} topologies x {', '.join(GRID_ORDERINGS)} "
            f"({grid_skew_ms:g} ms phase skew by {grid_skew_by}) ...")
        cells = run_grid(out, skew_ms=grid_skew_ms, timeout_s=timeout_s, skew_by=grid_skew_by, say=say, trace=trace,
                         ref=ref)
        for c in cells:
            rows.append(_row(f"Table 4: {c['topology']}, ordering {c['ordering']}", f"{c['expect']} (paper)",
                             f"{c['outcome']}: {c.get('detail', '')} ({c['wall_s']:.1f} s)", c["ok"],
                             runs=1, stalls=int(c["outcome"] == "stall")))
            d_ = out / f"grid-{c['topology'].replace(' ', '')}-{c['ordering']}"
            if c["outcome"] == "complete" and c["ordering"] != "none":
                traced.append(d_)               # an ordered run: its trace must be clean
            if c["topology"] == "ATP2 x ADP2" and c["ordering"] == "none":
                isolation_dir = d_              # trace-check must flag it (stalled or not)
    elif stall_runs:
        say("1/4 crossed topology under isolation only, replicas out of phase (expect a stall) ...")
        rows.append(_stall_row(out, stall_runs, timeout_s))
        isolation_dir = out / "none-crossed-0"
    return rows, traced, cells, isolation_dir


def _trace_check_rows(traced: list[Path], isolation_dir: Path | None) -> list[Row]:
    """Step 3: trace-check of the completed ordered runs (clean, registered pairs never overlap, other
    P work overlaps D), and of the isolation-only crossed run (flagged)."""
    from .tracecheck import check_run_dir
    viol = n_rdv = checked = 0
    cost: list[float] = []
    reg_ov = other_ov = 0.0
    for d_ in traced:
        rep = check_run_dir(d_)
        checked += 1
        viol += len(rep["violations"])
        n_rdv += rep["rendezvous_per_rank"]
        if rep["rendezvous_mean_ms"]:
            cost.append(rep["rendezvous_mean_ms"])
        reg_ov += rep["registered_pair_overlap_ms"]
        other_ov += rep["other_p_vs_d_overlap_ms"]
    mean_cost = sum(cost) / len(cost) if cost else 0.0
    rows = [_row("trace-check of the completed engine runs",
                 "0 violations; registered-pair overlap 0; other P/D overlap > 0",
                 f"{checked} runs, {viol} violations, {n_rdv} rendezvous per rank (mean {mean_cost:.2f} ms); "
                 f"registered-pair overlap {reg_ov:.3f} ms, other P work vs D {other_ov:.1f} ms",
                 checked > 0 and viol == 0 and reg_ov == 0.0 and other_ov > 0.0, runs=checked, violations=viol,
                 rendezvous=n_rdv, rendezvous_mean_ms=mean_cost, registered_overlap_ms=reg_ov,
                 other_overlap_ms=other_ov)]
    if isolation_dir is not None and any(isolation_dir.glob("rank*.jsonl")):
        rep = check_run_dir(isolation_dir)
        rows.append(_row("trace-check flags the isolation-only crossed trace", "violations > 0 (no device order)",
                         f"{len(rep['violations'])} violations", len(rep["violations"]) > 0,
                         violations=len(rep["violations"])))
    return rows


def _extra_rows(args: argparse.Namespace) -> list[Row]:
    """Step 4: the rows of :data:`EXTRA_CHECKS` (a check that raises is a failed row)."""
    rows: list[Row] = []
    for fn in EXTRA_CHECKS:
        try:
            got = fn(args)
        except Exception as exc:  # a broken extra check is a failed row, not a crash
            got = _row(getattr(fn, "__name__", "extra check"), "passes", f"raised {type(exc).__name__}: {exc}", False)
        rows.extend(got if isinstance(got, list) else [got])
    return rows


def _write_summary(out: Path, summary: dict) -> None:
    """``selftest.json`` and ``selftest.md`` (the grid, its cells' details, the checks) in ``out``."""
    (out / "selftest.json").write_text(json.dumps(summary, indent=1, default=str))
    md = format_table(summary["rows"], markdown=True) + "\n"
    cells = summary["grid"]
    if cells:
        details = "\n".join(f"- {c['topology']}, {c['ordering']}: {c.get('detail', '')}" for c in cells)
        md = f"## Table 4 grid\n\n{format_grid(cells, markdown=True)}\n\n{details}\n\n## Checks\n\n{md}"
    (out / "selftest.md").write_text(md)


def format_table(rows: list[Row], *, markdown: bool = False) -> str:
    if markdown:
        lines = ["| check | expected | result | pass |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['check']} | {r['expect']} | {r['result']} | {'PASS' if r['ok'] else 'FAIL'} |")
        return "\n".join(lines)
    w = max(len(r["check"]) for r in rows) if rows else 10
    lines = [f"{'check':<{w}}  pass  result"]
    for r in rows:
        lines.append(f"{r['check']:<{w}}  {'PASS' if r['ok'] else 'FAIL'}  {r['result']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
def setup_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="directory for traces and the summary table "
                                                    "(default: a fresh temporary directory)")
    parser.add_argument("--stall-runs", type=int, default=2, help="launches of the crossed stall scenario")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the selective skew scenario")
    parser.add_argument("--no-grid", action="store_true", help="skip the Table 4 grid (run the older crossed-stall "
                                                                  "row --stall-runs times instead)")
    parser.add_argument("--grid-skew-by", choices=("replica", "rank"), default="rank",
                        help="the grid's phase skew: by rank parity (the TP peers of a replica in opposite orders, "
                             "the schedule of the four-rank cycle) or per replica (TP peers share it)")
    parser.add_argument("--skew-ms", type=float, default=20.0, help="phase skew of the replicas (ms)")
    parser.add_argument("--timeout-s", type=float, default=200.0, help="hard deadline of each launch")
    parser.add_argument("--soak", action="store_true",
                        help="instead: the long profile of the public-API property test (issue 13; "
                             "tests/test_property_api.py --soak, needs a repository checkout and pytest)")
    parser.add_argument("--soak-examples", type=int, default=None, help="programs per policy of --soak")
    parser.add_argument("--soak-seed", type=int, default=None, help="seed of --soak (default: random, printed on failure)")


def run_soak(args: argparse.Namespace) -> int:
    """``ainfer-pd selftest --soak``: the property test's long profile, randomized (random seeds
    unless ``--soak-seed``), every policy on one rank and fine-grained on two gloo ranks."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[2]          # the checkout (ainfer_pd/tools/selftest.py)
    test = root / "tests" / "test_property_api.py"
    if not test.exists():
        print(f"ainfer-pd selftest --soak needs the repository's tests ({test} is missing)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.soak_examples is not None:
        env["AINFER_PD_SOAK_EXAMPLES"] = str(args.soak_examples)
    if args.soak_seed is not None:
        env["AINFER_PD_SOAK_SEED"] = str(args.soak_seed)
    cmd = [sys.executable, "-m", "pytest", "-q", str(test), "--soak", "-p", "no:cacheprovider", "-o", "timeout=0"]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd, cwd=root, env=env)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "soak", False):
        return run_soak(args)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ainfer-pd-selftest-"))
    summary = run_selftest(out, stall_runs=args.stall_runs, seeds=args.seeds, skew_ms=args.skew_ms,
                           timeout_s=args.timeout_s, args=args, grid=not getattr(args, "no_grid", False),
                           grid_skew_by=getattr(args, "grid_skew_by", "rank"),
                           progress=lambda s: print(s, file=sys.stderr, flush=True))
    if summary.get("grid"):
        print(format_grid(summary["grid"]) + "\n")
    print(format_table(summary["rows"]))
    print(f"\n{'ALL PASSED' if summary['ok'] else 'FAILED'} in {summary['wall_s']:.0f} s; "
          f"table and traces in {out} (selftest.md, selftest.json)")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="ainfer-pd selftest")
    setup_parser(p)
    sys.exit(run(p.parse_args()))


def _ownership_audit(args: argparse.Namespace) -> Row:
    from .audit_check import ownership_audit_row
    return ownership_audit_row(args)


register_check(_ownership_audit)
