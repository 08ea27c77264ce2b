"""FP8 against bf16 on a trained model (issue 37, "must be measured"): greedy token agreement over
``--tokens`` tokens and the gap between the chosen tokens' log-probabilities.

Both workers load the same checkpoint (default the trained small model,
``tests/data/small_qwen3_moe``): one in ``--dtype`` (bf16), one with ``model.quantization: fp8``
(``--dense``: ``model.fp8_dense`` too) on the same dtype, or with ``--kv`` one whose KV pool is FP8
(``cache.kv_dtype: fp8_e4m3``, weights in ``--dtype``) with per-layer K / V scales ``--kv-scales``:
``unit`` (1.0) or ``calibrated`` (``RolloutWorker.calibrate_kv_scales`` first, on ``--calib-prompts``
prompts of other files than the measured ones, margin 1.25). Each prompt (held-out stdlib code in
the model's chat format, ``spec_acceptance_bench.tasks``) is decoded greedily, EOS ignored. Printed:
per prompt the tokens equal before the first divergence, the token agreement over the whole run,
and over the common prefix the distribution (p50 / p90 / p99 / max) of |logprob_fp8 -
logprob_bf16| of the chosen token; FIG lines.

    python benchmarks/fp8_accuracy_bench.py [--prompts 8] [--tokens 256] [--device cpu] [--dense]
    python benchmarks/fp8_accuracy_bench.py --kv [--kv-scales unit|calibrated] [--calib-prompts 8]

``--teacher-forced``: FP8 decodes one token at every position of the bf16 run's own context (prompt
plus the bf16 tokens before it) instead of running free, so every position is compared at the same
context: the per-position greedy agreement, and |dlogprob| over the positions where the two agree.
``--arch qwen3_moe,qwen2_moe,mixtral,glm4_moe`` (or ``all``): the Hugging Face equivalence models
(``tests/_hf_models.py``: tiny random checkpoints written with transformers, vocabulary 256), each
prompt ``--prompt-len`` random tokens, teacher-forced (a random model's greedy margins are too thin
for a free-running common prefix); one block of lines per architecture.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def calibrate(w, prompts: list[list[int]] | None) -> None:
    """With ``prompts``, the worker's FP8 KV scales are calibrated on them (and printed)."""
    if not prompts:
        return
    s = await w.calibrate_kv_scales(prompts, margin=1.25)
    amax = s * 448 / 1.25
    print(f"calibrated KV scales on {len(prompts)} prompts ({sum(map(len, prompts))} tokens): K "
          f"{float(s[:, 0].min()):.4g}..{float(s[:, 0].max()):.4g}, V {float(s[:, 1].min()):.4g}.."
          f"{float(s[:, 1].max()):.4g} (K / V amax {float(amax.min()):.3g}..{float(amax.max()):.3g})")


async def decode(cfg, prompts: list[list[int]], n: int, calib: list[list[int]] | None = None):
    """Greedy decodes of ``prompts``; with ``calib`` the FP8 KV scales are calibrated on those first."""
    async with RolloutWorker(cfg) as w:
        await calibrate(w, calib)
        outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                                      for p in prompts))
    return [(o.token_ids, o.logprobs) for o in outs]


