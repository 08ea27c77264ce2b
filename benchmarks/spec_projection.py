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

    python benchmarks/spec_projection.py --costs docs/results/spec/verify_costs-9ca222b.txt \\
        --acceptance docs/results/spec/acceptance-*.txt
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd.spec.adaptive import MIN_GAIN  # noqa: E402


def fig_lines(path: Path, name: str) -> list[dict[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith(f"FIG {name} "):
            out.append(dict(re.findall(r"(\w+)=(\S+)", line[len(name) + 5:])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", type=Path, required=True)
    ap.add_argument("--acceptance", type=Path, required=True)
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
    kinds = [k for k in ("greedy/own", "sampled/own", "sampled/siblings") if k in tok]
    print("PROJECTION (not measured): decode tokens/s with suffix speculation over without, per batch size, "
          f"from {a.costs.name} and {a.acceptance.name}; host time of drafting left out")
    print(f"{'B':>5} {'1-token ms':>10} " + " ".join(f"{k:>24}" for k in kinds))
    for B in sorted(cost):
        cells = []
        for kind in kinds:
            best, best_k = 1.0, 0
            for w, ratio in cost[B].items():
                k = w - 1
                if k >= 1 and k in tok[kind]:
                    g = tok[kind][k] / ratio
                    if g >= MIN_GAIN and g > best:
                        best, best_k = g, k
            cells.append(f"{best:5.2f}x (k={best_k}, {ms1[B] / best:5.2f} ms/tok)")
            print(f"FIG spec_projection B={B} rows={kind} gain={best:.3f} k={best_k}", file=sys.stderr)
        print(f"{B:>5} {ms1[B]:>10.2f} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
