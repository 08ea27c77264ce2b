"""The speculation-length policy (ainfer_pd.spec.adaptive): no speculation when the measured verify
costs say it cannot pay, longer drafts as acceptance grows, never a plan slower than none under the
supplied costs, the acceptance estimate, and the cost table's checks."""
from __future__ import annotations

import random

import pytest

from ainfer_pd.errors import SpecInputError
from ainfer_pd.spec.adaptive import (Acceptance, VerifyCosts, choose, could_pay, expected_tokens, observe)

# a decode-bound shape: more tokens per row are almost free at B = 16, expensive at B = 128
TIMES = {16: {1: 10.0, 2: 10.3, 4: 10.9, 5: 11.2, 9: 12.5},
         128: {1: 13.0, 2: 20.0, 4: 34.0, 5: 41.0, 9: 70.0}}
COSTS = VerifyCosts.from_times(TIMES)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_speculation_when_the_costs_say_it_cannot_pay():
    # at B = 128 a width of 2 costs 1.54x: even rate 0.5 (1.5 tokens) does not pay
    plan = choose(COSTS, [0.5] * 128, [8] * 128)
    assert plan.k == 0 and plan.per_row == (0,) * 128 and plan.gain == 1.0
    # nor with no drafts, nor with zero acceptance where it is cheap
    assert choose(COSTS, [0.9] * 16, [0] * 16).k == 0
    assert choose(COSTS, [0.0] * 16, [8] * 16).k == 0
    # above the largest measured batch: no promise, no speculation
    assert choose(COSTS, [0.99] * 200, [8] * 200).k == 0


def test_k_grows_with_acceptance():
    ks = [choose(COSTS, [a] * 16, [8] * 16).k for a in (0.02, 0.2, 0.5, 0.8, 0.95)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] == 8 and len(set(ks)) >= 3


def test_a_chosen_plan_is_never_slower_than_none_under_the_costs():
    rng = random.Random(0)
    for _ in range(300):
        B = rng.choice([1, 5, 16, 100, 128])
        rates = [rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(B)]
        avail = [rng.randrange(9) for _ in range(B)]
        plan = choose(COSTS, rates, avail)
        if plan.k:
            ratio = COSTS.at(B)[plan.k + 1]
            tokens = sum(expected_tokens(a, n) for a, n in zip(rates, plan.per_row))
            assert tokens / (B * ratio) == pytest.approx(plan.gain) and plan.gain >= 1.05
            assert all(n == min(plan.k, m) for n, m in zip(plan.per_row, avail))


def test_the_batch_bucket_and_short_drafts():
    assert COSTS.at(3) is COSTS.at(16) and COSTS.at(129) == {}
    # rows with short drafts cap k at the longest draft on offer
    assert choose(COSTS, [0.95] * 16, [3] * 16).k == 3
    plan = choose(COSTS, [0.95] * 16, [8] + [1] * 15)
    assert plan.per_row[0] == plan.k and set(plan.per_row[1:]) == {1}


def test_acceptance_tracks_recent_verifies():
    acc = Acceptance()
    assert acc.rate == 0.5
    assert observe(acc, 0, 0) is acc
    hi = acc
    for _ in range(10):
        hi = observe(hi, 4, 4)
    assert hi.rate > 0.95
    lo = hi
    for _ in range(10):
        lo = observe(lo, 4, 0)
    assert lo.rate < 0.15
    one = observe(Acceptance(0.0, 0.0), 4, 2)     # 2 accepted, the third rejected: 2 of 3 tried
    assert one.rate == pytest.approx(2 / 3)
    with pytest.raises(SpecInputError):
        observe(acc, 2, 3)


def test_the_cost_table_and_the_inputs_are_checked():
    with pytest.raises(SpecInputError, match="width 1"):
        VerifyCosts.from_times({16: {2: 1.0}})
    with pytest.raises(SpecInputError, match="time"):
        VerifyCosts.from_times({16: {1: 1.0, 2: -1.0}})
    with pytest.raises(SpecInputError, match="empty"):
        VerifyCosts.from_times({})
    with pytest.raises(SpecInputError, match="batch sizes"):
        VerifyCosts.from_times({0: {1: 1.0}})
    with pytest.raises(SpecInputError, match="draft counts"):
        choose(COSTS, [0.5], [1, 2])
    with pytest.raises(SpecInputError, match="min_gain"):
        choose(COSTS, [0.5], [1], min_gain=0.9)


