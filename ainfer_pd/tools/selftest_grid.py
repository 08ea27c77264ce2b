"""The paper's Table 4 grid of ``ainfer-pd selftest`` (:mod:`.selftest`): ATP2 x ADP2 (g = 4),
ATP2 x ADP1 and ATP1 x ADP2 (g = 2), each under ``none`` / ``global-implicit`` / ``selective`` with
the ranks out of phase; each cell completes (tokens vs world size 1, trace-check) or stalls (the
watchdog's cycle: ranks and collectives; the frontier: completed requests), with its wall time.

The cells run ``configs/tiny-crossed-cpu.yaml`` on the CPU stand-in's device model (ARCHITECTURE.md: P's and
D's attention-TP collectives can be resident together, P's all-reduce and D's DP-attention collective
cannot) over :func:`~.selftest_scenarios.table4_trace` (twin conversations on the two replicas, so
both replicas prefill beside D). The phase skew is by rank parity (``faults.phase_skew_by: rank``):
the TP peers of each replica reach P's all-reduce and D's collectives in opposite orders, the
schedule of SPEC 2's four-rank cycle (with the TP peers alike, ``replica``, no cycle can close).
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable

from .selftest_scenarios import TIME_SCALE, crossed_config, single_rank_outputs, table4_trace

Row = dict[str, Any]

GRID_TOPOLOGIES: tuple[tuple[str, int, int], ...] = (("ATP2 x ADP2", 4, 2), ("ATP2 x ADP1", 2, 1),
                                                     ("ATP1 x ADP2", 2, 2))
"""The paper's Table 4 topologies: (name, world size, attention-DP width); experts over every rank."""
GRID_ORDERINGS = ("none", "global-implicit", "selective")


def table4_expect(topology: str, ordering: str) -> str:
    """The paper's Table 4 outcome of a cell: only isolation (``none``) on the crossed topology stalls."""
    return "stall" if (topology == "ATP2 x ADP2" and ordering == "none") else "complete"


def _cycle_of(err: Any) -> tuple[list[int], list[str]]:
    """The wait cycle of a :class:`StallError` (its ranks, and per hop the collective its rank holds)."""
    text = str(err)
    line = next((ln for ln in text.splitlines() if "device-progress cycle:" in ln), "")
    hops = re.findall(r"rank (\d+) \[([^\]]*)\] waits for rank (\d+)", line)
    cycle = list(getattr(err, "cycle", None) or ([int(h[0]) for h in hops] + [int(hops[-1][2])] if hops else []))
    return cycle, [f"rank {a}: {c}" for a, c, _ in hops]


def grid_cell(out: Path, topology: str, ws: int, d: int, ordering: str, trace: Any, ref: dict, *,
              skew_ms: float, timeout_s: float, skew_by: str = "rank", seed: int = 0) -> Row:
    """One cell of the Table 4 grid: the crossed config's engine at (ws, d) under ``ordering`` with
    the replicas out of phase (``faults.phase_skew_ms``); completes (tokens vs world size 1,
    trace-check) or stalls (the watchdog's cycle and the frontier: completed requests)."""
    from ..errors import RankFailedError
    from ..launch import spawn
    from .world import merge, rank_replay
    run_dir = out / f"grid-{topology.replace(' ', '')}-{ordering}"
    cfg = crossed_config(run_dir, **{"parallel.world_size": ws, "parallel.attn_dp": d, "parallel.expert_parallel": ws,
                                     "parallel.ordering": ordering, "parallel.stall_timeout_s": 3.0,
                                     "parallel.rendezvous_timeout_s": 10.0,
                                     "faults": {"phase_skew_ms": skew_ms, "phase_skew_by": skew_by, "seed": seed}})
    expect = table4_expect(topology, ordering)
    cell: Row = {"topology": topology, "ordering": ordering, "expect": expect, "requests": trace.num_requests,
                 "skew_ms": skew_ms, "skew_by": skew_by}
    t0 = time.perf_counter()
    try:
        res = merge(spawn(rank_replay, ws, (cfg.to_dict(), trace, "trace", 0, TIME_SCALE), timeout_s,
                          fail_grace_s=20))
    except RankFailedError as exc:
        cell["wall_s"] = time.perf_counter() - t0
        _stalled_cell(cell, exc, trace)
    else:
        cell["wall_s"] = time.perf_counter() - t0
        _completed_cell(cell, res, run_dir, ref, ordering)
    cell["ok"] = cell["outcome"] == expect
    return cell


