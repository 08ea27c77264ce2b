"""``ainfer-pd trace-check RUN_DIR``: verify the ordering contract on a run's cross-rank trace.

Input: ``RUN_DIR/rank{r}.jsonl``, one time-ordered JSONL control trace per rank (written by
the :class:`~ainfer_pd.metrics.recorder.Recorder`; ``RUN_DIR/meta.json`` optional), with
the events of the turnstile (``rdv1`` / ``rdv2`` / ``grant`` / ``publish`` ...) and of the
phase collectives: ``coll_enqueue`` (host enqueue order: ``phase``, ``comm``, ``seq``,
``stream``, ``epoch``, ``boundary``, ``registered``), ``coll_launch`` / ``coll_done`` and
``work`` intervals (``t0`` / ``t1``).

Checks (SPEC 3.3, 7):

1. **Direction of every registered pair.** For each registered P collective ``R`` of a gated
   epoch ``e`` issued past boundary ``j``, the D launch ``G`` of the turnstile round that granted it
   (the last round ``(e, b)`` with ``b <= j``) must be enqueued **before** ``R`` on the
   **same stream** (D -> P by FIFO), and every rank must show the same direction at the same
   ``(e, j)``. A registered P collective on another stream than its round's D launch has no
   device order ("unordered"); one without any round has no order either ("no-round").
   A registered P collective of an earlier segment (``j < b``) must precede ``G(e, b)``
   (``R- < G``). A P collective of an ungated epoch (``gated: false``: D does not launch while it
   runs, and the lockstep step loop awaited the last D iteration before it began) is ordered by
   that exclusion and only counted.
2. **Participation.** Every rank issues the same registered ``(e, j)`` set.
3. **Rendezvous alignment.** Every rank passes the same sequence of ``rdv1`` / ``rdv2`` at the
   same (epoch, boundary, permit).

Reports: violations, rendezvous count and mean cost, delayed-ACK rounds, the overlap time of
registered pairs (should be 0) against other P work overlapping D (should be > 0).
Exit code 1 on any violation, 2 when the directory holds no trace.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["load_traces", "check_traces", "check_run_dir", "format_report", "setup_parser", "run"]

MAX_LISTED = 20


def load_traces(run_dir: str | Path) -> dict[int, list[dict]]:
    """``{rank: events in trace order}`` of every ``rank*.jsonl`` in ``run_dir``, or ``rank*.jsonl.gz``
    (a trace kept compressed with the results) where a rank has no plain one."""
    out: dict[int, list[dict]] = {}
    d = Path(run_dir)
    for p in sorted(d.glob("rank*.jsonl")) + sorted(d.glob("rank*.jsonl.gz")):
        try:
            rank = int(p.name[4:].split(".")[0])
        except ValueError:
            continue
        if rank in out:
            continue
        evs = []
        with (gzip.open(p, "rt") if p.suffix == ".gz" else p.open()) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    evs.append(json.loads(line))
                except json.JSONDecodeError:
                    evs.append({"ev": "_corrupt", "raw": line[:80]})
        out[rank] = evs
    return out


def union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged into disjoint, sorted ones (nested items count once)."""
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time during which some interval of ``a`` and some interval of ``b`` both run."""
    tot = 0.0
    ub = union(b)
    for x0, x1 in union(a):
        for y0, y1 in ub:
            tot += max(0.0, min(x1, y1) - max(x0, y0))
    return tot


Pair = tuple[int, dict]


@dataclass
class _Totals:
    """What :func:`check_traces` adds up over the ranks."""
    registered_seen: bool = False
    pairs_checked: int = 0
    pairs_exclusive: int = 0
    acks: int = 0
    delayed_ack: int = 0
    reg_overlap: float = 0.0
    other_overlap: float = 0.0
    p_other_busy: float = 0.0
    rdv_costs: list[float] = field(default_factory=list)


def _registered_enqueues(evs: list[dict]) -> tuple[dict[tuple[int, int], list[Pair]], list[Pair], int, bool]:
    """A rank's registered collective enqueues: D launches by turnstile round ``(epoch, boundary)``,
    the P collectives of gated epochs (with their trace positions), the count of P collectives of
    ungated epochs, and whether any registered enqueue is there at all."""
    g_by_round: dict[tuple[int, int], list[Pair]] = defaultdict(list)
    p_reg: list[Pair] = []
    exclusive, seen = 0, False
    for i, e in enumerate(evs):
        if e.get("ev") != "coll_enqueue" or not e.get("registered"):
            continue
        seen = True
        if e.get("phase") == "D" and e.get("epoch") is not None:
            g_by_round[(e["epoch"], e["boundary"])].append((i, e))
        elif e.get("phase") == "P":
            if e.get("gated") is False:
                exclusive += 1                    # ungated epoch: no D in flight while it runs
            else:
                p_reg.append((i, e))
    return g_by_round, p_reg, exclusive, seen


def _direction(i: int, e: dict, g_by_round: dict, rounds: dict[int, list[int]]) -> str:
    """The device order of registered P collective ``e`` (trace position ``i``) against the D launch
    of the round that granted it: ``D->P``, ``P->D``, ``unordered`` (another stream) or ``no-round``."""
    ep, j = e.get("epoch"), e.get("boundary")
    bs = [b for b in rounds.get(ep, []) if b <= j] if ep is not None and j is not None else []
    if not bs:
        return "no-round"
    gi, g = g_by_round[(ep, bs[-1])][-1]
    if g.get("stream") != e.get("stream"):
        return "unordered"
    return "D->P" if gi < i else "P->D"


def _later_round_violations(rank: int, i: int, e: dict, g_by_round: dict, rounds: dict[int, list[int]]) -> list[str]:
    """R- < G: registered P collective ``e`` precedes the next round's D launches on its stream."""
    ep, j = e.get("epoch"), e.get("boundary")
    if ep is None or j is None:
        return []
    out = []
    for b in rounds.get(ep, []):
        if b > j:
            for gi, g in g_by_round[(ep, b)]:
                if g.get("stream") == e.get("stream") and gi < i:
                    out.append(f"rank {rank}: registered P {e.get('comm')}#{e.get('cseq')} of "
                               f"(epoch {ep}, segment {j}) enqueued after the D launch of round "
                               f"(epoch {ep}, boundary {b}) (R- must precede G)")
            break
    return out


