"""Speculative decoding measured through the engine (issue 38, "must be measured").

``verify-costs``: the verify cost curve, one D iteration of B rows verifying k drafts each
(B * (k + 1) decode rows, graph replay where a bucket fits) against one token per row, on a
config's model (``--config``, default the Qwen3-30B-A3B shape, random weights: the cost does not
depend on them), with ``ainfer_pd.engine.runtime.verify_costs.measure_verify_costs`` (what the
engine measures at start). Graphs are captured for up to ``--max-graph-rows`` rows.

``makespan``: the trained small model's multi-turn rollouts (``spec_acceptance_bench``'s workload:
held-out stdlib code, GRPO groups of ``--siblings`` sampled rows plus one greedy row per prompt,
``--turns`` turns with observations), through ``RolloutWorker`` with speculation off and on
(``spec.method suffix``, adaptive, the cost table measured at start), per policy, ``--reps`` times
each, the off and on runs interleaved (ABBA: a drift of the machine falls on both). Two arrival
shapes: ``p1`` (every trajectory at once, observations returned at once) and ``trace`` (trajectories
arrive over ``--arrival-s`` and each observation comes after a tool wait of ``--tool-wait-s`` +-
50%). Printed: makespan, D iterations, drafts verified / accepted, the tokens a verifying row
emitted per pass and the tokens generated, with each run's breakdown (D build / launch / post, P
epochs); FIG lines, and per cell the ratio of the medians and the paired ratios (the i-th on run
over the i-th off run, neighbours in time). Outputs are compared with the first spec-off run's
(greedy and seeded rows: equal in float32; in bf16 a batch's composition changes GEMM shapes and may
flip a token, so runs also differ in length).

    python benchmarks/spec_bench.py verify-costs [--config configs/qwen3-30b-a3b-shape.yaml]
    python benchmarks/spec_bench.py makespan [--device cuda] [--policies normal,fine-grained] [--reps 3]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402
from ainfer_pd.tools.report import breakdown  # noqa: E402
from benchmarks._ratio_ci import ratio_ci_text  # noqa: E402


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"


# ------------------------------------------------------------------------------------ verify costs
def verify_costs(a) -> None:
    import torch
    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
    from ainfer_pd.engine.runtime.verify_costs import measure_verify_costs
    from ainfer_pd.phase import Phase, PhaseContext
    batches = tuple(int(x) for x in a.batches.split(","))
    widths = tuple(int(x) for x in a.widths.split(","))
    sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= a.max_graph_rows)
    cfg = WorkerConfig.from_yaml(a.config).replace(**{
        "cache.num_blocks": max(batches) * (-(-(a.context + max(widths)) // 16)) + 64, "device.device": a.device,
        "scheduler.max_decode_batch": max(batches), "device.graph_batch_sizes": sizes,
        "device.graph_context_tiers": (), "device.graph_max_context": a.context + 64,
        "spec.method": "suffix", "spec.num_draft_tokens": max(widths) - 1, "spec.adaptive": False})
    dev = torch.device(a.device)
    kv = KVCacheManager(cfg.cache.num_blocks, cfg.cache.block_size)
    runner = ModelRunner(RunnerSections.from_config(cfg), dev, kv)
    ctx = PhaseContext(Phase.DECODE, None)
    t0 = time.perf_counter()
    with torch.inference_mode():
        if dev.type == "cuda":
            runner.capture_decode_graphs(ctx)
            print(f"captured {len(runner.graphs.graphs)} decode graphs (rows {sizes}) in {time.perf_counter() - t0:.1f} s")
        times = measure_verify_costs(runner, ctx, batches, widths, a.context, reps=a.reps)
        alone = measure_verify_costs(runner, ctx, batches, widths, a.context, reps=a.reps, grouped=False) \
            if a.compare_alone else None
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"verify cost, {a.config}, context {a.context}, commit {commit()}, {where}; a turn's rows attend in "
          f"groups of {runner.sections.verify_width}")
    for name, t in (("grouped", times), ("rows alone", alone)):
        if t is None:
            continue
        print(f"{name}:\n{'B':>5} " + " ".join(f"{'k+1=' + str(w):>16}" for w in widths))
        for B in batches:
            print(f"{B:>5} " + " ".join(f"{t[B][w] * 1e3:8.2f} ms {t[B][w] / t[B][1]:4.2f}x" for w in widths))
    for B in batches:
        for w in widths:
            extra = f" alone_ms={alone[B][w] * 1e3:.3f}" if alone is not None else ""
            print(f"FIG spec_verify_cost B={B} width={w} rows={B * w} ms={times[B][w] * 1e3:.3f} "
                  f"ratio={times[B][w] / times[B][1]:.3f} graph={B * w <= max(sizes)}{extra}")
    k3 = [times[B][4] / times[B][1] for B in batches if B <= 32 and 4 in widths]
    if k3:
        print(f"TARGET verify k=3 at B<=32 <= 1.2x: worst {max(k3):.3f}x -> {'met' if max(k3) <= 1.2 else 'MISSED'}")


# ------------------------------------------------------------------------------------ makespan
async def _trajectory(w, prompt: list[int], obs: list[list[int]], params: list[SamplingParams], end_id: int,
                      t_start: float, waits: list[float]):
    await asyncio.sleep(t_start)
    o = await w.generate(prompt, params[0])
    outs = [o.token_ids]
    for ob, p, wait in zip(obs, params[1:], waits):
        await asyncio.sleep(wait)
        if o.finish_reason != "stop":
            ob = [end_id] + ob
        o = await w.continue_(o.trajectory_id, ob, p)
        outs.append(o.token_ids)
    await w.release(o.trajectory_id)
    return outs


async def _rollout(a, tok, cfg, shape: str):
    from spec_acceptance_bench import _seed, tasks
    end_id = tok.convert_tokens_to_ids("<|end|>")
    rng = random.Random(a.seed)
    # the texts (read from the stdlib) and their token ids before the clock starts: ~1 s of file
    # globbing and tokenizing on the CPU VM was inside the makespan
    work = [(tok(prompt)["input_ids"], [tok(t)["input_ids"] for t in obs])
            for prompt, obs in tasks(a.prompts, a.seed, a.turns)]
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0.0))
        await w.release(warm.trajectory_id)
        m0 = w.metrics()
        jobs = []
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for i, (prompt, obs) in enumerate(work):
                for s in range(a.siblings + 1):
                    greedy = s == a.siblings
                    params = [SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0 if greedy else a.temperature,
                                             seed=_seed(a.seed, i, s, t)) for t in range(a.turns)]
                    start = rng.uniform(0, a.arrival_s) if shape == "trace" else 0.0
                    waits = [rng.uniform(0.5, 1.5) * a.tool_wait_s if shape == "trace" else 0.0
                             for _ in range(a.turns - 1)]
                    jobs.append(tg.create_task(_trajectory(w, prompt, obs, params, end_id, start, waits)))
        makespan = time.perf_counter() - t0
        m = w.metrics()
    spec = {k: m[k] - m0.get(k, 0) for k in ("spec_verifies", "spec_drafted", "spec_accepted", "spec_empty_plans",
                                             "spec_rows_skipped") if k in m}
    return makespan, [j.result() for j in jobs], m, spec


def _order(reps: int) -> list[bool]:
    """Spec off / on per run, interleaved in ABBA blocks (off, on, on, off, ...): a drift of the
    machine over the cell (clocks, caches, the host's other load) falls on both sides alike, which
    running every off rep before every on rep does not."""
    return [(r % 4) in (1, 2) for r in range(2 * reps)]


def makespan(a) -> None:
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(a.model))
    torch.set_num_threads(2)
    base = {"model": {"dtype": a.dtype}, "device": {"device": a.device},
            "cache": {"block_size": 16, "num_blocks": a.kv_blocks},
            "scheduler": {"max_decode_batch": a.max_decode_batch}}
    print(f"makespan, model {a.model}, {a.prompts} prompts x ({a.siblings} sampled T={a.temperature} + 1 greedy) x "
          f"{a.turns} turns, max_new_tokens {a.max_new_tokens}, device {a.device} {a.dtype}, commit {commit()}; "
          f"spec off / on interleaved (ABBA), {a.reps} of each")
    for shape in a.shapes.split(","):
        for policy in a.policies.split(","):
            cfgs = {}
            for spec_on in (False, True):
                over = {**base, "scheduler": {**base["scheduler"], "policy": policy}}
                if spec_on:
                    over["spec"] = {"method": "suffix", "num_draft_tokens": a.k}
                cfgs[spec_on] = WorkerConfig.from_pretrained(str(a.model), over)
            ref = None
            spans: dict[bool, list[float]] = {False: [], True: []}
            toks: dict[bool, list[int]] = {False: [], True: []}
            for spec_on in _order(a.reps):
                r = len(spans[spec_on])
                span, outs, m, spec = asyncio.run(_rollout(a, tok, cfgs[spec_on], shape))
                spans[spec_on].append(span)
                toks[spec_on].append(sum(len(t) for traj in outs for t in traj))
                if ref is None:
                    ref = outs
                same = outs == ref
                acc = spec.get("spec_accepted", 0) / max(1, spec.get("spec_drafted", 0))
                print(f"FIG spec_makespan shape={shape} policy={policy} spec={'on' if spec_on else 'off'} rep={r} "
                      f"makespan_s={span:.3f} d_iters={m.get('d_iter_s_count', 0)} "
                      f"verifies={spec.get('spec_verifies', 0)} drafted={spec.get('spec_drafted', 0)} "
                      f"accepted={spec.get('spec_accepted', 0)} acceptance={acc:.3f} "
                      f"empty_plans={spec.get('spec_empty_plans', 0)} rows_skipped={spec.get('spec_rows_skipped', 0)} "
                      f"outputs_equal_off={same} tokens={toks[spec_on][-1]}")
                print(f"    {breakdown(m)}")    # where the time went: a spec-on D loop against off's
            for spec_on in (False, True):
                s = spans[spec_on]
                print(f"{shape:>6} {policy:>13} spec {'on ' if spec_on else 'off'}: makespan "
                      f"{statistics.median(s):.3f} s (median of {a.reps}: {', '.join(f'{x:.3f}' for x in s)})")
            ratios = [on / off for off, on in zip(spans[False], spans[True])]
            # bf16 runs emit different token counts (a batch's composition changes its GEMMs): the
            # makespan per token emitted, paired the same way, takes that out of the comparison
            per_tok = [(on / ton) / (off / tof) for off, on, tof, ton in zip(spans[False], spans[True], toks[False], toks[True])]
            print(f"FIG spec_makespan_ratio shape={shape} policy={policy} on_over_off_median="
                  f"{statistics.median(spans[True]) / statistics.median(spans[False]):.3f} paired_ratios="
                  f"{','.join(f'{x:.3f}' for x in ratios)} paired_median={statistics.median(ratios):.3f} "
                  f"paired_min={min(ratios):.3f} paired_max={max(ratios):.3f} "
                  f"paired_per_token_median={statistics.median(per_tok):.3f} {ratio_ci_text(ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify-costs")
    v.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    v.add_argument("--batches", default="1,16,32,64,128")
    v.add_argument("--widths", default="1,2,4,8")
    v.add_argument("--context", type=int, default=2048)
    v.add_argument("--max-graph-rows", type=int, default=1024)
    v.add_argument("--reps", type=int, default=5)
    v.add_argument("--device", default="cuda")
    v.add_argument("--compare-alone", action="store_true",
                   help="also time every row's attention alone (no verify groups): the grouping's gain")
    m = sub.add_parser("makespan")
    m.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "small_qwen3_moe")
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--policies", default="normal,fine-grained")
    m.add_argument("--shapes", default="p1,trace")
    m.add_argument("--reps", type=int, default=3)
    m.add_argument("--prompts", type=int, default=12)
    m.add_argument("--siblings", type=int, default=8)
    m.add_argument("--turns", type=int, default=3)
    m.add_argument("--max-new-tokens", type=int, default=96)
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--k", type=int, default=4)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--arrival-s", type=float, default=1.0)
    m.add_argument("--tool-wait-s", type=float, default=0.3)
    m.add_argument("--max-decode-batch", type=int, default=128)
    m.add_argument("--kv-blocks", type=int, default=8192)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    verify_costs(a) if a.cmd == "verify-costs" else makespan(a)


if __name__ == "__main__":
    main()
