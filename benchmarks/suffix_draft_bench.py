"""The suffix drafter's host cost and acceptance on a synthetic repetitive trace (CPU, pure Python).

The trace: ``--groups`` GRPO groups of ``--siblings`` rows (128 rows by default). Each group has a
prompt and a bank of phrases (3-20 random token ids of a 32k vocabulary, drawn with Zipf weights);
each sibling's output strings phrases together with random noise tokens between them, so a row
repeats itself and its siblings the way reasoning traces do, without any model. The rows advance in
lockstep as a speculating D loop would: per iteration every row drafts k tokens, the drafts are
compared with the row's true next tokens (greedy acceptance: the accepted run, then one token), and
the emitted tokens extend the drafter. With siblings the group shares one index; without, each row
has its own (only its own context). Printed: microseconds per draft (mean, p50, p99) and per 128-row
batch, microseconds per extended token, mean accepted drafts and tokens per verify, the share of
empty drafts, and the index's bytes per token (tracemalloc) on this trace and on random tokens.
The figures are of a synthetic trace: acceptance on a real model's rollouts is measured separately.

    python benchmarks/suffix_draft_bench.py [--groups 16] [--siblings 8] [--out-tokens 1000] [--ks 4,8]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

from ainfer_pd.spec.suffix import SuffixDrafter, SuffixIndex

VOCAB = 32000


def make_group(rng: random.Random, siblings: int, prompt_len: int, out_len: int) -> tuple[list[int], list[list[int]]]:
    bank = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(300)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(len(bank))]

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += rng.choices(bank, weights)[0]
            if rng.random() < 0.3:
                out += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        return out[:n]
    prompt = [rng.randrange(VOCAB) for _ in range(prompt_len // 2)] + text(prompt_len - prompt_len // 2)
    return prompt, [text(out_len) for _ in range(siblings)]


def simulate(groups, k: int, siblings_shared: bool) -> dict:
    d = SuffixDrafter()
    rows = []                                           # (seq id, its true output, emitted so far)
    for g, (prompt, outs) in enumerate(groups):
        for s, out in enumerate(outs):
            sid = (g, s)
            d.extend(sid, prompt, group=g if siblings_shared else sid)
            rows.append([sid, out, 0])
    draft_s, extend_s, accepted, emitted, empty, batches = [], 0.0, [], 0, 0, []
    while True:
        live = [r for r in rows if r[2] < len(r[1])]
        if not live:
            break
        n_before = len(draft_s)
        for r in live:
            t0 = time.perf_counter()
            dr = d.draft(r[0], k)
            draft_s.append(time.perf_counter() - t0)
            out, pos = r[1], r[2]
            a = 0
            while a < len(dr) and pos + a < len(out) and dr[a] == out[pos + a]:
                a += 1
            new = out[pos:pos + a + 1]
            accepted.append(a)
            empty += not dr
            emitted += len(new)
            t0 = time.perf_counter()
            d.extend(r[0], new)
            extend_s += time.perf_counter() - t0
            r[2] += len(new)
        batches.append((sum(draft_s[n_before:]), len(live)))
    us = sorted(x * 1e6 for x in draft_s)
    full = [t * 1e6 for t, n in batches if n == len(rows)]
    return {"us_mean": statistics.fmean(us), "us_p50": us[len(us) // 2], "us_p99": us[int(len(us) * 0.99)],
            "us_batch": statistics.median(full) if full else float("nan"),
            "us_extend_tok": extend_s * 1e6 / emitted, "acc": statistics.fmean(accepted),
            "tok_per_verify": emitted / len(accepted), "empty": empty / len(accepted), "verifies": len(accepted)}


def bytes_per_token(tokens: list[int]) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = SuffixIndex(cap_tokens=len(tokens) + 1)
    for i in range(0, len(tokens), 64):
        ix.extend("s", tokens[i:i + 64])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--siblings", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--out-tokens", type=int, default=1000)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    groups = [make_group(rng, a.siblings, a.prompt_tokens, a.out_tokens) for _ in range(a.groups)]
    print(f"suffix drafter: {a.groups} groups x {a.siblings} siblings = {a.groups * a.siblings} rows, "
          f"prompt {a.prompt_tokens} + output {a.out_tokens} tokens each (synthetic, seed {a.seed})")
    print(f"{'k':>3} {'siblings':>8} {'us/draft':>9} {'p50':>6} {'p99':>6} {'us/batch':>9} {'us/ext tok':>10} "
          f"{'accepted':>8} {'tok/verify':>10} {'empty':>6}")
    for k in (int(x) for x in a.ks.split(",")):
        for shared in (True, False):
            r = simulate(groups, k, shared)
            print(f"{k:>3} {('on' if shared else 'off'):>8} {r['us_mean']:>9.1f} {r['us_p50']:>6.1f} "
                  f"{r['us_p99']:>6.1f} {r['us_batch']:>9.0f} {r['us_extend_tok']:>10.2f} {r['acc']:>8.2f} "
                  f"{r['tok_per_verify']:>10.2f} {r['empty']:>6.1%}")
    prompt, outs = groups[0]
    trace = prompt + [t for o in outs for t in o]
    print(f"index bytes per token: {bytes_per_token(trace):.0f} on one group's trace ({len(trace)} tokens), "
          f"{bytes_per_token([rng.randrange(VOCAB) for _ in range(len(trace))]):.0f} on random tokens")
    print("us/batch: drafting for every row of one full batch (median); accepted / tok/verify: greedy "
          "acceptance against the trace's true continuation")


if __name__ == "__main__":
    main()