def _check_rank_pairs(rank: int, evs: list[dict], directions: dict, violations: list[str], t: _Totals) -> int:
    """Check 1 on one rank: record each registered P collective's direction in ``directions`` and
    append its R- < G violations; returns the rank's registered P collectives of gated epochs."""
    g_by_round, p_reg, exclusive, seen = _registered_enqueues(evs)
    rounds: dict[int, list[int]] = defaultdict(list)
    for (ep, b) in g_by_round:
        rounds[ep].append(b)
    for ep in rounds:
        rounds[ep].sort()
    for i, e in p_reg:
        directions[(e.get("epoch"), e.get("boundary"))][rank] = _direction(i, e, g_by_round, rounds)
        violations += _later_round_violations(rank, i, e, g_by_round, rounds)
    t.registered_seen = t.registered_seen or seen
    t.pairs_checked += len(p_reg)
    t.pairs_exclusive += exclusive
    return len(p_reg)


def _rank_rendezvous(evs: list[dict], t: _Totals) -> list[tuple]:
    """A rank's ``rdv1`` / ``rdv2`` sequence ``(ev, epoch, boundary, permit)``; their costs and the
    ACK rounds (delayed: P still running) go to ``t``."""
    seq = []
    for e in evs:
        if e.get("ev") in ("rdv1", "rdv2"):
            seq.append((e["ev"], e.get("epoch"), e.get("boundary"), e.get("permit")))
            if e.get("rdv_s") is not None:
                t.rdv_costs.append(float(e["rdv_s"]))
        elif e.get("ev") == "ack":
            t.acks += 1
            t.delayed_ack += 1 if e.get("p_running") else 0
    return seq


