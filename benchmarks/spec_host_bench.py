"""The speculator's host time in a rollout (issue 38: fine-grained with speculation on ran 5% slower
than off on the H100, normal at parity): ``spec_bench.py makespan``'s workload on the trained small
model, one run per ``--policies`` entry, speculation on with a given verify cost table (default:
every width ~1.0-1.1x a plain pass, like the small model's on a GPU, so every batch is worth a
probe), and around the speculator's loop calls a timer: calls and total ms of ``worth_drafting``,
``stale_hit`` and ``plan``, and how many times the D loop read an overlapped iteration early
(``settles``: each one gives the overlap up), and the speculator's estimates of a drafting
iteration's host time and of the device idle it causes (``host_ms``, ``lost_ms``). Runs on the CPU VM (``--device cpu``, float32) or a
GPU host.

    python benchmarks/spec_host_bench.py [--device cpu] [--policies fine-grained,normal] [--reps 1]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ainfer_pd import WorkerConfig  # noqa: E402
from ainfer_pd.engine.loop.d_driver import DDriver  # noqa: E402
from ainfer_pd.spec.speculator import Speculator  # noqa: E402

TIMED = ("worth_drafting", "stale_hit", "plan")


def _instrument(acc: dict) -> None:
    """Time the speculator's loop calls and count the early reads of an overlapped iteration."""
    for name in TIMED:
        f = getattr(Speculator, name)

        @functools.wraps(f)
        def timed(*a, _f=f, _n=name, **kw):
            t0 = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                s = acc.setdefault(_n, [0, 0.0])
                s[0] += 1
                s[1] += time.perf_counter() - t0
        setattr(Speculator, name, timed)
    settle = DDriver.settle

    async def counted(self):
        if self.prev is not None:
            acc["settles"] = acc.get("settles", 0) + 1
        return await settle(self)
    DDriver.settle = counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "small_qwen3_moe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--policies", default="fine-grained")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--ratios", default="1.025,1.05,1.1", help="verify cost of widths 2,3,5 over 1")
    a = ap.parse_args()
    import torch
    from transformers import AutoTokenizer
    import spec_bench
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(a.model))
    w = argparse.Namespace(prompts=12, siblings=8, turns=3, max_new_tokens=96, temperature=1.0, k=4, seed=0,
                           arrival_s=1.0, tool_wait_s=0.3)
    r2, r3, r5 = (float(x) for x in a.ratios.split(","))
    times = {B: {1: 2e-3, 2: 2e-3 * r2, 3: 2e-3 * r3, 5: 2e-3 * r5} for B in (1, 4, 16, 64, 128)}
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    acc: dict = {}
    _instrument(acc)
    print(f"spec host time, model {a.model.name}, device {a.device} {dtype}, commit {spec_bench.commit()}, "
          f"verify ratios {a.ratios}")
    for policy in a.policies.split(","):
        over = {"model": {"dtype": dtype}, "device": {"device": a.device}, "cache": {"block_size": 16, "num_blocks": 8192},
                "scheduler": {"max_decode_batch": 128, "policy": policy},
                "spec": {"method": "suffix", "num_draft_tokens": 4, "verify_costs": times}}
        cfg = WorkerConfig.from_pretrained(str(a.model), over)
        for r in range(a.reps):
            acc.clear()
            span, _, m, spec = asyncio.run(spec_bench._rollout(w, tok, cfg, "p1"))
            calls = " ".join(f"{n}={acc.get(n, [0, 0.0])[0]}/{1e3 * acc.get(n, [0, 0.0])[1]:.1f}ms" for n in TIMED)
            total = 1e3 * sum(acc.get(n, [0, 0.0])[1] for n in TIMED)
            print(f"FIG spec_host policy={policy} rep={r} makespan_s={span:.3f} d_iters={m.get('d_iter_s_count', 0)} "
                  f"spec_loop_ms={total:.1f} {calls} settles={acc.get('settles', 0)} "
                  f"verifies={spec.get('spec_verifies', 0)} drafted={spec.get('spec_drafted', 0)} "
                  f"accepted={spec.get('spec_accepted', 0)} empty_plans={spec.get('spec_empty_plans', 0)} "
                  f"host_ms={spec.get('spec_host_ms', 0.0):.2f} lost_ms={spec.get('spec_lost_ms', 0.0):.2f}")


if __name__ == "__main__":
    main()
