"""A trainer's response budget in the replay: each turn asks for R tokens and ends at the model's
EOS (a random EOS set for the random-weight model), so the engine cannot know its length."""
import argparse

import numpy as np
import pytest

from ainfer_pd import RolloutWorker
from ainfer_pd.errors import InvalidRequestError
from ainfer_pd.tools.options import add_workload_args, build_trace, config_of
from ainfer_pd.tools.replay import replay, synthetic_eos_ids, turn_params
from ainfer_pd.tools.trace import Trace, make_trace


def test_budget_turns_ask_for_the_budget_and_stop_at_eos():
    tr = make_trace(3, 2, token_scale=0.02, seed=1)
    assert tr.response_budget is None
    assert turn_params(tr, 0, 0, 7, seed=0).ignore_eos
    b = tr.with_response_budget(300)
    assert b.response_budget == 300 and tr.response_budget is None
    p, q = turn_params(b, 0, 0, 7, seed=0), turn_params(b, 0, 1, 7, seed=0)
    assert p.max_new_tokens == 300 and not p.ignore_eos and p.temperature == 1.0
    assert p.seed is not None and p.seed != q.seed
    assert turn_params(b, 0, 0, 7, seed=0) == p                     # the same seed in every run
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError):
            tr.with_response_budget(bad)


def test_budget_survives_jsonl_and_groups(tmp_path):
    b = make_trace(2, 2, token_scale=0.02, seed=1).with_samples_per_prompt(2).with_response_budget(64)
    b.save_jsonl(tmp_path / "t.jsonl")
    back = Trace.load_jsonl(tmp_path / "t.jsonl")
    assert back.response_budget == 64 and back.samples_per_prompt == 2


def test_synthetic_eos_set():
    ids = synthetic_eos_ids(151936, 150, seed=0)
    assert len(ids) == round(151936 / 150) and len(set(ids)) == len(ids)
    assert min(ids) >= 2 and max(ids) < 151936
    assert ids == synthetic_eos_ids(151936, 150, seed=0) != synthetic_eos_ids(151936, 150, seed=1)
    assert len(synthetic_eos_ids(512, 10_000)) == 1
    with pytest.raises(InvalidRequestError):
        synthetic_eos_ids(512, 0)


def _args(*argv):
    p = argparse.ArgumentParser()
    add_workload_args(p, preset="tiny")
    return p.parse_args(list(argv))


def test_flags_give_the_trace_its_budget_and_the_model_its_eos_set():
    a = _args("--workload", "grpo-long", "--conversations", "8", "--token-scale", "0.05",
              "--response-budget", "96", "--eos-every", "16")
    cfg = config_of(a)
    trace = build_trace(a, cfg)
    assert trace.response_budget == 96 and trace.samples_per_prompt > 1
    assert set(synthetic_eos_ids(cfg.model.vocab_size, 16, seed=0)) <= cfg.model.stop_set
    plain = _args("--workload", "grpo-long", "--conversations", "8", "--token-scale", "0.05")
    assert config_of(plain).model.stop_token_ids == () and build_trace(plain, config_of(plain)).response_budget is None


async def test_turns_end_at_the_models_eos_with_the_same_tokens_under_every_policy():
    a = _args("--conversations", "6", "--max-turns", "3", "--token-scale", "0.05",
              "--response-budget", "120", "--eos-every", "12")
    cfg = config_of(a)
    trace = build_trace(a, cfg)
    outs = {}
    for policy in ("normal", "fine-grained"):
        async with RolloutWorker(cfg.replace(**{"scheduler.policy": policy})) as w:
            res = await replay(w, trace, cell="P3", seed=0, time_scale=0.05, raise_errors=True)
            m = w.metrics()
        assert res.failures == 0 and res.completed == trace.num_requests
        assert m["kv_free_blocks"] == m["kv_total_blocks"]            # nothing leaked
        lengths = [r.num_output_tokens for r in res.records]
        assert all(r.gen_tokens == 120 for r in res.records)
        assert {r.finish_reason for r in res.records} <= {"stop", "length"}
        assert sum(r.finish_reason == "stop" for r in res.records) >= len(lengths) - 1
        stops = cfg.model.stop_set
        assert all(res.outputs[(r.conversation, r.turn)][-1] in stops
                   for r in res.records if r.finish_reason == "stop")
        assert 3 <= np.mean(lengths) <= 40 and len(set(lengths)) > 3   # ~12 a turn, lengths the model's
        outs[policy] = res.outputs
    assert outs["normal"] == outs["fine-grained"]


def test_the_chain_bound_prices_the_tokens_a_turn_wrote_not_its_budget():
    from types import SimpleNamespace

    from ainfer_pd.tools.replay import RequestRecord, TrajectoryRecord
    from ainfer_pd.tools.report import chain_lower_bound
    recs = [RequestRecord(0, 0, submit_s=0.0, done_s=1.0, gen_tokens=4096, num_output_tokens=10),
            RequestRecord(0, 1, submit_s=2.0, done_s=3.0, wait_s=1.0, gen_tokens=4096, num_output_tokens=30)]
    traj = TrajectoryRecord(conversation=0, total_wait_s=1.0, turns_total=2)
    res = SimpleNamespace(records=recs, trajectories=[traj])
    assert chain_lower_bound(res, {"d_iter_alone_s": 0.01}) == pytest.approx(1.0 + 0.01 * 40)