def _rank_overlap(evs: list[dict], t: _Totals) -> tuple[float, float]:
    """Seconds a rank's registered P and D collectives overlap, and its other P work overlaps any D
    work (both added to ``t``, with the rank's other P work time)."""
    works = [e for e in evs if e.get("ev") == "work" and "t0" in e and "t1" in e]
    p_reg_iv = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "P" and w.get("kind") == "coll"
                and w.get("registered")]
    d_reg_iv = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "D" and w.get("kind") == "coll"
                and w.get("registered")]
    p_other = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "P"
               and not (w.get("kind") == "coll" and w.get("registered"))]
    d_all = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "D"]
    ro, oo = overlap_seconds(p_reg_iv, d_reg_iv), overlap_seconds(p_other, d_all)
    t.reg_overlap += ro
    t.other_overlap += oo
    t.p_other_busy += sum(b - a for a, b in union(p_other))
    return ro, oo


def _direction_violations(directions: dict[tuple, dict[int, str]], ranks: list[int]) -> list[str]:
    """Checks 1 and 2 across ranks: every registered pair D->P on every rank, issued by every rank."""
    out: list[str] = []
    bad_dirs = 0
    for key in sorted(directions, key=lambda k: (k[0] if k[0] is not None else -1, k[1] if k[1] is not None else -1)):
        dirs = directions[key]
        kinds = set(dirs.values())
        if kinds != {"D->P"}:
            bad_dirs += 1
            if bad_dirs <= MAX_LISTED:
                detail = ", ".join(f"rank {r}: {d}" for r, d in sorted(dirs.items()))
                what = "ranks disagree on the direction" if len(kinds) > 1 else "no D->P device order"
                out.append(f"(epoch {key[0]}, segment {key[1]}): {what}: {detail}")
        missing = [r for r in ranks if r not in dirs]
        if missing and len(dirs) > 0:
            out.append(f"(epoch {key[0]}, segment {key[1]}): registered P collective missing on ranks {missing} "
                       f"(mismatched participation)")
    if bad_dirs > MAX_LISTED:
        out.append(f"... and {bad_dirs - MAX_LISTED} more registered pairs without a common D->P order")
    return out


def _rendezvous_violations(rdv_seqs: dict[int, list[tuple]], ranks: list[int]) -> list[str]:
    """Check 3: every rank passes the same rendezvous sequence as the first rank."""
    if not rdv_seqs:
        return []
    out = []
    ref_rank = ranks[0]
    ref = rdv_seqs[ref_rank]
    for r in ranks[1:]:
        s = rdv_seqs[r]
        if s != ref:
            k = next((i for i, (a, b) in enumerate(zip(ref, s)) if a != b), min(len(ref), len(s)))
            a = ref[k] if k < len(ref) else None
            b = s[k] if k < len(s) else None
            out.append(f"rendezvous sequences differ between rank {ref_rank} and rank {r} at #{k}: "
                       f"{a} vs {b} ({len(ref)} vs {len(s)} rendezvous)")
    return out


def check_traces(traces: dict[int, list[dict]], meta: dict | None = None) -> dict[str, Any]:
    """Check the ordering contract over per-rank event lists; returns the report dict."""
    violations: list[str] = []
    directions: dict[tuple, dict[int, str]] = defaultdict(dict)
    per_rank: dict[int, dict] = {}
    rdv_seqs: dict[int, list[tuple]] = {}
    t = _Totals()
    for rank, evs in sorted(traces.items()):
        n_reg = _check_rank_pairs(rank, evs, directions, violations, t)
        rdv_seqs[rank] = seq = _rank_rendezvous(evs, t)
        ro, oo = _rank_overlap(evs, t)
        per_rank[rank] = {"events": len(evs), "registered_p": n_reg, "rounds": len(seq) // 2,
                          "registered_pair_overlap_ms": 1e3 * ro, "other_p_vs_d_overlap_ms": 1e3 * oo}
    ranks = sorted(traces)
    violations += _direction_violations(directions, ranks)
    violations += _rendezvous_violations(rdv_seqs, ranks)
    n_rdv = len(rdv_seqs.get(ranks[0], [])) if ranks else 0
    return _report(ranks, meta, t, violations, n_rdv, per_rank)


