"""``ainfer-pd selftest``: the SPEC section 7 ordering-contract acceptance list as one command.

Runs real CPU ranks (gloo, one process each) through the multi-rank harness
(:mod:`ainfer_pd.multirank.harness`) and prints / saves a summary table:

1. crossed topology (g=4, ATP2/ADP2), replicas out of phase, ``--ordering none``, one residency
   slot: the run stalls (device-progress cycle) and the watchdog reports the frontier;
2. the same with ATP1 (g=4, d=4) and with ADP1 (g=4, d=1): completes;
3. ``selective`` under 20 ms random rank skew x 5 seeds: every turnstile cycle completes;
4. delayed-P ACK: rounds where rendezvous 2 completed while P work was still running > 0;
5. ``trace-check`` of every selective run: no violation, registered pairs never overlap
   while other P work overlaps D (and it does flag the isolation-only trace);
6. ``global-implicit`` completes;
7. extra checks registered by other modules (:data:`EXTRA_CHECKS`, e.g. the ownership audit).

The table goes to ``--out DIR`` as ``selftest.json`` and ``selftest.md``. Exit code 0 when
every row passed, 1 otherwise. Runtime about 1-2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .multirank.harness import HarnessOutcome, HarnessSpec, expected_rounds, run_harness, summarize_error

__all__ = ["EXTRA_CHECKS", "register_check", "stall_spec", "selective_specs", "run_selftest",
           "format_table", "setup_parser", "run"]

Row = dict[str, Any]

EXTRA_CHECKS: list[Callable[[argparse.Namespace], Row | list[Row]]] = []
"""Hook: callables ``check(args) -> row | [rows]`` appended to the table (row keys: ``check``,
``expect``, ``result``, ``ok``; optional ``runs``, ``cycles``, ``stalls``, ``violations``)."""


def register_check(fn: Callable[[argparse.Namespace], Row | list[Row]]) -> Callable:
    """Decorator / function adding an extra self-test row producer."""
    EXTRA_CHECKS.append(fn)
    return fn


# ---------------------------------------------------------------------- scenarios
def stall_spec(**kw: Any) -> HarnessSpec:
    """The crossed-order hazard: g=4 ATP2/ADP2, replicas out of phase, isolation only, one slot.
    Long enough that the cycle forms (measured: within the first ~50 D iterations)."""
    base = dict(world_size=4, attn_dp=2, ordering="none", residency_slots=1, epochs=25, segments=6,
                d_iters=200, jitter_ms=2.0, stall_s=2.0, tag="stall")
    base.update(kw)
    return HarnessSpec(**base)


def selective_specs(out: Path | None, *, seeds: int = 5, skew_ms: float = 20.0, **kw: Any) -> list[HarnessSpec]:
    """``seeds`` selective runs under random rank skew (one slot), one delayed-P run with two
    slots (overlap + delayed ACK), one global-implicit run; same topology (g=4 ATP2/ADP2)."""
    base = dict(world_size=4, attn_dp=2, residency_slots=1, epochs=4, segments=6, d_iters=12,
                stall_s=8.0, rendezvous_timeout_s=10.0)
    base.update(kw)

    def rd(name: str) -> str | None:
        return str(out / name) if out is not None else None

    specs = [HarnessSpec(ordering="selective", seed=s, skew_ms=skew_ms, skew_mode="random",
                         run_dir=rd(f"selective-skew-seed{s}"), tag=f"sel{s}", **base) for s in range(seeds)]
    specs.append(HarnessSpec(ordering="selective", seed=100, residency_slots=2, p_delay_ms=4.0, p_reps=6,
                             run_dir=rd("selective-delayed-p"), tag="delayed",
                             **{k: v for k, v in base.items() if k != "residency_slots"}))
    specs.append(HarnessSpec(ordering="global-implicit", seed=200, run_dir=rd("global-implicit"), tag="global",
                             **base))
    return specs


# ---------------------------------------------------------------------- runner
def _row(check: str, expect: str, result: str, ok: bool, **extra: Any) -> Row:
    return {"check": check, "expect": expect, "result": result, "ok": bool(ok), **extra}


def _stall_rows(out: Path, runs: int, timeout_s: float) -> tuple[list[Row], list[HarnessOutcome]]:
    from .errors import StallError
    outcomes = []
    stalled = 0
    cycles = 0
    details = []
    for i in range(runs):
        o = run_harness(stall_spec(seed=i, run_dir=str(out / f"none-crossed-seed{i}"), tag=f"stall{i}"),
                        timeout_s=timeout_s)
        outcomes.append(o)
        errs = o.errors
        stall_ranks = [r for r, e in errs.items() if isinstance(e, StallError)]
        if len(stall_ranks) == len(o.results):
            stalled += 1
        cyc = next((getattr(e, "cycle", None) for e in errs.values() if getattr(e, "cycle", None)), None)
        if cyc:
            cycles += 1
        fr = next((getattr(e, "frontier", None) for e in errs.values() if getattr(e, "frontier", None)), {})
        frontier = {r: (f.get("d_done"), f.get("p_done")) for r, f in sorted(fr.items())}
        details.append({"seed": i, "stall_ranks": stall_ranks, "cycle": cyc, "frontier_d_p": frontier,
                        "wall_s": round(o.wall_s, 1),
                        "errors": {r: summarize_error(e) for r, e in errs.items()}})
    rows = [_row("crossed g=4 ATP2/ADP2, ordering none, 1 slot", "stalls; watchdog names the frontier",
                 f"stalled {stalled}/{runs} (every rank StallError), wait cycle named in {cycles}/{runs}; "
                 f"frontier (D iters, P segs) per rank: {details[0]['frontier_d_p'] if details else {}}",
                 stalled == runs and cycles == runs, runs=runs, stalls=stalled, details=details)]
    return rows, outcomes


def _complete_row(name: str, spec: HarnessSpec, timeout_s: float) -> Row:
    o = run_harness(spec, timeout_s=timeout_s)
    if o.completed:
        res = o.runs(0)
        d = res[0]["d_done"]
        p = res[0]["p_done"]
        return _row(name, "completes", f"completed: {d} D iterations, {p} P segments per rank in "
                    f"{max(r['wall_s'] for r in res):.2f} s", True, runs=1, stalls=0)
    errs = "; ".join(f"rank {r}: {summarize_error(e)}" for r, e in o.errors.items())
    return _row(name, "completes", f"FAILED: {errs}", False, runs=1, stalls=1)


def run_selftest(out: str | Path, *, stall_runs: int = 3, seeds: int = 5, skew_ms: float = 20.0,
                 timeout_s: float = 150.0, args: argparse.Namespace | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Run the acceptance list; returns ``{"rows": [...], "ok": bool, "wall_s": ...}`` and writes
    ``selftest.json`` / ``selftest.md`` into ``out``."""
    from .metrics.tracecheck import check_run_dir

    say = progress or (lambda s: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[Row] = []

    say("1/4 crossed topology under isolation only (expect a stall) ...")
    stall_rows, stall_outcomes = _stall_rows(out, stall_runs, timeout_s)
    rows += stall_rows
    say("2/4 the same workload with ATP1 and with ADP1 ...")
    rows.append(_complete_row("g=4 ATP1/ADP4 (d=4), ordering none, 1 slot",
                              stall_spec(attn_dp=4, tag="atp1", run_dir=str(out / "none-atp1")), timeout_s))
    rows.append(_complete_row("g=4 ATP4/ADP1 (d=1), ordering none, 1 slot",
                              stall_spec(attn_dp=1, tag="adp1", run_dir=str(out / "none-adp1")), timeout_s))

    say(f"3/4 selective under {skew_ms:g} ms rank skew x {seeds} seeds, delayed-P ACK, global-implicit ...")
    specs = selective_specs(out, seeds=seeds, skew_ms=skew_ms)
    o = run_harness(specs, timeout_s=timeout_s)
    sel_specs = specs[:seeds]
    if not o.completed:
        errs = "; ".join(f"rank {r}: {summarize_error(e)}" for r, e in o.errors.items())
        rows.append(_row(f"selective, {skew_ms:g} ms skew x {seeds} seeds", "every cycle completes",
                         f"FAILED: {errs}", False, runs=seeds))
    else:
        done = exp = 0
        agree = True
        for i, s in enumerate(sel_specs):
            res = o.runs(i)
            rounds = {r["rounds"] for r in res}
            agree &= len(rounds) == 1
            done += min(rounds)
            exp += expected_rounds(s) or 0
        rows.append(_row(f"selective, {skew_ms:g} ms random skew x {seeds} seeds (g=4 ATP2/ADP2, 1 slot)",
                         "every turnstile cycle completes",
                         f"{done}/{exp} cycles completed on every rank; all ranks agree: {agree}",
                         done == exp and agree, runs=seeds, cycles=done, stalls=0))
        dres = o.runs(seeds)
        dack = [r["delayed_ack_rounds"] for r in dres]
        rows.append(_row("delayed-P ACK (P completion +4 ms, 2 slots)", "> 0 rounds ACKed while P still runs",
                         f"delayed-ACK rounds per rank {dack} of {dres[0]['ack_rounds']}", min(dack) > 0,
                         runs=1, delayed_ack=min(dack)))
        gres = o.runs(seeds + 1)
        grounds = {r["rounds"] for r in gres}
        rows.append(_row("global-implicit (one collective stream)", "completes",
                         f"completed, {min(grounds)}/{expected_rounds(specs[seeds + 1])} cycles",
                         len(grounds) == 1 and min(grounds) == expected_rounds(specs[seeds + 1]), runs=1,
                         cycles=min(grounds)))

    say("4/4 trace-check ...")
    viol = 0
    n_rdv = 0
    cost = []
    reg_ov = other_ov = 0.0
    checked = 0
    for s in specs:
        if not s.run_dir or not Path(s.run_dir).exists():
            continue
        rep = check_run_dir(s.run_dir)
        checked += 1
        viol += len(rep["violations"])
        n_rdv += rep["rendezvous_per_rank"]
        if rep["rendezvous_mean_ms"]:
            cost.append(rep["rendezvous_mean_ms"])
        reg_ov += rep["registered_pair_overlap_ms"]
        other_ov += rep["other_p_vs_d_overlap_ms"]
    mean_cost = sum(cost) / len(cost) if cost else 0.0
    rows.append(_row("trace-check of the turnstile runs", "0 violations; registered-pair overlap 0; other P/D overlap > 0",
                     f"{checked} runs, {viol} violations, {n_rdv} rendezvous per rank (mean {mean_cost:.2f} ms); "
                     f"registered-pair overlap {reg_ov:.3f} ms, other P work vs D {other_ov:.1f} ms",
                     checked > 0 and viol == 0 and reg_ov == 0.0 and other_ov > 0.0, runs=checked, violations=viol,
                     rendezvous=n_rdv, rendezvous_mean_ms=mean_cost, registered_overlap_ms=reg_ov,
                     other_overlap_ms=other_ov))
    if stall_runs:
        rep = check_run_dir(out / "none-crossed-seed0")
        rows.append(_row("trace-check flags the isolation-only trace", "violations > 0 (no device order)",
                         f"{len(rep['violations'])} violations", len(rep["violations"]) > 0,
                         violations=len(rep["violations"])))

    for fn in EXTRA_CHECKS:
        try:
            got = fn(args if args is not None else argparse.Namespace(out=str(out)))
        except Exception as exc:  # a broken extra check is a failed row, not a crash
            got = _row(getattr(fn, "__name__", "extra check"), "passes", f"raised {type(exc).__name__}: {exc}", False)
        rows.extend(got if isinstance(got, list) else [got])

    summary = {"rows": rows, "ok": all(r["ok"] for r in rows), "wall_s": time.perf_counter() - t0,
               "out": str(out)}
    (out / "selftest.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "selftest.md").write_text(format_table(rows, markdown=True) + "\n")
    return summary


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
    parser.add_argument("--stall-runs", type=int, default=3, help="launches of the crossed stall scenario")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the selective skew scenario")
    parser.add_argument("--skew-ms", type=float, default=20.0, help="random rank skew before launches")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="hard deadline of each launch")
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
    root = Path(__file__).resolve().parent.parent
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
                           timeout_s=args.timeout_s, args=args,
                           progress=lambda s: print(s, file=sys.stderr, flush=True))
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