async def forced(cfg, prompts: list[list[int]], ref: list[list[int]], calib: list[list[int]] | None = None):
    """Per prompt, the greedy token and its logprob at every position of ``ref``'s context."""
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    res = []
    async with RolloutWorker(cfg) as w:
        await calibrate(w, calib)
        for p, r in zip(prompts, ref):
            outs = await asyncio.gather(*(w.generate(p + r[:j], one) for j in range(len(r))))
            res.append(([o.token_ids[0] for o in outs], [o.logprobs[0] for o in outs]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "small_qwen3_moe")
    ap.add_argument("--arch", default="", help="HF equivalence models (comma list, or all) instead of --model")
    ap.add_argument("--prompt-len", type=int, default=64, help="with --arch: random prompt tokens")
    ap.add_argument("--teacher-forced", action="store_true", help="FP8 scored at the bf16 run's contexts")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv", action="store_true", help="FP8 KV cache (weights in --dtype) instead of FP8 weights")
    ap.add_argument("--kv-scales", choices=("unit", "calibrated"), default="unit")
    ap.add_argument("--calib-prompts", type=int, default=None, help="calibration prompts (default --prompts)")
    a = ap.parse_args()
    n_cal = a.prompts if a.calib_prompts is None else a.calib_prompts
    cal = a.kv and a.kv_scales == "calibrated"
    if not a.arch:
        from transformers import AutoTokenizer
        from spec_acceptance_bench import tasks
        tok = AutoTokenizer.from_pretrained(str(a.model))
        texts = tasks(a.prompts + n_cal, a.seed, 1)        # the calibration prompts: the next files', disjoint
        compare(a, a.model, [tok(p)["input_ids"] for p, _ in texts[:a.prompts]],
                [tok(p)["input_ids"] for p, _ in texts[a.prompts:]] if cal else None)
        return
    import _hf_models
    a.teacher_forced = True
    archs = _hf_models.ARCHS if a.arch == "all" else tuple(a.arch.split(","))
    rnd = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            path = _hf_models.build(arch, Path(tmp), seed=a.seed)
            prompts = [[rnd.randrange(2, _hf_models.VOCAB) for _ in range(a.prompt_len)]
                       for _ in range(a.prompts + (n_cal if cal else 0))]
            compare(a, path, prompts[:a.prompts], prompts[a.prompts:] or None, name=arch)


def compare(a, path: Path, prompts: list[list[int]], calib: list[list[int]] | None, name: str = "") -> None:
    """Greedy decoding of ``prompts`` on the checkpoint at ``path`` in ``a.dtype``, and FP8 free-running
    or teacher-forced on it; prints the agreement and the chosen-token log-probability gaps."""
    base = {"model": {"dtype": a.dtype}, "device": {"device": a.device},
            "cache": {"block_size": 16, "num_blocks": 2048}, "scheduler": {"max_decode_batch": 64}}
    ref = asyncio.run(decode(WorkerConfig.from_pretrained(str(path), base), prompts, a.tokens))
    if a.kv:
        q = {**base, "cache": {**base["cache"], "kv_dtype": "fp8_e4m3", "kv_scales": "unit"}}
        what = f"FP8 KV cache (scales {a.kv_scales}{f' on {len(calib)} prompts' if calib else ''})"
    else:
        q = {**base, "model": {**base["model"], "quantization": "fp8", "fp8_dense": a.dense}}
        what = f"FP8 ({'every projection' if a.dense else 'routed experts'})"
    qcfg = WorkerConfig.from_pretrained(str(path), q)
    fp8 = asyncio.run(forced(qcfg, prompts, [t for t, _ in ref], calib) if a.teacher_forced else
                      decode(qcfg, prompts, a.tokens, calib))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    name = name or path.name
    how = "teacher-forced at the bf16 contexts" if a.teacher_forced else "free-running"
    print(f"{what} against {a.dtype}, {name}, "
          f"{a.prompts} prompts x {a.tokens} greedy tokens, FP8 {how}, device {a.device}, commit {commit}")
    if a.teacher_forced:
        report_forced(a, name, ref, fp8)
        return
    gaps, prefixes, agree = [], [], 0
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(ref, fp8)):
        k = next((j for j, (x, y) in enumerate(zip(t0, t1)) if x != y), len(t0))
        prefixes.append(k)
        agree += sum(x == y for x, y in zip(t0, t1))
        g = [abs(x - y) for x, y in zip(l0[:k], l1[:k])]
        gaps += g
        print(f"  prompt {i}: {k} tokens equal before the first divergence; |dlogprob| max {max(g, default=0):.4f}")
    n = sum(len(t) for t, _ in ref)
    print(f"greedy agreement: {agree / n:.3f} of {n} tokens; tokens before the first divergence: median "
          f"{pct(prefixes, 0.5)}, min {min(prefixes)}, {sum(p == a.tokens for p in prefixes)} of {len(prefixes)} "
          f"runs equal throughout")
    print_gaps(gaps, "over the common prefixes")
    print(f"FIG fp8_accuracy model={name} {kind(a)} dtype={a.dtype} agreement={agree / n:.4f} "
          f"prefix_median={pct(prefixes, 0.5)} dlogprob_p50={pct(gaps, 0.5):.5f} dlogprob_p99={pct(gaps, 0.99):.5f} "
          f"dlogprob_max={max(gaps, default=0):.5f} tokens={len(gaps)}")


def print_gaps(gaps: list[float], where: str) -> None:
    print(f"|logprob_fp8 - logprob_ref| of the chosen token {where} ({len(gaps)} tokens): p50 "
          f"{pct(gaps, 0.5):.4f}, p90 {pct(gaps, 0.9):.4f}, p99 {pct(gaps, 0.99):.4f}, max {max(gaps, default=0):.4f}")


def kind(a) -> str:
    return f"kv=1 kv_scales={a.kv_scales}" if a.kv else f"dense={a.dense}"


def report_forced(a, name: str, ref, fp8) -> None:
    """Teacher-forced: position j of both runs has the same context."""
    gaps, agree, n = [], 0, 0
    for i, ((t0, l0), (t1, l1)) in enumerate(zip(ref, fp8)):
        same = [j for j, (x, y) in enumerate(zip(t0, t1)) if x == y]
        agree, n = agree + len(same), n + len(t0)
        g = [abs(l0[j] - l1[j]) for j in same]
        gaps += g
        print(f"  prompt {i}: {len(same)} of {len(t0)} positions agree; |dlogprob| max {max(g, default=0):.4f}")
    print(f"greedy agreement per position: {agree / n:.3f} of {n}")
    print_gaps(gaps, "where they agree")
    print(f"FIG fp8_accuracy model={name} {kind(a)} dtype={a.dtype} teacher_forced=True agreement={agree / n:.4f} "
          f"dlogprob_p50={pct(gaps, 0.5):.5f} dlogprob_p99={pct(gaps, 0.99):.5f} dlogprob_max={max(gaps, default=0):.5f} "
          f"tokens={len(gaps)}")


if __name__ == "__main__":
    main()