def _report(ranks: list[int], meta: dict | None, t: _Totals, violations: list[str], n_rdv: int,
            per_rank: dict[int, dict]) -> dict[str, Any]:
    """The report dict of :func:`check_traces`."""
    return {
        "ranks": ranks,
        "registered_pairs": (meta or {}).get("registered_pairs") if meta else None,
        "registered_seen": t.registered_seen,
        "pairs_checked": t.pairs_checked,
        "pairs_exclusive": t.pairs_exclusive,
        "violations": violations,
        "ok": not violations,
        "rendezvous_per_rank": n_rdv,
        "rounds_per_rank": n_rdv // 2,
        "rendezvous_mean_ms": 1e3 * sum(t.rdv_costs) / len(t.rdv_costs) if t.rdv_costs else 0.0,
        "ack_rounds": t.acks,
        "delayed_ack_rounds": t.delayed_ack,
        "registered_pair_overlap_ms": 1e3 * t.reg_overlap,
        "other_p_vs_d_overlap_ms": 1e3 * t.other_overlap,
        "p_work_ms": 1e3 * t.p_other_busy,
        "p_overlap_fraction": t.other_overlap / t.p_other_busy if t.p_other_busy else 0.0,
        "per_rank": per_rank,
    }


def check_run_dir(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    traces = load_traces(run_dir)
    meta = None
    mp = run_dir / "meta.json"
    if mp.exists():
        try:
            meta = json.loads(mp.read_text())
        except json.JSONDecodeError:
            meta = None
    rep = check_traces(traces, meta)
    rep["run_dir"] = str(run_dir)
    return rep


def format_report(rep: dict) -> str:
    lines = [f"trace-check {rep.get('run_dir', '')}: {len(rep['ranks'])} ranks, "
             f"{rep['pairs_checked']} registered P collectives checked"
             + (f" ({rep['pairs_exclusive']} more in ungated epochs)" if rep.get("pairs_exclusive") else "")
             + (f" (pairs: {', '.join(rep['registered_pairs'])})" if rep.get("registered_pairs") else "")]
    lines.append(f"  rendezvous: {rep['rendezvous_per_rank']} per rank ({rep['rounds_per_rank']} rounds), "
                 f"mean cost {rep['rendezvous_mean_ms']:.3f} ms")
    lines.append(f"  delayed-ACK rounds (rendezvous 2 done while P work still running): "
                 f"{rep['delayed_ack_rounds']} of {rep['ack_rounds']}")
    lines.append(f"  overlap: registered pairs {rep['registered_pair_overlap_ms']:.3f} ms (must be 0); "
                 f"other P work vs D {rep['other_p_vs_d_overlap_ms']:.3f} ms "
                 f"({100 * rep.get('p_overlap_fraction', 0.0):.1f}% of {rep.get('p_work_ms', 0.0):.1f} ms of P work)")
    if rep["violations"]:
        lines.append(f"  VIOLATIONS ({len(rep['violations'])}):")
        lines.extend(f"    {v}" for v in rep["violations"])
    else:
        lines.append("  ordering contract: OK (no violation)")
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI
def setup_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory with rank{r}.jsonl control traces")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir() or not any(run_dir.glob("rank*.jsonl")):
        print(f"trace-check: no rank*.jsonl traces in {run_dir}", file=sys.stderr)
        return 2
    rep = check_run_dir(run_dir)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="ainfer-pd trace-check")
    setup_parser(p)
    sys.exit(run(p.parse_args()))
