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
runs' wall times.

The gate's ``mtp`` section (``--part mtp``, its own subprocess: ``spec.method: mtp`` on its decode
graphs, :func:`run_mtp`): the tiny glm4_moe with an MTP layer
fitted to its own greedy rollouts (``tests/_mtp_model.py``, as ``tests/test_spec_mtp.py`` builds it),
float32, two trajectories of two turns, against plain decoding and against the same MTP worker
without CUDA graphs (eager catch-up):

* ``spec_mtp_decode_graphs``: every D iteration replayed a decode graph (the pass and its catch-up;
  on the CPU: every one ran eagerly, there are no graphs);
* ``spec_mtp_greedy_equals_plain``: the tokens equal plain decoding's;
* ``spec_mtp_drafts_match_eager``: the drafts of the graph run equal the eager run's at >= 95% of
  the planned rows (both verify the same greedy sequence; padding to a bucket may flip a near-tie),
  and drafts were accepted;
* ``spec_mtp_kv_leak_free``: every KV block and stash back after the releases;
* CUDA only, ``spec_mtp_bf16_prefill_graphs``: the same in bfloat16, where P passes replay the P
  graphs and their catch-up reads the hidden states those leave: P graphs replayed, every D
  iteration on a decode graph, drafts accepted, and the drafts equal those of a run with no graphs
  at all at >= 80% of the planned rows (bf16: the graphs' padding flips more near-ties). Run by ``benchmarks/gpu_gate.py`` (``--only spec``) as a subprocess: ``python
benchmarks/_gate_spec.py --json OUT``; ``--device cpu`` runs the same on the CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402

try:                                  # benchmarks/ on sys.path (the gate) or benchmarks as a package (tests)
    from _gate_section import finish, run_section
except ImportError:
    from benchmarks._gate_section import finish, run_section

MODEL = ROOT / "tests" / "data" / "small_qwen3_moe"
SPEC_KEYS = ("spec_verifies", "spec_drafted", "spec_accepted", "spec_empty_plans", "spec_rows_skipped")


async def _rollout(cfg: WorkerConfig, work: list, tokens: int) -> tuple[list, dict, float, bool]:
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        await w.release(warm.trajectory_id)
        m0 = w.metrics()
        r = w.engine.runner
        paths0, replays0 = dict(r.decode_paths), _replays(r.graphs)

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
        paths = {k: n - paths0.get(k, 0) for k, n in r.decode_paths.items()}
        replays = tuple(a - b for a, b in zip(_replays(r.graphs), replays0))
    spec = {k: m.get(k, 0) - m0.get(k, 0) for k in SPEC_KEYS}
    spec["d_paths"], spec["plain_verify_replays"] = paths, replays
    spec["spec_tokens_per_row_pass"] = round(m.get("spec_tokens_per_row_pass", 0.0), 3)
    return [j.result() for j in jobs], spec, wall, leak_free


def _replays(graphs) -> tuple[int, int]:
    """(replays of plain decode graphs, of verify graphs) so far."""
    return (0, 0) if graphs is None else (graphs.num_replays - graphs.num_verify_replays, graphs.num_verify_replays)


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
    if device == "cuda":          # a plain pass replays a plain graph, a verify pass a verify graph (turn groups)
        plain_n, verify_n = sm["plain_verify_replays"]
        paths = sm["d_paths"]
        checks["spec_passes_replay_their_graph_sets"] = (
            paths["graph"] == sum(paths.values()) and plain_n > 0 and 0 < verify_n <= sm["spec_verifies"],
            f"D iterations by path {paths}; replays of plain graphs {plain_n}, of verify graphs {verify_n} "
            f"({sm['spec_verifies']} verifies)")
    figures = {"spec_small_model_greedy": {**sm, "wall_s_plain": round(plain_s, 3), "wall_s_suffix": round(spec_s, 3),
                                           "acceptance": round(sm["spec_accepted"] / max(1, sm["spec_drafted"]), 3)}}
    return {"checks": checks, "figures": figures}


MTP_PROMPTS = [list(range(5, 25)), [9, 200, 31, 77, 12, 140, 66, 3, 250, 18, 42]]
MTP_OBS = [7, 8, 9, 101]


def _mtp_checkpoint(tmp: Path) -> Path:
    """The tiny glm4_moe with its MTP layer fitted to the target's greedy two-turn rollouts."""
    from tests import _hf_models, _mtp_model
    model, mtp = _mtp_model.make(0)
    seqs = []
    for p in MTP_PROMPTS:
        c = _hf_models.hf_greedy(model, p, 24)[0]
        seqs.append(p + c + MTP_OBS + _hf_models.hf_greedy(model, p + c + MTP_OBS, 24)[0])
    _mtp_model.fit(model, mtp, seqs, steps=15)
    return _mtp_model.save(model, mtp, tmp / "mtp")


async def _mtp_rollout(cfg: WorkerConfig, after=None) -> tuple[list, list, dict, dict, bool]:
    """(tokens of every turn, the drafts of every planned row, the metrics, the D paths, leak-free);
    ``after(worker)`` runs once the turns are done."""
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    drafts: list = []
    async with RolloutWorker(cfg) as w:
        sp = w.engine.spec
        if sp is not None:
            plan = sp.plan

            def recording(rows, *a):
                batch = plan(rows, *a)
                drafts.extend(((t.context[0], t.seq_len), sp.drafter.draft(t.tid, sp.cap(t))) for t in rows)
                return batch
            sp.plan = recording
        outs = await asyncio.gather(*(w.generate(p, greedy) for p in MTP_PROMPTS))
        nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, MTP_OBS, greedy) for o in outs))
        m, paths = w.metrics(), dict(w.engine.runner.decode_paths)
        if after is not None:
            after(w)
        for o in outs:
            await w.release(o.trajectory_id)
        free = w.kv_leak_free() and (sp is None or not sp.drafter.stash)
    return [list(o.token_ids) for o in outs + nxt], drafts, m, paths, free


