"""Exact verification of drafts (ainfer_pd.spec.verify): greedy and seeded sampled decoding are
token-for-token the same with speculation as without; the first (and second) emitted token is
distributed as the target's, checked by a chi-square test that also rejects two wrong rules;
accepted-length bookkeeping, the target's logprobs, bad rows and bad input."""
from __future__ import annotations

import math
import random

import pytest
import torch

from ainfer_pd.engine.model.sampler import SampleRow, sample, uniform
from ainfer_pd.request import SamplingParams
from ainfer_pd.errors import SpecInputError
from ainfer_pd.spec.verify import verify, verify_on_device
from tests.test_sampler import ref_logprobs

ALPHA = 1e-3
"""Significance of the chi-square checks: a correct rule fails one with probability 0.001 over
random seeds (the seeds here are fixed, so the test is deterministic)."""
N = 20000


# ----------------------------------------------------------------------------- a toy target model
V_TOY = 40
TABLE = torch.randn(V_TOY, V_TOY, generator=torch.Generator().manual_seed(3)) * 2.5


def toy_logits(seq: list[int]) -> torch.Tensor:
    """The toy target: logits [V] after ``seq`` (a bigram table, nudged by the length)."""
    return TABLE[seq[-1]] + 0.3 * (len(seq) % 3)


def decode_plain(prompt, params, seed, n):
    out, lps = [], []
    for _ in range(n):
        hist = prompt + out if params.repetition_penalty != 1.0 else None
        t, lp, bad = sample(toy_logits(prompt + out)[None], [SampleRow(params, seed, len(out), hist)])
        assert not bad
        out.append(t[0])
        lps.append(lp[0])
    return out, lps


def decode_speculating(prompts, params, seeds, n, k, drafter):
    outs = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    while any(len(o) < n for o in outs):
        live = [i for i, o in enumerate(outs) if len(o) < n]
        drafts = [drafter(i, len(outs[i]))[:k] for i in live]
        logits = torch.stack([torch.stack([toy_logits(prompts[i] + outs[i] + d[:j]) for j in range(k + 1)])
                              for i, d in zip(live, drafts)])
        rows = [SampleRow(params, seeds[i], len(outs[i]),
                          prompts[i] + outs[i] if params.repetition_penalty != 1.0 else None) for i in live]
        res = verify(logits, drafts, rows)
        assert not res.bad
        for j, i in enumerate(live):
            assert res.tokens[j][:res.accepted[j]] == drafts[j][:res.accepted[j]]
            assert len(res.tokens[j]) == res.accepted[j] + 1
            outs[i] += res.tokens[j]
            lps[i] += res.logprobs[j]
    return [o[:n] for o in outs], [lp[:n] for lp in lps]


def noisy_drafter(refs, rng):
    """Drafts from the reference outputs, each token wrong with probability 0.25."""
    def draft(i, pos):
        d = list(refs[i][pos:pos + 4])
        return [t if rng.random() > 0.25 else rng.randrange(V_TOY) for t in d]
    return draft


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=12, top_p=0.9, repetition_penalty=1.2),
    SamplingParams(temperature=1.0),
], ids=["greedy", "temp0.8-topk-topp-reppen", "temp1"])
def test_decoding_is_token_for_token_the_same_with_speculation(params):
    prompts = [[i, (3 * i) % V_TOY, 7] for i in range(6)]
    seeds = [1000 + i for i in range(6)]
    refs = [decode_plain(p, params, s, 30) for p, s in zip(prompts, seeds)]
    outs, lps = decode_speculating(prompts, params, seeds, 30, 3,
                                   noisy_drafter([r[0] for r in refs], random.Random(5)))
    assert outs == [r[0] for r in refs]
    for got, (_, want) in zip(lps, refs):
        assert got == pytest.approx(want, abs=1e-6)


def test_greedy_drafts_that_are_the_argmax_are_all_accepted_and_a_bonus_follows():
    prompts = [[1, 2, 3], [4, 5, 6]]
    params = SamplingParams(temperature=0.0)
    refs = [decode_plain(p, params, 0, 5)[0] for p in prompts]
    logits = torch.stack([torch.stack([toy_logits(p + r[:j]) for j in range(5)]) for p, r in zip(prompts, refs)])
    res = verify(logits, [r[:4] for r in refs], [SampleRow(params), SampleRow(params)])
    assert res.accepted == [4, 4] and res.tokens == refs and not res.bad