def test_a_device_drafter_s_chain_counts_with_the_verify():
    """An MTP chain that costs 0.15 of a decode a draft makes long drafts lose: the choice shortens,
    and a chain of a whole decode a draft leaves no speculation; a K the chain table lacks is
    not taken."""
    rates, avail = [0.8] * 16, [8] * 16
    free = choose(COSTS, rates, avail)
    assert free.k == 8
    cheap = VerifyCosts.from_times(TIMES, {16: {k: 0.15 * k * TIMES[16][1] for k in range(1, 9)},
                                           128: {k: 1.0 for k in range(1, 9)}})
    dear = VerifyCosts.from_times(TIMES, {16: {k: 1.0 * k * TIMES[16][1] for k in range(1, 9)},
                                          128: {k: 1.0 for k in range(1, 9)}})
    p_cheap, p_dear = choose(cheap, rates, avail), choose(dear, rates, avail)
    assert 1 <= p_cheap.k < free.k and p_cheap.gain < free.gain
    assert p_dear.k == 0 and p_dear.gain == 1.0
    # every plan is what the tokens over the whole cost say: verify plus chain
    for costs, plan in ((cheap, p_cheap),):
        e = sum(expected_tokens(0.8, plan.k) for _ in rates)
        chain = costs.draft_at(16)[plan.k]
        assert plan.gain == pytest.approx(e / (16 * (costs.at(16)[plan.k + 1] + chain)))
    only_one = VerifyCosts.from_times(TIMES, {16: {1: 0.0}, 128: {1: 0.0}})
    assert choose(only_one, rates, avail).k == 1
    assert COSTS.draft_at(16) is None


def test_the_drafting_table_is_checked():
    with pytest.raises(SpecInputError, match="no batch size 128"):
        VerifyCosts.from_times(TIMES, {16: {1: 1.0}})
    with pytest.raises(SpecInputError, match="drafting, batch 16"):
        VerifyCosts.from_times(TIMES, {16: {1: -1.0}, 128: {1: 1.0}})
    with pytest.raises(SpecInputError, match="drafting, batch 16"):
        VerifyCosts.from_times(TIMES, {16: {0: 1.0}, 128: {1: 1.0}})


def test_spec_draft_costs_config_is_checked():
    from ainfer_pd import WorkerConfig
    from ainfer_pd.errors import ConfigError
    base = WorkerConfig.from_yaml("configs/tiny-cpu.yaml")
    with pytest.raises(ConfigError, match="drafts on the host"):
        base.replace(**{"spec.method": "suffix", "spec.draft_costs": {16: {1: 0.001}}})
    with pytest.raises(ConfigError, match="draft_costs\\[16\\]"):
        base.replace(**{"spec.draft_costs": {16: {1: -1.0}}})
    with pytest.raises(ConfigError, match="lacks batch sizes \\[128\\]"):
        base.replace(**{"spec.verify_costs": {16: {1: 1.0}, 128: {1: 1.0}}, "spec.draft_costs": {16: {1: 0.1}}})


def test_host_time_before_the_launch_counts_against_speculating():
    """The host seconds a drafting iteration adds (drafts, the verify's build on the launch's path)
    count over a plain iteration's seconds at the batch's size: enough of them and no K pays."""
    rates, avail = [0.8] * 16, [8] * 16
    free = choose(COSTS, rates, avail)
    some = choose(COSTS, rates, avail, host_s=0.2 * TIMES[16][1])
    much = choose(COSTS, rates, avail, host_s=3.0 * TIMES[16][1])
    assert free.k == 8 and 0 < some.gain < free.gain and much.k == 0
    e = sum(expected_tokens(0.8, some.k) for _ in rates)
    assert some.gain == pytest.approx(e / (16 * (COSTS.at(16)[some.k + 1] + 0.2)))
    assert COSTS.base_at(16) == TIMES[16][1] and COSTS.base_at(128) == TIMES[128][1] and COSTS.base_at(500) is None
    with pytest.raises(SpecInputError, match="host_s"):
        choose(COSTS, rates, avail, host_s=-1.0)


def test_could_pay_bounds_choose():
    """could_pay (the D loop's O(K) check before any per-row work) is an upper bound: where it says
    no, choose keeps K = 0 for every batch of that size whose rates are at most the bound's rate;
    where a batch speculates, it says yes."""
    rng = random.Random(3)
    for _ in range(400):
        B = rng.choice([1, 3, 16, 40, 64])
        rates = [rng.random() for _ in range(B)]
        avail = [rng.randint(0, 8) for _ in range(B)]
        host = rng.choice([0.0, 0.5, 3.0, 20.0])
        top = max(rates)
        k = choose(COSTS, rates, avail, host_s=host).k
        if not could_pay(COSTS, top, B, host_s=host):
            assert k == 0
        if k > 0:
            assert could_pay(COSTS, top, B, host_s=host)
    assert not could_pay(COSTS, 1.0, 0)
    assert could_pay(COSTS, 0.9, 16) and not could_pay(COSTS, 0.9, 16, host_s=100.0)
