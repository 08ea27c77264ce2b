"""The device sampler (engine.sampler) against per-row torch references: greedy, temperature,
top-k, top-p and repetition penalty; counter-based seeds (batch- and position-independent draws);
the sampled frequencies against the distribution. Runs on the CPU; the gate runs it on the H200."""
from __future__ import annotations

import math

import pytest
import torch

from ainfer_pd.engine.model.sampler import SampleRow, sample, sample_seed, uniform
from ainfer_pd.request import SamplingParams


def ref_logprobs(logits: torch.Tensor, p: SamplingParams, history=None) -> torch.Tensor:
    """One row's sampling log-probabilities, written independently of the sampler (a loop)."""
    row = logits.double().clone()
    if p.repetition_penalty != 1.0 and history:
        for t in set(history):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    if not p.greedy:
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = sorted(row.tolist(), reverse=True)[p.top_k - 1]
            row[row < kth] = -math.inf
        if p.top_p < 1.0:
            order = sorted(range(row.numel()), key=lambda i: -row[i].item())
            probs = torch.softmax(row, 0)
            mass = 0.0
            for i in order:
                if mass > p.top_p:
                    row[i] = -math.inf
                mass += probs[i].item()
    return torch.log_softmax(row, 0)


def test_uniform_is_in_the_open_interval_and_spread():
    us = [uniform(s, k) for s in range(50) for k in range(40)]
    assert all(0.0 < u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.02
    hist = [0] * 10
    for u in us:
        hist[int(u * 10)] += 1
    assert max(hist) - min(hist) < 0.03 * len(us)
    assert uniform(1, 0) != uniform(1, 1) != uniform(2, 1)


def test_sample_seed_takes_the_request_seed_else_the_fallback():
    assert sample_seed(SamplingParams(temperature=1.0, seed=9), 5) == 9
    assert sample_seed(SamplingParams(temperature=1.0), 5) == 5
    assert sample_seed(SamplingParams(temperature=1.0, seed=2**64 - 1), 5) == 2**64 - 1


def test_greedy_rows_take_the_argmax_with_its_log_probability():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 4
    rows = [SampleRow(SamplingParams(temperature=0.0)) for _ in range(5)]
    toks, lps, bad = sample(logits, rows)
    assert not bad
    assert toks == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits.double(), -1)
    for i, t in enumerate(toks):
        assert lps[i] == pytest.approx(ref[i, t].item(), abs=1e-5)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, top_k=12, top_p=0.6, seed=4),
    SamplingParams(temperature=1.0, repetition_penalty=1.8, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=3.0),
], ids=["temp", "topk", "topp", "topk-topp", "reppen", "greedy-reppen"])
def test_each_token_is_in_the_support_and_its_logprob_is_the_reference(params):
    g = torch.Generator().manual_seed(7)
    V = 64
    logits = torch.randn(6, V, generator=g) * 3
    hist = [int(logits[0].argmax()), 3, 3, 9]
    rows = [SampleRow(params, seed=11 + i, step=i, history=hist) for i in range(6)]
    toks, lps, bad = sample(logits, rows)
    assert not bad
    for i, t in enumerate(toks):
        ref = ref_logprobs(logits[i], params, hist)
        assert math.isfinite(ref[t].item()), f"row {i}: token {t} is outside the support"
        assert lps[i] == pytest.approx(ref[t].item(), abs=1e-4)
        if params.greedy:
            assert t == int(ref.argmax())


