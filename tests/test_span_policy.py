"""Span policy and activation (SPEC 3.6): pure functions over plain data."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ainfer_pd.config import MuxConfig
from ainfer_pd.errors import ConfigError
from ainfer_pd.sched.span import (Activation, AutoSpan, FixedSpan, MeasuredSpan, SpanInputs, auto_span, fixed_span,
                                  make_activation, make_span_policy, span_switch)

FULL_D_LITTLE_P = SpanInputs(num_d_rows=60, max_d_rows=64, num_p_waiting_tokens=100, p_budget_tokens=2048)
FEW_D_P_BACKLOG = SpanInputs(num_d_rows=4, max_d_rows=64, num_p_waiting_tokens=5000, p_budget_tokens=2048)
MIXED = SpanInputs(num_d_rows=32, max_d_rows=64, num_p_waiting_tokens=1500, p_budget_tokens=2048)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_a_fixed_span_always_answers_its_span(k):
    assert fixed_span(k)(MIXED) == k == fixed_span(k)(SpanInputs())


@pytest.mark.parametrize("k", [0, 5, -1, 2.0, True, "2"])
def test_a_span_outside_1_to_4_is_rejected(k):
    with pytest.raises(ConfigError):
        fixed_span(k)
    with pytest.raises(ConfigError):
        auto_span((1, k))


def test_auto_needs_at_least_one_span():
    with pytest.raises(ConfigError):
        auto_span(())


def test_auto_defaults_to_span_2_without_load_information():
    assert auto_span()(SpanInputs()) == 2
    assert auto_span()(MIXED) == 2


def test_auto_picks_the_smallest_span_for_a_full_d_batch_and_little_p():
    assert auto_span()(FULL_D_LITTLE_P) == 1
    assert auto_span((2, 3, 4))(FULL_D_LITTLE_P) == 2


def test_auto_picks_the_largest_span_for_a_p_backlog_and_few_d_rows():
    assert auto_span()(FEW_D_P_BACKLOG) == 4
    assert auto_span((1, 2, 3))(FEW_D_P_BACKLOG) == 3


@pytest.mark.parametrize("spans,default", [((1, 2, 3, 4), 2), ((3, 4), 3), ((1,), 1), ((1, 3), 1), ((4, 1), 1)])
def test_the_default_is_the_allowed_span_closest_to_2(spans, default):
    assert auto_span(spans).default == default


@given(spans=st.sets(st.integers(1, 4), min_size=1),
       inputs=st.builds(SpanInputs, st.integers(0, 512), st.integers(0, 512), st.integers(0, 10**6),
                        st.integers(0, 10**5), st.integers(0, 64)))
def test_auto_is_deterministic_and_only_chooses_allowed_spans(spans, inputs):
    policy = auto_span(tuple(spans))
    k = policy(inputs)
    assert k in spans and k == policy(inputs) == auto_span(tuple(sorted(spans)))(inputs)


def test_make_span_policy_follows_the_mux_config():
    assert make_span_policy(MuxConfig(span="3")) == FixedSpan(3)
    policy = make_span_policy(MuxConfig(span="auto", auto_spans=(2, 4)))
    assert isinstance(policy, AutoSpan) and policy.spans == (2, 4)
    default = make_span_policy(MuxConfig())                       # measured, from the mux defaults
    assert isinstance(default, MeasuredSpan) and (default.share, default.max_span) == (1.0, 32)
    assert make_span_policy(MuxConfig(span="auto")).spans == (1, 2, 3, 4)


def test_a_span_switch_is_recorded_only_when_the_span_changes():
    assert span_switch(2, 2, MIXED, epoch=1, permit=4) is None
    sw = span_switch(2, 4, FEW_D_P_BACKLOG, epoch=1, permit=4)
    assert (sw.previous, sw.chosen, sw.permit, sw.num_p_waiting_tokens, sw.num_d_rows) == (2, 4, 4, 5000, 4)
    ev = sw.as_event()
    assert ev["p_queue_tokens"] == 5000 and ev["d_rows"] == 4 and ev["permit"] == 4 and ev["chosen"] == 4
    assert span_switch(2, 1, MIXED, epoch=None, permit=float("inf")).as_event()["permit"] is None


# ------------------------------------------------------------- activation
def test_activation_switches_on_only_with_waiting_p_and_running_d():
    act = Activation(threshold=2, cooldown_s=0.1)
    assert not act.update(0.0, num_p_waiting=5, num_d_rows=0)   # P waits but no D runs
    assert not act.update(0.0, num_p_waiting=1, num_d_rows=8)   # below the threshold
    assert act.update(0.01, num_p_waiting=2, num_d_rows=8)
    assert act.switches == 1


def test_activation_stays_on_for_the_cooldown_then_switches_off():
    act = Activation(threshold=1, cooldown_s=0.1)
    assert act.update(1.0, 1, 4)
    assert act.update(1.05, 0, 4)       # condition dropped, still cooling down
    assert act.update(1.099, 0, 4)
    assert not act.update(1.1, 0, 4)
    assert act.switches == 2


def test_activation_restarts_the_cooldown_when_p_returns():
    act = Activation(threshold=1, cooldown_s=0.1)
    act.update(0.0, 1, 1)
    act.update(0.08, 0, 1)
    act.update(0.09, 1, 1)              # P back: the cooldown starts again from here
    assert act.update(0.18, 0, 1)
    assert not act.update(0.2, 0, 1)
    assert act.switches == 2


def test_a_decode_only_workload_never_switches_activation_on():
    act = Activation(threshold=1, cooldown_s=0.05)
    assert not any(act.update(t * 0.01, 0, 64) for t in range(100))
    assert act.switches == 0


def test_a_zero_cooldown_switches_off_at_once():
    act = Activation(threshold=1, cooldown_s=0.0)
    assert act.update(0.0, 1, 1) and not act.update(0.0, 0, 1)


@pytest.mark.parametrize("threshold,cooldown", [(0, 0.1), (1, -0.1), (True, 0.1), (1, float("nan"))])
def test_invalid_activation_settings_are_rejected(threshold, cooldown):
    with pytest.raises(ConfigError):
        Activation(threshold, cooldown)


def test_make_activation_follows_the_mux_config():
    act = make_activation(MuxConfig(activation_threshold=3, activation_cooldown_s=0.2))
    assert (act.threshold, act.cooldown_s, act.on) == (3, 0.2, False)


@given(st.lists(st.tuples(st.floats(0, 0.05), st.integers(0, 3), st.integers(0, 3)), max_size=60))
def test_activation_is_on_exactly_when_the_condition_held_within_the_cooldown(steps):
    act = Activation(threshold=2, cooldown_s=0.1)
    now, last_true, switches, prev = 0.0, None, 0, False
    for dt, p, d in steps:
        now += dt
        if p >= 2 and d > 0:
            last_true = now
        expect = last_true is not None and (last_true == now or (prev and now - last_true < 0.1))
        switches += expect != prev
        prev = expect
        assert act.update(now, p, d) == expect
    assert act.switches == switches


def test_measured_span_follows_the_measured_times_with_hysteresis():
    from ainfer_pd.sched.span import MeasuredSpan, SpanInputs
    m = MeasuredSpan(share=1.0, max_span=32)
    assert m(SpanInputs()) == 2                                            # nothing measured yet: the start span
    assert m(SpanInputs(d_iter_s=0.012, p_boundary_s=0.0025)) == 4         # 12 ms of D fits 4 boundaries of 2.5 ms
    assert m(SpanInputs(d_iter_s=0.012, p_boundary_s=0.0027)) == 4         # 4.4 -> 4: inside the hysteresis
    assert m(SpanInputs(d_iter_s=0.012, p_boundary_s=0.0004)) == 30        # a light P: many boundaries a round
    assert m(SpanInputs(d_iter_s=0.012, p_boundary_s=0.00001)) == 30       # 32 (the cap) is within 25% of 30
    assert MeasuredSpan(max_span=32)(SpanInputs(d_iter_s=0.012, p_boundary_s=0.00001)) == 32   # capped
    assert m(SpanInputs(d_iter_s=0.001, p_boundary_s=0.05)) == 1           # at least one


def test_measured_span_config_and_bounds():
    from ainfer_pd.errors import ConfigError
    from ainfer_pd.sched.span import MeasuredSpan, make_span_policy
    from tests.conftest import tiny_cfg
    pol = make_span_policy(tiny_cfg(**{"mux.span": "measured", "mux.max_span": 48}).mux)
    assert isinstance(pol, MeasuredSpan) and pol.max_span == 48
    for bad in ({"mux.max_span": 65}, {"mux.max_span": 0}, {"mux.measured_share": 0.0}):
        with pytest.raises(ConfigError):
            tiny_cfg(**{"mux.span": "measured", **bad})


# ---------------------------------------------------------------- mux.activation_cost (pure)
def test_multiplexing_pays_when_the_rows_freed_outnumber_the_turns_it_delays():
    from ainfer_pd.sched.span import multiplexing_pays
    assert multiplexing_pays(64, 4, 2.0)            # a few continuations beside a full batch
    assert not multiplexing_pays(2, 40, 2.0)        # a burst of first turns beside two rows
    assert not multiplexing_pays(10, 10, 2.0) and multiplexing_pays(11, 10, 2.0)   # the edge
    assert multiplexing_pays(1, 1000, 1.0)          # P not slowed at all: gating always pays
    assert not multiplexing_pays(0, 1, 1.0)         # no rows: nothing to free
    assert multiplexing_pays(5, 100, 0.5)           # a slowdown below 1 counts as 1


def test_the_slowdown_meter_is_gated_over_exclusive_time_per_token():
    from ainfer_pd.errors import ConfigError
    from ainfer_pd.sched.span import SlowdownMeter
    m = SlowdownMeter(initial=2.0, alpha=1.0)
    assert m.value == 2.0
    m.observe(False, 0.1, 1000)                     # exclusive: 0.1 ms a token
    assert m.value == 2.0                           # until a gated epoch is seen too
    m.observe(True, 0.3, 1000)                      # gated: 0.3 ms a token
    assert m.value == pytest.approx(3.0)
    m.observe(True, 0.05, 1000)                     # faster than exclusive: clamped to 1
    assert m.value == 1.0
    m.observe(True, 1.0, 0)                         # an epoch without tokens is ignored
    assert m.value == 1.0
    with pytest.raises(ConfigError):
        SlowdownMeter(initial=0.5)


def test_activation_cost_is_a_checked_config_choice():
    from ainfer_pd.tools.options import load_config
    from ainfer_pd.errors import ConfigError
    assert load_config("configs/tiny-cpu.yaml").mux.activation_cost == "none"
    assert load_config("configs/tiny-cpu.yaml", ["mux.activation_cost=measured"]).mux.activation_cost == "measured"
    assert load_config("configs/tiny-cpu.yaml", ["mux.activation_cost=none"]).mux.activation_cost == "none"
    for bad in ("mux.activation_cost=off", "mux.activation_cost=always"):   # off: YAML's false
        with pytest.raises(ConfigError, match="activation_cost"):
            load_config("configs/tiny-cpu.yaml", [bad])


def test_a_backlog_above_the_cap_drains_exclusively():
    from ainfer_pd.sched.span import drains_exclusively
    assert drains_exclusively(20_000, 16_384) and not drains_exclusively(16_384, 16_384)
    assert not drains_exclusively(10 ** 9, 0)                       # 0: off
    from ainfer_pd.tools.options import load_config
    assert load_config("configs/tiny-cpu.yaml").mux.exclusive_backlog_tokens == 0
    cfg = load_config("configs/tiny-cpu.yaml", ["mux.exclusive_backlog_tokens=16384"])
    assert cfg.mux.exclusive_backlog_tokens == 16384
    for bad in ("mux.exclusive_backlog_tokens=-1", "mux.exclusive_backlog_tokens=true"):
        with pytest.raises(ConfigError, match="exclusive_backlog_tokens"):
            load_config("configs/tiny-cpu.yaml", [bad])


def test_a_first_token_waiting_past_the_cap_runs_its_epoch_exclusively():
    from ainfer_pd.sched.span import guards_first_token
    assert guards_first_token(1.5, 1.0) and not guards_first_token(1.0, 1.0)
    assert not guards_first_token(10 ** 6, 0.0)                      # 0: off
    from ainfer_pd.tools.options import load_config
    assert load_config("configs/tiny-cpu.yaml").mux.exclusive_wait_s == 0.0
    assert load_config("configs/tiny-cpu.yaml", ["mux.exclusive_wait_s=1.2"]).mux.exclusive_wait_s == 1.2
    for bad in ("mux.exclusive_wait_s=-1", "mux.exclusive_wait_s=true", "mux.exclusive_wait_s=.inf"):
        with pytest.raises(ConfigError, match="exclusive_wait_s"):
            load_config("configs/tiny-cpu.yaml", [bad])