def test_greedy_rows_among_sampled_drafts_still_decode_greedily():
    prompt, params = [5, 6, 7], SamplingParams(temperature=0.0)
    ref = decode_plain(prompt, params, 0, 4)[0]
    drafts = [[ref[0], (ref[1] + 1) % V_TOY, ref[2]], [1, 2, 3]]
    logits = torch.stack([torch.stack([toy_logits(prompt + drafts[0][:j]) for j in range(4)]),
                          torch.stack([toy_logits(prompt + drafts[1][:j]) for j in range(4)])])
    q = torch.softmax(torch.randn(2, 3, V_TOY, generator=torch.Generator().manual_seed(0)), -1)
    res = verify(logits, drafts, [SampleRow(params), SampleRow(SamplingParams(temperature=1.0), 9)], draft_probs=q)
    assert res.tokens[0] == ref[:2] and res.accepted[0] == 1

# ----------------------------------------------------------------------------- bookkeeping
def test_accepted_lengths_tokens_and_logprobs_per_row():
    V = 8
    logits = torch.full((4, 4, V), -1.0)
    best = [[3, 1, 4, 1], [5, 2, 6, 0], [7, 7, 7, 7], [2, 4, 6, 3]]
    for r, row in enumerate(best):
        for j, t in enumerate(row):
            logits[r, j, t] = 4.0
    drafts = [[3, 1, 4], [0, 2, 6], [], [2, 4]]           # all, none, no drafts, all of a shorter draft
    rows = [SampleRow(SamplingParams(temperature=0.0)) for _ in range(4)]
    dv = verify_on_device(logits, drafts, rows)
    assert dv.accepted.tolist() == [3, 0, 0, 2]
    res = verify(logits, drafts, rows)
    assert res.accepted == [3, 0, 0, 2]
    assert res.tokens == [[3, 1, 4, 1], [5], [7], [2, 4, 6]]
    lp = torch.log_softmax(logits, -1)
    for r, toks in enumerate(res.tokens):
        assert res.logprobs[r] == pytest.approx([lp[r, j, t].item() for j, t in enumerate(toks)], abs=1e-6)


def test_a_bad_position_fails_the_row_only_if_it_is_reached():
    V = 5
    logits = torch.zeros(3, 3, V)
    logits[:, :, 1] = 3.0
    logits[0, 1] = float("nan")            # reached: draft 1 accepted at position 0
    logits[1, 2] = float("nan")            # not reached: position 0 rejects
    logits[2, 0] = float("inf")            # the first position
    res = verify(logits, [[1, 1], [0, 1], [1]], [SampleRow(SamplingParams(temperature=0.0))] * 3)
    assert set(res.bad) == {0, 2} and "NaN" in res.bad[0] and "+inf" in res.bad[2]
    assert res.tokens == [[1], [1], []] and res.accepted == [1, 0, 0]


def test_bad_input_is_refused_with_a_typed_error():
    rows = [SampleRow(SamplingParams())] * 2
    lg = torch.zeros(2, 3, 5)
    with pytest.raises(SpecInputError, match="k \\+ 1"):
        verify(torch.zeros(2, 5), [[], []], rows)
    with pytest.raises(SpecInputError, match="sample rows"):
        verify(lg, [[]], rows)
    with pytest.raises(SpecInputError, match="3 drafts"):
        verify(lg, [[1, 2, 3], []], rows)
    with pytest.raises(SpecInputError, match="draft tokens"):
        verify(lg, [[5], []], rows)
    with pytest.raises(SpecInputError, match="draft_probs"):
        verify(lg, [[1], []], rows, draft_probs=torch.zeros(2, 3, 5))


