"""Where re-prefill under KV pressure comes from, per policy (issue 33: on the H100's grpo-long P1 at KV 0.7
fine-grained prefilled 6.5% more prompt tokens than normal): the grpo-long workload on the tiny CPU model with a
pool of ``--blocks`` blocks, normal then fine-grained, fifo; per run the makespan, the prompt tokens computed,
the KV evictions and the tokens each kind of turn prefilled beyond its new ones (a continuation whose cached
context was evicted while its tool ran prefills it again; a first turn whose siblings' shared prompt was
evicted likewise). ``--set`` adds config overrides (e.g. ``scheduler.short_prefill_tokens=256``).

``--reserve R[,R...]`` emulates a trainer's response budget: the KV accounting sees max(R, its
max_new_tokens) - generated output tokens left for each turn, as it would with ``max_tokens`` R (verl's
``response_length``), while the turn still stops at the trace's length (``engine/kv/prefix.left`` is
patched, in this process only: under ``cache.reserve_output: all`` a turn reserves them all at
admission, under ``estimate`` admission counts the ratio of them). ``exact`` is the engine unpatched.
``--modes`` the ``cache.reserve_output`` values to run. Prints measured figures only.

    python benchmarks/kv_pressure_reprefill.py --blocks 600 [--set scheduler.short_prefill_tokens=256]
    python benchmarks/kv_pressure_reprefill.py --blocks 1000 --modes all,estimate --reserve exact,512,1024
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker  # noqa: E402
from ainfer_pd.tools.options import add_workload_args, build_trace, load_config  # noqa: E402
from ainfer_pd.engine.kv import prefix  # noqa: E402
from ainfer_pd.tools.replay import replay  # noqa: E402

_EXACT = prefix.left


def budgeted(budget: int | None):
    """``prefix.left`` for a turn asking max(budget, max_new_tokens); None: the engine's own."""
    if budget is None:
        return _EXACT
    return lambda t: max(t.params.max_new_tokens, budget) - len(t.out_tokens)


async def one(a, policy: str, budget: int | None, mode: str) -> str:
    prefix.left = budgeted(budget)
    p = argparse.ArgumentParser()
    add_workload_args(p, preset="tiny")
    args = p.parse_args(["--workload", "grpo-long", "--conversations", str(a.conversations),
                         "--token-scale", str(a.token_scale)])
    cfg = load_config(a.config, [f"cache.num_blocks={a.blocks}", f"scheduler.policy={policy}",
                                 "scheduler.priority=fifo", f"cache.reserve_output={mode}", *a.set])
    trace = build_trace(args, cfg)
    recs = []
    async with RolloutWorker(cfg) as w:
        r = await replay(w, trace, cell=a.cell, seed=0, time_scale=0.1, on_request=recs.append)
        m = w.metrics()
    again = collections.Counter()
    for x in recs:
        again["first" if x.turn == 0 else "continuation"] += max(0, x.num_prompt_tokens - x.num_cached_tokens
                                                                 - x.new_tokens)
    prefix.left = _EXACT
    return (f"FIG kv_pressure_reprefill policy={policy} mode={mode} blocks={a.blocks} reserve={budget or 'exact'} "
            f"set={'+'.join(a.set) or '-'} makespan_s={r.makespan_s:.2f} "
            f"prefill_tokens={m['prefill_tokens']} kv_evictions={m['kv_evictions']} "
            f"preemptions={m['kv_preemptions']} "
            f"again_first={again['first']} again_continuation={again['continuation']} failures={r.failures}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=600)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--token-scale", type=float, default=0.1)
    ap.add_argument("--cell", default="P1")
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--policies", default="normal,fine-grained")
    ap.add_argument("--reserve", default="exact", help="comma-separated response budgets, or exact")
    ap.add_argument("--modes", default="all", help="cache.reserve_output values, comma-separated")
    a = ap.parse_args()
    for r in a.reserve.split(","):
        for mode in a.modes.split(","):
            for policy in a.policies.split(","):
                print(asyncio.run(one(a, policy, None if r == "exact" else int(r), mode)), flush=True)


if __name__ == "__main__":
    main()