def _agreement(drafts: list, other: list) -> tuple[int, float]:
    """(rows of ``drafts`` drafted as in ``other``, their share): rows keyed by (first prompt token,
    sequence length)."""
    by = dict(other)
    same = sum(by.get(key) == d for key, d in drafts)
    return same, same / max(1, len(drafts))


def _mtp_bf16(path: str, over: dict, spec: dict) -> dict:
    """``spec_mtp_bf16_prefill_graphs`` (module docstring): P graphs at every prompt size."""
    over = {**over, "model": {"dtype": "bfloat16"}}
    cfg = WorkerConfig.from_pretrained(path, {**over, **spec})
    replays = {}
    _, drafts, m, paths, free = asyncio.run(_mtp_rollout(cfg, after=lambda w: replays.update(
        p=w.engine.runner.pgraphs.num_replays if w.engine.runner.pgraphs is not None else 0)))
    bare = {**over, "device": {**over["device"], "cuda_graphs": False, "prefill_graphs": False}}
    _, bare_drafts, _, _, _ = asyncio.run(_mtp_rollout(WorkerConfig.from_pretrained(path, {**bare, **spec})))
    same, agree = _agreement(drafts, bare_drafts)
    iters = sum(paths.values())
    ok = replays.get("p", 0) > 0 and iters > 0 and paths.get("graph", 0) == iters and m.get("spec_accepted", 0) > 0 \
        and agree >= 0.8 and free
    return {"spec_mtp_bf16_prefill_graphs": (ok, f"P graph replays {replays.get('p', 0)}, D paths {paths}, "
                                                 f"{m.get('spec_accepted', 0)} of {m.get('spec_drafted', 0)} drafts "
                                                 f"accepted, {same} of {len(drafts)} rows drafted as without graphs, "
                                                 f"leak-free {free}")}


def run_mtp(device: str) -> dict:
    """``spec.method: mtp`` on the decode graphs (module docstring)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = str(_mtp_checkpoint(Path(tmp)))
        over = {"model": {"dtype": "float32"}, "device": {"device": device},
                "cache": {"block_size": 16, "num_blocks": 256}, "scheduler": {"max_decode_batch": 16}}
        spec = {"spec": {"method": "mtp", "num_draft_tokens": 3, "adaptive": False}}
        plain, _, _, _, plain_free = asyncio.run(_mtp_rollout(WorkerConfig.from_pretrained(path, over)))
        got, drafts, m, paths, free = asyncio.run(_mtp_rollout(WorkerConfig.from_pretrained(path, {**over, **spec})))
        eager_over = {**over, "device": {"device": device, "cuda_graphs": False}}
        _, eager_drafts, _, eager_paths, eager_free = asyncio.run(
            _mtp_rollout(WorkerConfig.from_pretrained(path, {**eager_over, **spec})))
        bf16 = _mtp_bf16(path, over, spec) if device == "cuda" else {}
    same, agree = _agreement(drafts, eager_drafts)
    want = "graph" if device == "cuda" else "eager-no-graphs"
    iters = sum(paths.values())
    return {
        "checks": {
            "spec_mtp_decode_graphs": (iters > 0 and paths.get(want, 0) == iters, f"D iterations by path {paths} "
                                       f"(want all {want}); eager run {eager_paths}"),
            "spec_mtp_greedy_equals_plain": (got == plain, f"{sum(a == b for a, b in zip(got, plain))} of {len(plain)} "
                                             f"turns equal (float32, 2 trajectories x 2 turns)"),
            "spec_mtp_drafts_match_eager": (agree >= 0.95 and m.get("spec_accepted", 0) > 0,
                                            f"{same} of {len(drafts)} planned rows drafted as the eager run did; "
                                            f"{m.get('spec_accepted', 0)} of {m.get('spec_drafted', 0)} drafts accepted"),
            "spec_mtp_kv_leak_free": (plain_free and free and eager_free, f"plain {plain_free}, mtp graphs {free}, "
                                      f"mtp eager {eager_free}"), **bf16},
        "figures": {"spec_mtp_tiny": {"verifies": m.get("spec_verifies", 0), "drafted": m.get("spec_drafted", 0),
                                      "accepted": m.get("spec_accepted", 0), "draft_agreement_with_eager": round(agree, 3),
                                      "tokens_per_row_pass": round(m.get("spec_tokens_per_row_pass", 0.0), 3)}}}


def section(out_dir: Path, run_sub, check, fig, *, part: str = "suffix", timeout: int = 300) -> None:
    """``benchmarks/gpu_gate.py``'s ``spec`` (``part`` suffix) or ``mtp`` section: this module as a
    subprocess on the GPU, its checks and figures recorded through the gate's ``check`` / ``fig``."""
    run_section("spec" if part == "suffix" else part, Path(__file__).resolve(), ["--part", part], out_dir, run_sub,
                check, fig, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="where the checks and figures go")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--part", default="suffix", choices=("suffix", "mtp"),
                    help="suffix: the small model's suffix drafts (the gate's spec section); mtp: the MTP checks")
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    try:
        res = run(args.device, args.trajectories, args.tokens) if args.part == "suffix" else run_mtp(args.device)
    except Exception as exc:  # noqa: BLE001 - recorded as the section's failed check
        traceback.print_exc()
        res = {"checks": {f"{'spec' if args.part == 'suffix' else 'mtp'}_section_ran": (False, f"{type(exc).__name__}: {exc}"[:500])},
               "figures": {}}
    finish(res, args.json)


if __name__ == "__main__":
    main()
