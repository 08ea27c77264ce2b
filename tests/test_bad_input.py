"""Bad input gets a typed error; the worker stays healthy and other trajectories are unaffected."""
import asyncio
import math
import random

import pytest

from ainfer_pd import AInferPDError, RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.errors import (ConfigError, ContextLengthError, InvalidRequestError, TopologyError,
                              TrajectoryBusyError, UnknownTrajectoryError)
from tests.conftest import TINY, rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=0), dict(max_new_tokens=-3), dict(temperature=-1.0), dict(temperature=math.nan),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-5), dict(repetition_penalty=0.0),
    dict(seed="x"), dict(stop_token_ids=(-1,)), dict(max_new_tokens=2.5),
])
def test_invalid_sampling_values_raise_a_typed_error(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


async def test_bad_requests_fail_alone_while_another_trajectory_keeps_running(worker):
    rng = random.Random(0)
    bystander = asyncio.create_task(worker.generate(rand_ids(rng, 40), SamplingParams(max_new_tokens=30, **GREEDY)))
    limit = worker.cfg.model.max_context_len
    cases = [
        (worker.generate([], SamplingParams()), InvalidRequestError),
        (worker.generate([1, 2, 99999], SamplingParams()), InvalidRequestError),
        (worker.generate([1, -2], SamplingParams()), InvalidRequestError),
        (worker.generate(["a"], SamplingParams()), InvalidRequestError),
        (worker.generate([3] * limit, SamplingParams(max_new_tokens=1)), ContextLengthError),   # max model length: vLLM's rule
        (worker.continue_("no-such-trajectory", [5], SamplingParams()), UnknownTrajectoryError),
        (worker.generate([3, 4], SamplingParams(stop_token_ids=(10**6,))), InvalidRequestError),
    ]
    for coro, err in cases:
        with pytest.raises(err) as ei:
            await coro
        assert isinstance(ei.value, AInferPDError)
    out = await bystander
    assert out.finish_reason == "length" and len(out.token_ids) == 30
    assert worker.kv_leak_free()


async def test_released_trajectory_is_unknown_afterwards(worker):
    out = await worker.generate([5, 6, 7], SamplingParams(max_new_tokens=2, **GREEDY))
    await worker.release(out.trajectory_id)
    with pytest.raises(UnknownTrajectoryError):
        await worker.continue_(out.trajectory_id, [8], SamplingParams())
    with pytest.raises(UnknownTrajectoryError):
        await worker.release(out.trajectory_id)


async def test_two_concurrent_continues_on_one_trajectory_reject_the_second(worker):
    out = await worker.generate([5, 6, 7], SamplingParams(max_new_tokens=2, **GREEDY))
    first = asyncio.create_task(worker.continue_(out.trajectory_id, [9] * 50, SamplingParams(max_new_tokens=50, **GREEDY)))
    await asyncio.sleep(0)
    with pytest.raises(TrajectoryBusyError):
        await worker.continue_(out.trajectory_id, [10], SamplingParams(max_new_tokens=2))
    res = await first
    assert len(res.token_ids) == 50


def test_malformed_yaml_and_unknown_keys_raise_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError):
        WorkerConfig.from_yaml(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(TINY.read_text() + "\nbogus_key: 1\n")
    with pytest.raises(ConfigError, match="bogus_key"):
        WorkerConfig.from_yaml(unknown)
    nested = tmp_path / "nested.yaml"
    nested.write_text("model:\n  hidden: 3\n")
    with pytest.raises(ConfigError, match="model.hidden"):
        WorkerConfig.from_yaml(nested)
    with pytest.raises(ConfigError):
        WorkerConfig.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("overrides,err", [
    ({"scheduler.policy": "fastest"}, ConfigError),
    ({"scheduler.max_prefill_tokens": -5}, ConfigError),
    ({"cache.num_blocks": -1}, ConfigError),
    ({"parallel.world_size": 6, "parallel.attn_dp": 4}, TopologyError),
    ({"parallel.world_size": 4, "parallel.expert_parallel": 3}, TopologyError),
    ({"parallel.world_size": 4, "parallel.expert_parallel": 4, "parallel.expert_backend": "torch",
      "model.num_experts": 6}, TopologyError),
    ({"mux.span": "7"}, ConfigError),
    ({"model.top_k": 99}, ConfigError),
    ({"model.num_heads": 3}, ConfigError),
    ({"parallel.ordering": "random"}, ConfigError),
])
def test_invalid_config_values_are_rejected(overrides, err):
    with pytest.raises(err):
        tiny_cfg(**overrides)


async def test_worker_calls_outside_the_context_manager_raise_typed_errors(cfg):
    from ainfer_pd.errors import WorkerClosedError
    w = RolloutWorker(cfg)
    with pytest.raises(WorkerClosedError):
        await w.generate([1, 2], SamplingParams())
    await asyncio.to_thread(w.engine.shutdown)
