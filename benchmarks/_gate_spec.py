"""The GPU gate's ``spec`` section (issue 38): speculative decoding on the GPU path.

The trained small model (``tests/data/small_qwen3_moe``) in float32, through ``RolloutWorker`` with
its decode graphs, under fine-grained: ``--trajectories`` greedy trajectories of two turns on
held-out standard-library code and a tool-like observation (``spec_acceptance_bench``'s tasks, in the
model's tokenizer: real text, so suffix drafts from the trajectory's own context match), with
``spec.method: suffix`` (4 drafts, not adaptive: every iteration with a draft verifies, whatever the
costs measured on this machine) against ``none``. Checks:

* ``spec_greedy_equals_plain``: every turn's tokens equal decoding without speculation (exact
  verification; float32 keeps the two runs' different batch shapes from flipping near-ties);
* ``spec_drafts_accepted``: the verify path ran and accepted drafts (what makes it more than plain
  decoding);
* ``spec_kv_leak_free``: every KV block back after the releases.

Figures: verifies, drafted / accepted drafts, tokens a verifying row emitted per pass, the two
runs' wall times. Run by ``benchmarks/gpu_gate.py`` (``--only spec``) as a subprocess: ``python
benchmarks/_gate_spec.py --json OUT``; ``--device cpu`` runs the same on the CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402

try:                                  # benchmarks/ on sys.path (the gate) or benchmarks as a package (tests)
    from _gate_section import record
except ImportError:
    from benchmarks._gate_section import record

MODEL = ROOT / "tests" / "data" / "small_qwen3_moe"
SPEC_KEYS = ("spec_verifies", "spec_drafted", "spec_accepted", "spec_empty_plans", "spec_rows_skipped")


async def _rollout(cfg: WorkerConfig, work: list, tokens: int) -> tuple[list, dict, float, bool]:
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        await w.release(warm.trajectory_id)
        m0 = w.metrics()

        async def one(prompt: list[int], obs: list[int]) -> list:
            o = await w.generate(prompt, greedy)
            o2 = await w.continue_(o.trajectory_id, obs, greedy)
            await w.release(o.trajectory_id)
            return [list(o.token_ids), list(o2.token_ids)]

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            jobs = [tg.create_task(one(p, o)) for p, o in work]
        wall = time.perf_counter() - t0
        m = w.metrics()
        leak_free = w.kv_leak_free()
    spec = {k: m.get(k, 0) - m0.get(k, 0) for k in SPEC_KEYS}
    spec["spec_tokens_per_row_pass"] = round(m.get("spec_tokens_per_row_pass", 0.0), 3)
    return [j.result() for j in jobs], spec, wall, leak_free


def workload(n: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, observation) token lists: held-out standard-library code and a tool output
    (``spec_acceptance_bench``'s tasks), in the model's own tokenizer."""
    from tokenizers import Tokenizer

    from spec_acceptance_bench import tasks
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    return [(tok.encode(p).ids, tok.encode(obs[0]).ids) for p, obs in tasks(n, 0, 2)]


def run(device: str, n: int, tokens: int) -> dict:
    over = {"model": {"dtype": "float32"}, "device": {"device": device},
            "cache": {"block_size": 16, "num_blocks": 2048}, "scheduler": {"policy": "fine-grained"}}
    plain_cfg = WorkerConfig.from_pretrained(str(MODEL), over)
    spec_cfg = WorkerConfig.from_pretrained(str(MODEL), {**over, "spec": {"method": "suffix", "num_draft_tokens": 4,
                                                                       "adaptive": False}})
    work = workload(n)
    plain, _, plain_s, plain_free = asyncio.run(_rollout(plain_cfg, work, tokens))
    spec, sm, spec_s, spec_free = asyncio.run(_rollout(spec_cfg, work, tokens))
    turns = [(a, b) for p, s in zip(plain, spec) for a, b in zip(p, s)]
    equal = sum(a == b for a, b in turns)
    first = next((i for i, (a, b) in enumerate(turns) if a != b), None)
    checks = {
        "spec_greedy_equals_plain": (equal == len(turns), f"{equal} of {len(turns)} turns equal ({n} trajectories x 2 "
                                     f"turns x {tokens} tokens, float32, fine-grained)"
                                     + ("" if first is None else f"; turn {first} first differs")),
        "spec_drafts_accepted": (sm["spec_verifies"] > 0 and sm["spec_accepted"] > 0,
                                 f"{sm['spec_verifies']} verifies, {sm['spec_accepted']} of {sm['spec_drafted']} "
                                 f"drafts accepted"),
        "spec_kv_leak_free": (plain_free and spec_free, f"plain {plain_free}, suffix {spec_free}"),
    }
    figures = {"spec_small_model_greedy": {**sm, "wall_s_plain": round(plain_s, 3), "wall_s_suffix": round(spec_s, 3),
                                           "acceptance": round(sm["spec_accepted"] / max(1, sm["spec_drafted"]), 3)}}
    return {"checks": checks, "figures": figures}


def section(out_dir: Path, run_sub, check, fig, *, timeout: int = 240) -> None:
    """``benchmarks/gpu_gate.py``'s ``spec`` part: this module as a subprocess on the GPU, its checks
    and figures recorded through the gate's ``check`` / ``fig``."""
    js, log = out_dir / "spec.json", out_dir / "spec.log"
    js.unlink(missing_ok=True)
    rc = run_sub("spec", [sys.executable, str(Path(__file__).resolve()), "--json", str(js)], timeout, log)
    record("spec", rc, js, log, check, fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where the checks and figures go")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    try:
        res = run(args.device, args.trajectories, args.tokens)
    except Exception as exc:  # noqa: BLE001 - recorded as the section's failed check
        traceback.print_exc()
        res = {"checks": {"spec_section_ran": (False, f"{type(exc).__name__}: {exc}"[:500])}, "figures": {}}
    Path(args.json).write_text(json.dumps(res, indent=1))
    for name, (ok, detail) in res["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    sys.exit(0 if all(ok for ok, _ in res["checks"].values()) else 1)


if __name__ == "__main__":
    main()
