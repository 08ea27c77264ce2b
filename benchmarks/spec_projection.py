"""A projection, not a measurement: decode throughput with suffix speculation on the Qwen3-30B-A3B
shape, from the verify cost curve measured on the H200 (``spec_bench.py verify-costs``) and an
acceptance profile measured on the trained small model's rollouts (``spec_acceptance_bench.py``).

For each batch size B of the curve and each row kind of the profile (greedy, sampled with own
drafts, sampled with sibling drafts), the policy of ``ainfer_pd.spec.adaptive.choose`` is applied
to B rows of that kind: tokens per verify step E(k) (measured, for k = width - 1) over the verify
cost ratio(B, k + 1); the projected gain is the best over k, or 1.0 when none beats plain decoding
by ``MIN_GAIN``. The iteration time is the measured one-token time at B. What it leaves out: the
host time of drafting and of a non-overlapped iteration (on the small model the bench measured
this outweighing the gain), rows of mixed kinds, and any acceptance other than the small model's.

``--ladder runs.jsonl`` (a ladder part's runs, ``h200_ladder.sh``) projects each run's makespan too:
its mean D batch B = output tokens / D iterations, the gain g(B) interpolated on the curve for
``--rows`` (the trace replay decodes greedily; GRPO-shaped cells sample at temperature 1), and
makespan - D work x (1 - 1 / g): every D second shortened by the gain, P and idle time as measured.

    python benchmarks/spec_projection.py --costs docs/results/spec/verify_costs-9ca222b.txt \\
        --acceptance docs/results/spec/acceptance-*.txt [--ladder runs_trace.jsonl --rows greedy/own]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd.spec.adaptive import MIN_GAIN  # noqa: E402

KINDS = ("greedy/own", "sampled/own", "sampled/siblings")


def fig_lines(path: Path, name: str) -> list[dict[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith(f"FIG {name} "):
            out.append(dict(re.findall(r"(\w+)=(\S+)", line[len(name) + 5:])))
    return out


def best_gain(costs_at_b: dict[int, float], tokens: dict[int, float]) -> tuple[float, int]:
    """The adaptive choice at one batch size: (gain, k), (1.0, 0) when no k pays ``MIN_GAIN``."""
    best, best_k = 1.0, 0
    for w, ratio in costs_at_b.items():
        k = w - 1
        if k >= 1 and k in tokens:
            g = tokens[k] / ratio
            if g >= MIN_GAIN and g > best:
                best, best_k = g, k
    return best, best_k


def gain_at(gains: dict[int, float], B: float) -> float:
    """g(B) linear between the curve's batch sizes, held flat past its ends."""
    bs = sorted(gains)
    if B <= bs[0]:
        return gains[bs[0]]
    for lo, hi in zip(bs, bs[1:]):
        if B <= hi:
            return gains[lo] + (gains[hi] - gains[lo]) * (B - lo) / (hi - lo)
    return gains[bs[-1]]


def project_run(summary: dict, gains: dict[int, float]) -> dict[str, float]:
    """One ladder run's projected makespan (see the module docstring)."""
    iters = summary["d_work_s"] / summary["d_iter_mean_s"]
    B = summary["output_tokens"] / iters
    g = gain_at(gains, B)
    made = summary["makespan_s"] - summary["d_work_s"] * (1 - 1 / g)
    return {"mean_batch": B, "gain": g, "makespan_s": summary["makespan_s"], "projected_s": made}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", type=Path, required=True)
    ap.add_argument("--acceptance", type=Path, required=True)
    ap.add_argument("--ladder", type=Path, help="a ladder part's runs_*.jsonl: project its makespans")
    ap.add_argument("--rows", default="greedy/own", choices=KINDS, help="the ladder's row kind")
    a = ap.parse_args()
    cost: dict[int, dict[int, float]] = {}
    ms1: dict[int, float] = {}
    for f in fig_lines(a.costs, "spec_verify_cost"):
        B, w = int(f["B"]), int(f["width"])
        cost.setdefault(B, {})[w] = float(f["ratio"])
        if w == 1:
            ms1[B] = float(f["ms"])
    tok: dict[str, dict[int, float]] = {}
    for f in fig_lines(a.acceptance, "spec_acceptance"):
        tok.setdefault(f"{f['rows']}/{f['drafts']}", {})[int(f["k"])] = float(f["tokens_per_verify"])
    kinds = [k for k in KINDS if k in tok]
    print("PROJECTION (not measured): decode tokens/s with suffix speculation over without, per batch size, "
          f"from {a.costs.name} and {a.acceptance.name}; host time of drafting left out")
    print(f"{'B':>5} {'1-token ms':>10} " + " ".join(f"{k:>24}" for k in kinds))
    for B in sorted(cost):
        cells = []
        for kind in kinds:
            best, best_k = best_gain(cost[B], tok[kind])
            cells.append(f"{best:5.2f}x (k={best_k}, {ms1[B] / best:5.2f} ms/tok)")
            print(f"FIG spec_projection B={B} rows={kind} gain={best:.3f} k={best_k}", file=sys.stderr)
        print(f"{B:>5} {ms1[B]:>10.2f} " + " ".join(f"{c:>24}" for c in cells))
    if a.ladder:
        gains = {B: best_gain(cost[B], tok[a.rows])[0] for B in cost}
        print(f"PROJECTION (not measured): the makespans of {a.ladder.name} with {a.rows} rows speculating")
        for line in a.ladder.read_text().splitlines():
            run = json.loads(line)
            p = project_run(run["summary"], gains)
            print(f"FIG spec_ladder_projection cell={run['cell']} policy={run['variant']} repeat={run['repeat']} "
                  f"mean_batch={p['mean_batch']:.1f} gain={p['gain']:.3f} makespan_s={p['makespan_s']:.2f} "
                  f"projected_s={p['projected_s']:.2f} ratio={p['projected_s'] / p['makespan_s']:.3f}")


if __name__ == "__main__":
    main()
