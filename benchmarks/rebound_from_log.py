"""The optimistic bound's work terms of each run in a ladder log, set-up items left out.

Until metrics.report.SETUP_ITEMS (after b2691de), a run's bound took the engine's stream sums, which
hold the decode-graph capture (D.capture, 3-5 s on the H200) and the prefill warm-up (P.warmup):
the D term was then the bound, and every ratio over it was too low. The log's interval line
("D.iter n=... sum X s; P.attn ... sum Y s; ...") has the sums by item, so each run's work terms can
be rebuilt from it: D = every D.* item but D.capture, P = every P.* item but P.warmup. The line
lists the six largest groups only, so the P term is a lower bound (on the H200 runs the D term is
the larger by far). The chain term is not in the log: pass --chain-s where it is known. Only a part's
first repeat has the line (bench keeps the first repeat's timeline).

    python benchmarks/rebound_from_log.py LOG [LOG...] [--chain-s S]
"""
from __future__ import annotations

import argparse
import re
import sys

from ainfer_pd.tools.report import SETUP_ITEMS

RUN = re.compile(r"^\[\d+/\d+\] (?P<label>.+?) #(?P<rep>\d+): makespan (?P<mk>[\d.]+) s")
ITEM = re.compile(r"(?P<name>[PD]\.[A-Za-z_]+\d*) n=\d+ mean [\d.]+ max [\d.]+ sum (?P<sum>[\d.]+) s")


def runs(lines):
    """(label, repeat, makespan, P work, D work, setup) of each run with an interval line; the
    warm-up runs (after h200_ladder.sh's "+ (warm-up)" command line) are left out."""
    cur, warm = None, False
    for line in lines:
        if line.startswith("+ "):
            warm = line.startswith("+ (warm-up)")
        elif warm:
            continue
        elif (m := RUN.match(line)) is not None:
            cur = (m["label"], int(m["rep"]), float(m["mk"]))
        elif cur is not None and "D.iter n=" in line:
            sums = {"P": 0.0, "D": 0.0, "setup": 0.0}
            for it in ITEM.finditer(line.split("| slowest")[0]):
                key = "setup" if it["name"] in SETUP_ITEMS else it["name"][0]
                sums[key] += float(it["sum"])
            yield (*cur, sums["P"], sums["D"], sums["setup"])
            cur = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--chain-s", type=float, default=None, help="the chain term, where known")
    args = ap.parse_args(argv)
    print(f"{'run':58s} {'makespan':>9s} {'P work':>7s} {'D work':>7s} {'setup':>6s} {'bound':>6s} {'/bound':>7s}")
    for path in args.logs:
        with open(path) as f:
            for label, rep, mk, p, d, setup in runs(f):
                bound = max(p, d, args.chain_s or 0.0)
                run = f"{label} #{rep}"
                print(f"{run:58s} {mk:9.3f} {p:7.2f} {d:7.2f} {setup:6.2f} {bound:6.2f} {mk / bound:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