def test_a_seeded_draw_depends_on_its_seed_and_step_only():
    """The same (seed, step) gives the same token whatever the batch and the row's place in it."""
    g = torch.Generator().manual_seed(3)
    V = 500
    target = torch.randn(V, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    noise = [SampleRow(SamplingParams(temperature=1.0, seed=s), seed=s, step=s) for s in range(7)]
    alone, lp_alone, _ = sample(target[None], [SampleRow(p, 42, 17)])
    for where in (0, 3, 7):
        rows = noise[:where] + [SampleRow(p, 42, 17)] + noise[where:]
        logits = torch.randn(len(rows), V, generator=g)
        logits[where] = target
        toks, lps, _ = sample(logits, rows)
        assert toks[where] == alone[0] and lps[where] == pytest.approx(lp_alone[0], abs=1e-6)
    draws = {sample(target[None], [SampleRow(p, 42, k)])[0][0] for k in range(30)}
    assert len(draws) > 5                       # the step moves the draw


def test_sampled_frequencies_match_the_distribution():
    V, n = 6, 6000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, seed=0)
    rows = [SampleRow(p, seed=s, step=s % 5) for s in range(n)]
    toks, _, bad = sample(logits.expand(n, V).clone(), rows)
    assert not bad
    probs = torch.softmax(logits / 0.8, 0)
    for v in range(V):
        f = sum(t == v for t in toks) / n
        sd = math.sqrt(probs[v].item() * (1 - probs[v].item()) / n)
        assert abs(f - probs[v].item()) < 4 * sd + 1e-3, (v, f, probs[v].item())


def test_top_p_frequencies_are_the_renormalised_nucleus():
    V, n = 5, 5000
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    p = SamplingParams(temperature=1.0, top_p=0.8, seed=0)        # keeps 0.5 + 0.25 + 0.15
    toks, _, _ = sample(logits.expand(n, V).clone(), [SampleRow(p, seed=s) for s in range(n)])
    assert set(toks) <= {0, 1, 2}
    for v, q in ((0, 0.5 / 0.9), (1, 0.25 / 0.9), (2, 0.15 / 0.9)):
        f = sum(t == v for t in toks) / n
        assert abs(f - q) < 4 * math.sqrt(q * (1 - q) / n)


def test_bad_rows_are_reported_alone_in_a_sampled_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, generator=g)
    logits[1, 5] = math.nan
    logits[2] = -math.inf
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=i), seed=i) for i in range(4)]
    toks, lps, bad = sample(logits, rows)
    assert bad == {1: "NaN in the sampling distribution", 2: "no token has finite probability"}
    assert math.isfinite(lps[0]) and math.isfinite(lps[3]) and math.isnan(lps[1])


def test_an_empty_batch_samples_nothing():
    assert sample(torch.zeros(0, 8), []) == ([], [], {})


def test_a_repetition_history_as_an_id_array_penalizes_like_the_reference():
    """The engine's histories are ``array('q')`` (a turn's ids, kept, not rebuilt as lists); with
    duplicates, a history of one token and rows without a penalty, the sampled logprobs are the
    reference's, and a verify position's history is the row's then its drafts."""
    from array import array

    from ainfer_pd.spec.verify import expand_rows
    torch.manual_seed(3)
    V = 40
    logits = torch.randn(4, V) * 3
    hists = [array("q", [5, 5, 7, 39, 0, 5]), array("q", [11]), None, array("q", [2, 3])]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7), SamplingParams(temperature=0.0,
              repetition_penalty=0.6), SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    rows = [SampleRow(p, 1, 0, h) for p, h in zip(params, hists)]
    toks, lps, bad = sample(logits, rows)
    assert not bad
    for i, (p, h) in enumerate(zip(params, hists)):
        ref = ref_logprobs(logits[i], p, list(h) if h is not None else None)
        assert toks[i] == int(ref.argmax()) and lps[i] == pytest.approx(float(ref.max()), abs=1e-5)
    wide = expand_rows(rows[:2], [[9, 8], []], 3)
    assert [list(r.history) for r in wide[:3]] == [[5, 5, 7, 39, 0, 5], [5, 5, 7, 39, 0, 5, 9],
                                                  [5, 5, 7, 39, 0, 5, 9, 8]]
    assert list(hists[0]) == [5, 5, 7, 39, 0, 5]                     # the row's own history untouched
