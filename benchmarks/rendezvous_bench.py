"""Per-rendezvous cost of the turnstile rendezvous implementations (issue 4), CPU only.

    python benchmarks/rendezvous_bench.py --ranks 2,4,8 --rounds 2000

For each world size, spawns that many local processes (gloo on 127.0.0.1) and times, back to
back, ``rounds`` rounds of:

* ``gloo all_reduce``   plain blocking ``dist.all_reduce`` of 4 int64 (reference)
* ``gloo all_gather``   plain blocking ``dist.all_gather`` of one rendezvous row (reference)
* ``GlooRendezvous``    ``await arrive(...)``: all_gather of the row on a worker thread
                        (the defaults: mode=thread, collective=all_gather)
* ``GlooRendezvous/all_reduce`` same with a SUM all-reduce of a zeroed (world, row) board
* ``GlooRendezvous/poll`` all_gather issued with ``async_op=True`` and polled from the loop
* ``ShmRendezvous``     same-host shared-memory board

Per-round latency is measured on every rank; the table shows rank 0's mean / p50 / p99 in ms
and the slowest rank's mean. A method stops early after ``--max-seconds`` (the table says how
many rounds ran). Every payload is checked on every round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("gloo all_reduce", "gloo all_gather", "GlooRendezvous", "GlooRendezvous/all_reduce",
           "GlooRendezvous/poll", "ShmRendezvous")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _rank_main(rank: int, world_size: int, rounds: int, max_seconds: float, methods: tuple[str, ...]):
    import torch
    import torch.distributed as dist

    from ainfer_pd.launch import get_store
    from ainfer_pd.turnstile.dist_rendezvous import GlooRendezvous, ShmRendezvous

    ctrl = dist.new_group(backend="gloo")
    out: dict[str, dict] = {}
    warm = min(50, rounds)
    for method in methods:
        rdv = None
        if method == "GlooRendezvous":
            rdv = GlooRendezvous(ctrl, 60.0, mode="thread")
        elif method == "GlooRendezvous/all_reduce":
            rdv = GlooRendezvous(ctrl, 60.0, mode="thread", collective="all_reduce")
        elif method == "GlooRendezvous/poll":
            rdv = GlooRendezvous(ctrl, 60.0, mode="poll")
        elif method == "ShmRendezvous":
            rdv = ShmRendezvous(rank, world_size, 60.0, store=get_store())
        t4 = torch.zeros(4, dtype=torch.int64)
        row = torch.zeros(13, dtype=torch.int64)
        rows = [torch.zeros(13, dtype=torch.int64) for _ in range(world_size)]
        dist.barrier(ctrl)
        lat: list[float] = []
        start = time.perf_counter()
        stop_flag = torch.zeros(1, dtype=torch.int64)
        for i in range(warm + rounds):
            t0 = time.perf_counter()
            if rdv is None and method == "gloo all_reduce":
                t4.fill_(i)
                dist.all_reduce(t4, group=ctrl)
                assert int(t4[0]) == i * world_size
            elif rdv is None:
                row.fill_(i)
                dist.all_gather(rows, row, group=ctrl)
                assert int(rows[-1][0]) == i
            else:
                res = await rdv.arrive("bench", (i, 7, rank), epoch=1, boundary=i)
                assert res == [(i, 7, r) for r in range(world_size)]
            if i >= warm:
                lat.append(time.perf_counter() - t0)
            # agree on stopping early (every 100 rounds, over the control group)
            if (i + 1) % 100 == 0:
                stop_flag.fill_(1 if time.perf_counter() - start > max_seconds else 0)
                dist.all_reduce(stop_flag, group=ctrl, op=dist.ReduceOp.MAX)
                if int(stop_flag[0]):
                    break
        if rdv is not None:
            await rdv.close()
        ms = [x * 1e3 for x in lat]
        out[method] = {"n": len(ms), "mean": statistics.fmean(ms), "p50": _pct(ms, 0.5), "p99": _pct(ms, 0.99)}
    return out


def rank_main(rank: int, world_size: int, rounds: int, max_seconds: float, methods: tuple[str, ...]):
    return asyncio.run(_rank_main(rank, world_size, rounds, max_seconds, methods))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated world sizes")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=4.0,
                    help="stop a method early after this long (keeps oversubscribed runs bounded)")
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)

    from ainfer_pd.launch import spawn

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    ncpu = os.cpu_count() or 1
    print(f"# rendezvous_bench: {platform.node()} {platform.machine()} {ncpu} cores, "
          f"python {platform.python_version()}, torch {__import__('torch').__version__}")
    print(f"# command: python benchmarks/rendezvous_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"| ranks | method | rounds | mean ms | p50 ms | p99 ms | slowest-rank mean ms |")
    print(f"|---|---|---|---|---|---|---|")
    t_all = time.perf_counter()
    for ws in [int(x) for x in args.ranks.split(",") if x.strip()]:
        res = spawn(rank_main, ws, (args.rounds, args.max_seconds, methods), timeout_s=600)
        note = " (oversubscribed)" if ws > ncpu else ""
        for m in methods:
            r0 = res[0][m]
            worst = max(r[m]["mean"] for r in res)
            print(f"| {ws}{note} | {m} | {r0['n']} | {r0['mean']:.3f} | {r0['p50']:.3f} | {r0['p99']:.3f} | {worst:.3f} |",
                  flush=True)
    print(f"# total {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
