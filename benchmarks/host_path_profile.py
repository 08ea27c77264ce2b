"""cProfile of the host path of D iterations (CPU VM or GPU host): ``TurnBook.finish_decode`` and
the decode-only ``ModelRunner.build`` while ``--rows`` greedy requests of ``--ctx`` prompt tokens
decode ``--tokens`` tokens each through a real worker (policy normal). Prints the top functions by
own time; only those two calls are profiled.

    python benchmarks/host_path_profile.py [--config configs/tiny-cpu.yaml] [--rows 64] [--ctx 2000] [--set KEY=VALUE]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.tools.options import load_config


async def run(cfg, rows: int, ctx: int, tokens: int, prof: cProfile.Profile) -> None:
    async with RolloutWorker(cfg) as w:
        book, runner = w.engine.book, w.engine.runner
        finish, build = book.finish_decode, runner.build

        def profiled(fn, *a, **kw):
            prof.enable()
            try:
                return fn(*a, **kw)
            finally:
                prof.disable()
        book.finish_decode = lambda plan, *a, **kw: profiled(finish, plan, *a, **kw)
        runner.build = lambda prefill, decode, *a, **kw: (build(prefill, decode, *a, **kw) if prefill
                                                         else profiled(build, prefill, decode, *a, **kw))
        rng = random.Random(0)
        V = cfg.model.vocab_size
        sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        await asyncio.gather(*(w.generate([rng.randrange(2, V) for _ in range(ctx)], sp) for _ in range(rows)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    cfg = load_config(a.config, ["scheduler.policy=normal", "cache.num_blocks=12000", *a.set])
    prof = cProfile.Profile()
    asyncio.run(run(cfg, a.rows, a.ctx, a.tokens, prof))
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
