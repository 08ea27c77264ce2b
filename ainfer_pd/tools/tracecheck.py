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
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["load_traces", "check_traces", "check_run_dir", "format_report", "setup_parser", "run"]

MAX_LISTED = 20


def load_traces(run_dir: str | Path) -> dict[int, list[dict]]:
    """``{rank: events in trace order}`` of every ``rank*.jsonl`` in ``run_dir``."""
    out: dict[int, list[dict]] = {}
    for p in sorted(Path(run_dir).glob("rank*.jsonl")):
        try:
            rank = int(p.stem[4:])
        except ValueError:
            continue
        evs = []
        with p.open() as f:
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


def check_traces(traces: dict[int, list[dict]], meta: dict | None = None) -> dict[str, Any]:
    """Check the ordering contract over per-rank event lists; returns the report dict."""
    violations: list[str] = []
    directions: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    registered_seen = False
    per_rank: dict[int, dict] = {}
    rdv_seqs: dict[int, list[tuple]] = {}
    rdv_costs: list[float] = []
    delayed_ack = acks = 0
    reg_overlap = other_overlap = p_other_busy = 0.0
    pairs_checked = pairs_exclusive = 0

    for rank, evs in sorted(traces.items()):
        enq = [(i, e) for i, e in enumerate(evs) if e.get("ev") == "coll_enqueue"]
        g_by_round: dict[tuple[int, int], list[tuple[int, dict]]] = defaultdict(list)
        p_reg: list[tuple[int, dict]] = []
        for i, e in enq:
            if not e.get("registered"):
                continue
            registered_seen = True
            if e.get("phase") == "D" and e.get("epoch") is not None:
                g_by_round[(e["epoch"], e["boundary"])].append((i, e))
            elif e.get("phase") == "P":
                if e.get("gated") is False:
                    pairs_exclusive += 1          # ungated epoch: no D in flight while it runs
                    continue
                p_reg.append((i, e))
        rounds_by_epoch: dict[int, list[int]] = defaultdict(list)
        for (ep, b) in g_by_round:
            rounds_by_epoch[ep].append(b)
        for ep in rounds_by_epoch:
            rounds_by_epoch[ep].sort()
        for i, e in p_reg:
            ep, j = e.get("epoch"), e.get("boundary")
            key = (ep, j)
            bs = [b for b in rounds_by_epoch.get(ep, []) if b <= j] if ep is not None and j is not None else []
            if not bs:
                d = "no-round"
            else:
                gs = g_by_round[(ep, bs[-1])]
                gi, g = gs[-1]
                if g.get("stream") != e.get("stream"):
                    d = "unordered"
                else:
                    d = "D->P" if gi < i else "P->D"
            directions[key][rank] = d
            pairs_checked += 1
            # R- < G: this P collective precedes every later round's D launch on its stream
            if ep is not None and j is not None:
                for b in rounds_by_epoch.get(ep, []):
                    if b > j:
                        for gi, g in g_by_round[(ep, b)]:
                            if g.get("stream") == e.get("stream") and gi < i:
                                violations.append(f"rank {rank}: registered P {e.get('comm')}#{e.get('cseq')} of "
                                                  f"(epoch {ep}, segment {j}) enqueued after the D launch of round "
                                                  f"(epoch {ep}, boundary {b}) (R- must precede G)")
                        break
        # rendezvous
        seq = []
        for e in evs:
            if e.get("ev") in ("rdv1", "rdv2"):
                seq.append((e["ev"], e.get("epoch"), e.get("boundary"), e.get("permit")))
                if e.get("rdv_s") is not None:
                    rdv_costs.append(float(e["rdv_s"]))
            elif e.get("ev") == "ack":
                acks += 1
                delayed_ack += 1 if e.get("p_running") else 0
        rdv_seqs[rank] = seq
        # overlap
        works = [e for e in evs if e.get("ev") == "work" and "t0" in e and "t1" in e]
        p_reg_iv = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "P" and w.get("kind") == "coll"
                    and w.get("registered")]
        d_reg_iv = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "D" and w.get("kind") == "coll"
                    and w.get("registered")]
        p_other = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "P"
                   and not (w.get("kind") == "coll" and w.get("registered"))]
        d_all = [(w["t0"], w["t1"]) for w in works if w.get("phase") == "D"]
        ro, oo = overlap_seconds(p_reg_iv, d_reg_iv), overlap_seconds(p_other, d_all)
        reg_overlap += ro
        other_overlap += oo
        p_other_busy += sum(b - a for a, b in union(p_other))
        per_rank[rank] = {"events": len(evs), "registered_p": len(p_reg), "rounds": len(seq) // 2,
                          "registered_pair_overlap_ms": 1e3 * ro, "other_p_vs_d_overlap_ms": 1e3 * oo}

    # direction agreement
    ranks = sorted(traces)
    bad_dirs = 0
    for key in sorted(directions, key=lambda k: (k[0] if k[0] is not None else -1, k[1] if k[1] is not None else -1)):
        dirs = directions[key]
        kinds = set(dirs.values())
        if kinds != {"D->P"}:
            bad_dirs += 1
            if bad_dirs <= MAX_LISTED:
                detail = ", ".join(f"rank {r}: {d}" for r, d in sorted(dirs.items()))
                what = "ranks disagree on the direction" if len(kinds) > 1 else "no D->P device order"
                violations.append(f"(epoch {key[0]}, segment {key[1]}): {what}: {detail}")
        missing = [r for r in ranks if r not in dirs]
        if missing and len(dirs) > 0:
            violations.append(f"(epoch {key[0]}, segment {key[1]}): registered P collective missing on ranks {missing} "
                              f"(mismatched participation)")
    if bad_dirs > MAX_LISTED:
        violations.append(f"... and {bad_dirs - MAX_LISTED} more registered pairs without a common D->P order")

    # rendezvous alignment
    if rdv_seqs:
        ref_rank = ranks[0]
        ref = rdv_seqs[ref_rank]
        for r in ranks[1:]:
            s = rdv_seqs[r]
            if s != ref:
                k = next((i for i, (a, b) in enumerate(zip(ref, s)) if a != b), min(len(ref), len(s)))
                a = ref[k] if k < len(ref) else None
                b = s[k] if k < len(s) else None
                violations.append(f"rendezvous sequences differ between rank {ref_rank} and rank {r} at #{k}: "
                                  f"{a} vs {b} ({len(ref)} vs {len(s)} rendezvous)")

    n_rdv = len(rdv_seqs.get(ranks[0], [])) if ranks else 0
    return {
        "ranks": ranks,
        "registered_pairs": (meta or {}).get("registered_pairs") if meta else None,
        "registered_seen": registered_seen,
        "pairs_checked": pairs_checked,
        "pairs_exclusive": pairs_exclusive,
        "violations": violations,
        "ok": not violations,
        "rendezvous_per_rank": n_rdv,
        "rounds_per_rank": n_rdv // 2,
        "rendezvous_mean_ms": 1e3 * sum(rdv_costs) / len(rdv_costs) if rdv_costs else 0.0,
        "ack_rounds": acks,
        "delayed_ack_rounds": delayed_ack,
        "registered_pair_overlap_ms": 1e3 * reg_overlap,
        "other_p_vs_d_overlap_ms": 1e3 * other_overlap,
        "p_work_ms": 1e3 * p_other_busy,
        "p_overlap_fraction": other_overlap / p_other_busy if p_other_busy else 0.0,
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
