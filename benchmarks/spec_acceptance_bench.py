"""Acceptance of the suffix drafter (``ainfer_pd/spec/suffix.py``) on the trained small model's own
multi-turn rollouts, with and without sibling drafts (issue 38, "must be measured").

1. **Rollouts** with ainfer-pd's public API on CPU: ``RolloutWorker`` over the checkpoint of
   ``trainer_examples/small_model/train.py`` (``--model``, default the committed
   ``tests/data/small_qwen3_moe``). Prompts: 20-60 lines from the first half of held-out stdlib files in the
   chat format the model was trained on (``<|user|>\\n...<|end|><|assistant|>\\n``). Each trajectory
   is ``generate`` then ``--turns - 1`` ``continue_`` calls; an observation is a ``<|tool|>`` turn
   holding either the file's next lines (a stdlib snippet) or a tool-like output (``$ grep -n``
   over the file, numbered lines), then ``<|assistant|>\\n``. Two sets, run concurrently:
   *sampled*: GRPO groups, ``--siblings`` per prompt at ``--temperature``, each turn with its own
   seed; *greedy*: one greedy row per prompt (its own group: no siblings).
2. **Replay** of the drafter exactly as the engine wiring of ``docs/SPECULATIVE.md`` would call it,
   for k = 1..``--max-k``: a turn's context goes in with ``extend`` when it is admitted, its first
   token comes from the prefill (no verify), then every verify step drafts
   ``min(k, max_new_tokens - produced - 1)`` tokens from the context so far (and, with siblings,
   the group's other sequences so far), accepts the longest prefix equal to the row's real next
   tokens, and emits that plus one (clipped at the turn's end); the emitted tokens are appended.
   Rows advance in lockstep, one prefill or verify per iteration, so a sibling's index holds only
   what it had produced by then. A finished trajectory is ``release``-d, as the engine does (its
   tokens stay for its live siblings: the column "+sib kept"); the column "+sib" ``forget``-s it
   instead (the engine before: a released sibling's tokens went with it).
3. **Why a replay is exact here.** Greedy rows: verification accepts a draft while it equals the
   argmax, which is the token plain decoding produced. Sampled rows: suffix drafts are point
   masses and ``spec/verify.py`` samples every position with the sampler's counter noise
   (seed, step + j), so the tokens a speculating row emits are those plain decoding emitted, and a
   draft is accepted iff it equals them. Both are measured by this replay, not estimated.

Printed: the rollouts (rows, tokens, finish reasons, seconds), then per k the accepted drafts per
verify step and the tokens per verify step for greedy rows (own context), sampled rows (own
context only), sampled rows with sibling drafts, and with finished siblings kept; FIG lines.

    python benchmarks/spec_acceptance_bench.py [--model DIR] [--prompts 12] [--siblings 8] [--turns 3]
           [--max-new-tokens 96] [--temperature 1.0] [--max-k 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402
from ainfer_pd.spec.suffix import SuffixDrafter  # noqa: E402
from trainer_examples.small_model.train import read_text, stdlib_files  # noqa: E402

DEFAULT_MODEL = ROOT / "tests" / "data" / "small_qwen3_moe"


# ------------------------------------------------------------------------------------ workload
def tasks(n: int, seed: int, turns: int) -> list[tuple[str, list[str]]]:
    """(prompt text, observation texts) per prompt, from held-out stdlib files (deterministic)."""
    files = [(rel, read_text(p)) for rel, p, held in stdlib_files(Path(sysconfig.get_paths()["stdlib"])) if held]
    files = [(rel, t) for rel, t in files if t and len(t.splitlines()) >= 60]
    out = []
    for i in range(n):
        rel, text = files[i % len(files)]
        rng = random.Random(f"{seed}:{i}:{rel}")
        lines = text.splitlines(keepends=True)
        start = rng.randrange(0, len(lines) // 2)          # a stretch of code, not always the file's header
        a = start + rng.randint(20, 60)
        prompt = f"<|user|>\n{''.join(lines[start:a])}<|end|><|assistant|>\n"
        obs, pos = [], a + 40
        for t in range(turns - 1):
            if t % 2 == 0:                                   # a stdlib snippet: the file's next lines
                n_lines = rng.randint(4, 12)
                body = "".join(lines[pos:pos + n_lines])
                pos += n_lines + 30
            else:                                            # a tool-like output: grep -n over the file
                word = rng.choice(["def ", "return", "self.", "import", "if "])
                hits = [f"{j + 1}:{ln}" for j, ln in enumerate(lines) if word in ln][:rng.randint(4, 10)]
                body = f"$ grep -n {word.strip()!r} Lib/{rel}\n" + "".join(hits)
            obs.append(f"<|tool|>\n{body}<|end|><|assistant|>\n")
        out.append((prompt, obs))
    return out


async def rollout(worker, tok, prompt: str, obs: list[str], params: list[SamplingParams], end_id: int):
    """One trajectory: [("ctx", ids), ("out", ids), ...] and its finish reasons."""
    ids = tok(prompt)["input_ids"]
    o = await worker.generate(ids, params[0])
    segs, reasons = [("ctx", ids), ("out", o.token_ids)], [o.finish_reason]
    for text, p in zip(obs, params[1:]):
        ob = tok(text)["input_ids"]
        if o.finish_reason != "stop":                        # cut by length: close the turn first
            ob = [end_id] + ob
        o = await worker.continue_(o.trajectory_id, ob, p)
        segs += [("ctx", ob), ("out", o.token_ids)]
        reasons.append(o.finish_reason)
    await worker.release(o.trajectory_id)
    return segs, reasons


async def run_rollouts(a, tok) -> tuple[list[dict], float]:
    over = {"model": {"dtype": a.dtype}, "device": {"device": "cpu"},
            "cache": {"block_size": 16, "num_blocks": a.kv_blocks},
            "scheduler": {"policy": a.policy, "max_decode_batch": a.max_decode_batch}}
    cfg = WorkerConfig.from_pretrained(str(a.model), over)
    end_id = tok.convert_tokens_to_ids("<|end|>")
    rows, jobs = [], []
    t0 = time.perf_counter()
    async with RolloutWorker(cfg) as w:
        async with asyncio.TaskGroup() as tg:
            for i, (prompt, obs) in enumerate(tasks(a.prompts, a.seed, a.turns)):
                for s in range(a.siblings + 1):              # siblings 0..S-1 sampled, S = the greedy row
                    greedy = s == a.siblings
                    params = [SamplingParams(max_new_tokens=a.max_new_tokens,
                                             temperature=0.0 if greedy else a.temperature,
                                             seed=_seed(a.seed, i, s, t)) for t in range(a.turns)]
                    rows.append({"group": ("greedy" if greedy else "sampled", i), "greedy": greedy,
                                 "id": (i, s)})
                    jobs.append(tg.create_task(rollout(w, tok, prompt, obs, params, end_id)))
        assert w.kv_leak_free()
    for r, j in zip(rows, jobs):
        r["segs"], r["reasons"] = j.result()
    return rows, time.perf_counter() - t0


def _seed(*xs) -> int:
    return int.from_bytes(hashlib.sha256(repr(xs).encode()).digest()[:8], "little") >> 1


# ------------------------------------------------------------------------------------ replay
def replay(rows: list[dict], k: int, max_new: int, siblings: bool, keep_finished: bool) -> list[dict]:
    """Per row: list of (drafted, accepted, emitted) per verify step, the drafter called as the
    engine would (module docstring, item 2)."""
    d = SuffixDrafter()
    state = [{"seg": 0, "pos": 0, "steps": [], "done": False} for _ in rows]
    while not all(s["done"] for s in state):
        moves = []                                       # this iteration: every live row drafts first ...
        for r, s in zip(rows, state):
            if s["done"]:
                continue
            kind, toks = r["segs"][s["seg"]]
            if kind == "ctx":                            # admission + prefill: context, then the first token
                moves.append((r, s, toks + r["segs"][s["seg"] + 1][1][:1], None))
                continue
            kk = min(k, max_new - s["pos"] - 1)
            dr = d.draft(r["id"], kk) if kk > 0 else []
            a = 0
            while a < len(dr) and s["pos"] + a < len(toks) and dr[a] == toks[s["pos"] + a]:
                a += 1
            emitted = min(a + 1, len(toks) - s["pos"])
            moves.append((r, s, toks[s["pos"]:s["pos"] + emitted], len(dr)))
        for r, s, new, drafted in moves:                 # ... then the iteration's tokens are read
            d.extend(r["id"], new, group=r["group"] if siblings else r["id"])
            if drafted is None:
                s["seg"], s["pos"] = s["seg"] + 1, 1
            else:
                s["steps"].append((drafted, len(new) - 1, len(new)))
                s["pos"] += len(new)
            if s["pos"] >= len(r["segs"][s["seg"]][1]):
                s["seg"] += 1
                if s["seg"] == len(r["segs"]):
                    s["done"] = True
                    if keep_finished:
                        d.release(r["id"])               # released: the engine's
                    else:
                        d.forget(r["id"])                # the comparison: its tokens go
    return [s["steps"] for s in state]


def summary(steps_of_rows: list[list[tuple[int, int, int]]]) -> dict:
    steps = [x for rs in steps_of_rows for x in rs]
    n = len(steps)
    return {"verifies": n, "acc": sum(x[1] for x in steps) / n, "tok": sum(x[2] for x in steps) / n,
            "drafted": sum(x[0] for x in steps) / n, "empty": sum(x[0] == 0 for x in steps) / n}


# ------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--siblings", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy", default="normal")
    ap.add_argument("--max-decode-batch", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    from transformers import AutoTokenizer
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(str(a.model))
    rows, secs = asyncio.run(run_rollouts(a, tok))
    outs = [t for r in rows for kind, t in r["segs"] if kind == "out"]
    reasons = Counter(x for r in rows for x in r["reasons"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"model {a.model} (commit {commit}); {a.prompts} prompts x ({a.siblings} sampled at T={a.temperature} + 1 "
          f"greedy) = {len(rows)} trajectories x {a.turns} turns, max_new_tokens {a.max_new_tokens}: "
          f"{sum(map(len, outs))} tokens generated (mean {sum(map(len, outs)) / len(outs):.1f} a turn; "
          f"{dict(reasons)}) in {secs:.1f}s on CPU ({a.dtype})")
    greedy = [r for r in rows if r["greedy"]]
    sampled = [r for r in rows if not r["greedy"]]
    cols = [("greedy own", "greedy", "own", greedy, False, False),
            ("sampled own", "sampled", "own", sampled, False, False),
            ("sampled +sib", "sampled", "siblings", sampled, True, False),
            ("sampled +sib kept", "sampled", "siblings_kept", sampled, True, True)]
    print("accepted drafts per verify step / tokens per verify step (replay of the suffix drafter; exact for "
          "greedy rows and for seeded sampled rows under spec/verify.py's coupled point-mass rule)")
    print(f"{'k':>2} " + " ".join(f"{c[0]:>17}" for c in cols) + f" {'empty drafts':>12}")
    figs = []
    for k in range(1, a.max_k + 1):
        cells, empty = [], []
        for _, rows_key, drafts_key, rs, sib, keep in cols:
            m = summary(replay(rs, k, a.max_new_tokens, sib, keep))
            cells.append(f"{m['acc']:>7.3f} / {m['tok']:>6.3f}")
            empty.append(f"{m['empty']:.0%}")
            figs.append(f"FIG spec_acceptance k={k} rows={rows_key} drafts={drafts_key} "
                        f"accepted_per_verify={m['acc']:.3f} tokens_per_verify={m['tok']:.3f} "
                        f"verifies={m['verifies']} empty_drafts={m['empty']:.3f}")
        print(f"{k:>2} " + " ".join(f"{c:>17}" for c in cells) + f" {'/'.join(empty):>12}")
    print("empty drafts: share of verify steps with no draft (no earlier match of the last 3 tokens), per column")
    print("\n".join(figs))

if __name__ == "__main__":
    main()