# ----------------------------------------------------------------------------- the distribution
def chi2_sf(x: float, df: int) -> float:
    """P(chi-square with ``df`` degrees of freedom > x), closed forms for integer df."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(df // 2))
    term, acc = math.sqrt(x), 0.0
    for i in range(1, (df - 1) // 2 + 1):
        acc += term
        term *= x / (2 * i + 1)
    return math.erfc(math.sqrt(h)) + math.sqrt(2 / math.pi) * math.exp(-h) * acc


def chi2_pvalue(tokens: list[int], probs: list[float]) -> float:
    """p-value of ``tokens`` drawn from ``probs``; 0 when a zero-probability token occurs."""
    n, stat, df = len(tokens), 0.0, -1
    counts = [0] * len(probs)
    for t in tokens:
        counts[t] += 1
    for c, p in zip(counts, probs):
        if p == 0.0:
            if c:
                return 0.0
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    return chi2_sf(stat, df)


def test_chi2_sf_matches_table_values():
    assert chi2_sf(11.070, 5) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(9.488, 4) == pytest.approx(0.05, abs=2e-4)
    assert chi2_sf(20.515, 5) == pytest.approx(0.001, abs=2e-5)


L0 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
L1 = torch.tensor([-1.0, 0.0, 1.5, 0.2, 0.7, -0.3])
Q = torch.softmax(torch.tensor([[0.0, 1.0, 2.0, 0.0, -1.0, 0.5], [1.0, 0.0, 0.0, 1.0, 0.0, 2.0]]), -1)


def target(params: SamplingParams, lg: torch.Tensor) -> list[float]:
    return ref_logprobs(lg, params).exp().tolist()


def run_many(params, drafts, q=None):
    """One seeded verification per row of ``drafts`` (2 each) over the fixed logits L0, L1, L0."""
    logits = torch.stack([L0, L1, L0])[None].expand(len(drafts), 3, 6)
    rows = [SampleRow(params, seed=s, step=0) for s in range(len(drafts))]
    qs = None if q is None else q[None].expand(len(drafts), 2, 6)
    return verify(logits, drafts, rows, draft_probs=qs)


def check_first_two(res, params):
    first = [t[0] for t in res.tokens]
    second = [t[1] for t, a in zip(res.tokens, res.accepted) if a >= 1]
    assert len(second) > 2000
    assert chi2_pvalue(first, target(params, L0)) > ALPHA
    assert chi2_pvalue(second, target(params, L1)) > ALPHA


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4, top_p=0.8)],
                         ids=["temp1", "temp0.7-topk4-topp0.8"])
def test_point_mass_drafts_keep_the_target_distribution(params):
    # half the rows draft a likely token, half one that top-k / top-p may remove
    drafts = [[0, 2] if i % 2 else [4, 2] for i in range(N)]
    res = run_many(params, drafts)
    check_first_two(res, params)
    p0 = target(params, L0)
    assert sum(a > 0 for a in res.accepted[1::2]) / (N // 2) == pytest.approx(p0[0], abs=0.02)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4, top_p=0.8)],
                         ids=["temp1", "temp0.7-topk4-topp0.8"])
def test_sampled_drafts_keep_the_target_distribution(params):
    g = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(Q[0], N, True, generator=g),
                          torch.multinomial(Q[1], N, True, generator=g)], 1).tolist()
    res = run_many(params, drafts, q=Q)
    check_first_two(res, params)
    assert chi2_pvalue([d[0] for d in drafts], Q[0].tolist()) > ALPHA     # the drafts were q's


def test_the_check_rejects_wrong_rules():
    """The chi-square check has power: the first token under two wrong rules fails it, and the
    right rule written the same way (host loops) passes it."""
    params = SamplingParams(temperature=1.0)
    p0 = target(params, L0)
    d = 1

    def draw(probs, u):
        c = 0.0
        for i, p in enumerate(probs):
            c += p
            if u * sum(probs) <= c:
                return i
        return len(probs) - 1
    without_d = [0.0 if i == d else p for i, p in enumerate(p0)]
    always_accept = [d] * N
    no_removal = [d if uniform(s, 99) < p0[d] else draw(p0, uniform(s, 0)) for s in range(N)]
    right = [d if uniform(s, 99) < p0[d] else draw(without_d, uniform(s, 0)) for s in range(N)]
    assert chi2_pvalue(always_accept, p0) < ALPHA
    assert chi2_pvalue(no_removal, p0) < ALPHA
    assert chi2_pvalue(right, p0) > ALPHA
