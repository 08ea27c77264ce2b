"""Trace generator: paper percentiles at full scale, scaling knobs, cells, JSONL round-trip."""
import math

import numpy as np
import pytest

from ainfer_pd.errors import InvalidRequestError
from ainfer_pd.tools.trace import (CELLS, PAPER_PERCENTILES, QuantileDistribution, Trace, Turn,
                                      cell_wait_factor, check_percentiles, decode_only_trace, make_trace,
                                      p_heavy_trace, paper_trace, NEW_TOKENS_KNOTS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_scale_hits_paper_percentiles(seed):
    t = make_trace(seed=seed)
    s = t.summary()
    assert s["conversations"] == 128
    assert s["max_turns"] == 10
    assert abs(s["requests"] - 1265) <= 15
    assert s["continuations"] == s["requests"] - 128
    # totals: 6.57M input tokens, 0.22M output tokens (paper)
    assert abs(s["input_tokens"] - 6_574_104) / 6_574_104 < 0.08
    assert abs(s["output_tokens"] - 220_862) / 220_862 < 0.06
    # per-turn quantities are stratified: tight
    for key in ("new_tokens", "gen_tokens", "tool_wait_s"):
        for got, want, ok in check_percentiles(t, rtol=0.03, keys=[key])[key]:
            assert ok, (key, got, want)
    # retained context is emergent (cumulative): looser
    for got, want, ok in check_percentiles(t, rtol=0.12, keys=["retained_context"])["retained_context"]:
        assert ok, ("retained_context", got, want)


def test_quantile_distribution_inverse_cdf():
    d = QuantileDistribution(NEW_TOKENS_KNOTS)
    assert d.ppf(0.5) == pytest.approx(292)
    assert d.ppf(0.9) == pytest.approx(2008)
    assert d.ppf(0.99) == pytest.approx(3062)
    # log-linear between knots: the geometric mean at the midpoint
    assert d.ppf(0.7) == pytest.approx(math.sqrt(292 * 2008))
    x = d.sample(np.random.default_rng(0), 20000, stratified=False)
    assert np.mean(x) == pytest.approx(d.mean(), rel=0.05)
    with pytest.raises(InvalidRequestError):
        QuantileDistribution([(0.0, 1.0), (0.5, 0.5), (1.0, 2.0)])


def test_seeded_and_deterministic():
    a, b, c = make_trace(16, 5, seed=3), make_trace(16, 5, seed=3), make_trace(16, 5, seed=4)
    assert [x.turns for x in a.conversations] == [x.turns for x in b.conversations]
    assert [x.turns for x in a.conversations] != [x.turns for x in c.conversations]


def test_scaling_knobs():
    t = make_trace(32, 6, token_scale=0.01, wait_scale=0.5, max_context=600, seed=1)
    for c in t.conversations:
        assert 1 <= c.num_turns <= 6
        assert c.turns[0].tool_wait_s == 0.0
        assert c.total_context <= 600
        for turn in c.turns:
            assert turn.new_tokens >= 1 and turn.gen_tokens >= 1
    full = make_trace(32, 6, seed=1)
    # wait scaling keeps the vector shape
    w_full = [x.tool_wait_s for c in full.conversations for x in c.turns[1:]]
    w_half = [x.tool_wait_s for c in full.scaled(wait_scale=0.5).conversations for x in c.turns[1:]]
    assert np.allclose(np.array(w_full) * 0.5, w_half)
    # a first turn bigger than the limit is shrunk, never dropped
    tiny = make_trace(8, 3, max_context=16, seed=0)
    assert all(c.num_turns >= 1 and c.total_context <= 16 for c in tiny.conversations)
    assert paper_trace(0.25).summary()["conversations"] == 32


def test_cells():
    assert [cell_wait_factor(c) for c in ("P1", "P2", "P3", "P4", "trace")] == [0, 0.01, 0.03, 0.10, 1.0]
    t = make_trace(4, 3, seed=0)
    w = t.waits("P4", time_scale=0.5)
    for c, ws in zip(t.conversations, w):
        assert ws[0] == 0.0
        assert ws[1:] == pytest.approx([x.tool_wait_s * 0.05 for x in c.turns[1:]])
    assert all(x == 0 for ws in t.waits("P1") for x in ws)
    with pytest.raises(InvalidRequestError):
        cell_wait_factor("P9")
    assert set(CELLS) == {"P1", "P2", "P3", "P4", "trace"}


def test_jsonl_round_trip(tmp_path):
    t = make_trace(10, 4, token_scale=0.1, seed=5)
    p = tmp_path / "t.jsonl"
    t.save_jsonl(p)
    lines = p.read_text().splitlines()
    assert len(lines) == 1 + 10                       # meta + one conversation per line
    u = Trace.load_jsonl(p)
    assert [c.turns for c in u.conversations] == [c.turns for c in t.conversations]
    assert u.meta == t.meta
    assert u.summary()["requests"] == t.summary()["requests"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": [[0, 5, 0.0]]}\n')
    with pytest.raises(InvalidRequestError):
        Trace.load_jsonl(bad)
    bad.write_text("not json\n")
    with pytest.raises(InvalidRequestError):
        Trace.load_jsonl(bad)


def test_decode_only_and_p_heavy():
    d = decode_only_trace(6, gen_tokens=40, prompt_tokens=4)
    assert d.num_requests == 6
    assert all(c.turns == [Turn(4, 40, 0.0)] for c in d.conversations)
    h = p_heavy_trace(8, 3, prompt_tokens=256, observation_tokens=128, gen_tokens=6, tool_wait_s=0.01, seed=1)
    a = h.arrays()
    assert h.num_requests == 24
    assert a["new_tokens"].min() > 5 * a["gen_tokens"].max()    # P-heavy
    assert a["tool_wait_s"].max() < 0.05
    assert set(PAPER_PERCENTILES) >= {"new_tokens", "gen_tokens", "retained_context", "tool_wait_s"}


def test_grpo_shaped_trace_groups_share_their_first_prompt_only():
    from ainfer_pd.tools.replay import conversation_token_ids, turn_params
    base = make_trace(3, 3, token_scale=0.05, seed=4)
    t = base.with_samples_per_prompt(4)
    assert t.samples_per_prompt == 4 and len(t.conversations) == 12 and base.samples_per_prompt == 1
    assert [c.conv_id for c in t.conversations] == list(range(12))
    assert all(t.conversations[4 * g + j].turns == base.conversations[g].turns for g in range(3) for j in range(4))
    ids = [conversation_token_ids(t, i, seed=0, vocab_size=512) for i in range(12)]
    for g in range(3):
        group = ids[4 * g:4 * g + 4]
        assert all(m[0] == group[0][0] for m in group)                   # one first prompt
        assert len({tuple(m[1]) for m in group}) == 4                    # own observations
    assert ids[0][0] != ids[4][0]
    p = [turn_params(t, i, 0, 8, seed=0) for i in range(4)]
    assert all(x.temperature == 1.0 and x.ignore_eos for x in p) and len({x.seed for x in p}) == 4
    assert turn_params(base, 0, 0, 8, seed=0).greedy                  # ungrouped traces stay greedy
    with pytest.raises(InvalidRequestError):
        base.with_samples_per_prompt(0)
    with pytest.raises(InvalidRequestError):
        t.with_samples_per_prompt(2)


def test_grpo_shaped_trace_survives_jsonl(tmp_path):
    t = make_trace(2, 2, token_scale=0.05, seed=1).with_samples_per_prompt(3)
    t.save_jsonl(tmp_path / "g.jsonl")
    back = Trace.load_jsonl(tmp_path / "g.jsonl")
    assert back.samples_per_prompt == 3 and len(back.conversations) == 6