def _stalled_cell(cell: Row, exc: Any, trace: Any) -> None:
    """A cell whose launch failed: a stall (its cycle, the held collectives, the frontier's completed
    requests) when a rank raised :class:`StallError`, else failed."""
    from ..errors import StallError
    errs = [e for e in (exc.results or []) if isinstance(e, BaseException)]
    stalls = [e for e in errs if isinstance(e, StallError)]
    if not stalls:
        cell.update(outcome="failed", detail=f"{type(errs[0]).__name__ if errs else 'RankFailedError'}: "
                                             f"{str(errs[0] if errs else exc)[:200]}")
        return
    # every rank reports the stall; a rank that heard from fewer peers in time may name no cycle:
    # the report naming the longest cycle (the most complete) stands for the cell
    best = max(stalls, key=lambda e: (len(_cycle_of(e)[0]), len(getattr(e, "frontier", None) or {})))
    cycle, held = _cycle_of(best)
    front = getattr(best, "frontier", None) or {}
    done = sum(int(f.get("requests_done") or 0) for f in front.values()) if front else None
    cell.update(outcome="stall", cycle=cycle, cycle_ranks=len(set(cycle)), held=held, frontier_requests=done,
                detail=f"stall at {done}/{trace.num_requests} requests; cycle {' -> '.join(map(str, cycle))} "
                       f"({len(set(cycle))} ranks): " + "; ".join(held))


def _completed_cell(cell: Row, res: Any, run_dir: Path, ref: dict, ordering: str) -> None:
    """A cell whose launch completed: complete when nothing failed, its tokens equal world size 1 and
    its trace is clean (under isolation only, registered pairs without a device order are expected)."""
    from .tracecheck import check_run_dir
    rep = check_run_dir(run_dir)
    same = res.outputs == ref
    # under isolation only nothing orders the registered pairs: trace-check reports them (expected);
    # an ordering that completes must leave a clean trace
    clean = rep["ok"] or ordering == "none"
    ok = res.failures == 0 and same and clean
    cell.update(outcome="complete" if ok else "failed", completed=res.completed, makespan_s=res.makespan_s,
                tokens_equal=same, violations=len(rep["violations"]), pairs_checked=rep["pairs_checked"],
                registered_overlap_ms=rep["registered_pair_overlap_ms"],
                detail=f"{res.completed}/{res.planned_requests} requests, makespan {res.makespan_s:.1f} s, tokens = "
                       f"ws1: {same}, trace-check {len(rep['violations'])} violations"
                       f"{' (unordered registered pairs: no device order)' if ordering == 'none' else ''}, "
                       f"{rep['pairs_checked']} registered pairs checked")


def run_grid(out: Path, *, skew_ms: float = 30.0, timeout_s: float = 200.0, skew_by: str = "rank",
             say: Callable[[str], None] = lambda s: None, trace: Any = None, ref: dict | None = None,
             orderings: tuple[str, ...] = GRID_ORDERINGS) -> list[Row]:
    """The Table 4 grid: :data:`GRID_TOPOLOGIES` x ``orderings``, one :func:`grid_cell` each, on
    ``trace`` (default :func:`table4_trace`; ``ref``: its greedy tokens at world size 1)."""
    trace = trace if trace is not None else table4_trace()
    ref = ref if ref is not None else single_rank_outputs(trace)
    cells = []
    for topology, ws, d in GRID_TOPOLOGIES:
        for ordering in orderings:
            say(f"  grid: {topology}, {ordering} ...")
            cells.append(grid_cell(out, topology, ws, d, ordering, trace, ref, skew_ms=skew_ms, timeout_s=timeout_s,
                                   skew_by=skew_by))
    return cells


def format_grid(cells: list[Row], *, markdown: bool = False) -> str:
    """The grid as one table: a row per topology, a column per ordering (outcome, wall time)."""
    topos = list(dict.fromkeys(c["topology"] for c in cells))
    ords = list(dict.fromkeys(c["ordering"] for c in cells))
    at = {(c["topology"], c["ordering"]): c for c in cells}

    def cell_text(c: Row | None) -> str:
        if c is None:
            return "-"
        what = c["outcome"]
        if what == "stall":
            what = f"stall @{c.get('frontier_requests')}/{c['requests']}, {c.get('cycle_ranks')}-rank cycle"
        elif what == "complete":
            what = f"complete {c.get('completed')}/{c['requests']}"
        mark = "" if c["ok"] else f" (paper: {c['expect']})"
        return f"{what}, {c['wall_s']:.1f} s{mark}"
    if markdown:
        lines = ["| topology | " + " | ".join(ords) + " |", "|---|" + "---|" * len(ords)]
        lines += ["| " + t + " | " + " | ".join(cell_text(at.get((t, o))) for o in ords) + " |" for t in topos]
        return "\n".join(lines)
    w = max(len(t) for t in topos)
    cols = [[cell_text(at.get((t, o))) for o in ords] for t in topos]
    cw = [max(len(o), *(len(r[i]) for r in cols)) for i, o in enumerate(ords)]
    lines = [f"{'topology':<{w}}  " + "  ".join(f"{o:<{cw[i]}}" for i, o in enumerate(ords))]
    lines += [f"{t:<{w}}  " + "  ".join(f"{r[i]:<{cw[i]}}" for i in range(len(ords))) for t, r in zip(topos, cols)]
    return "\n".join(lines)
