"""verl 0.9.x integration on CPU: real verl client/router/agent loop, real RolloutWorker (tiny MoE).

The verl tests are skipped only when ``verl`` is not importable (``pip install -e '.[verl]'``).
"""
from __future__ import annotations

import asyncio
import importlib.util
import uuid
from pathlib import Path

import pytest
import torch

from ainfer_pd.errors import ContextLengthError, InvalidRequestError
from ainfer_pd.integrations.verl.sampling import IGNORED_KEYS, UNSUPPORTED_KEYS, to_sampling_params

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
HAVE_VERL = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("ray") is not None
needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl/ray not installed: pip install -e '.[verl]'")


# ---------------------------------------------------------------------------- pure mapping
def test_sampling_mapping_faithful():
    m = to_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                            "logprobs": True, "max_tokens": 33, "stop_token_ids": [5, 7], "n": 1,
                            "do_sample": True, "frobnicate": 1},
                           prompt_len=10, max_context_len=4096)
    p = m.params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.logprobs, p.max_new_tokens,
            p.stop_token_ids) == (0.7, 0.9, 20, 1.1, True, 33, (5, 7))
    assert m.ignored == ("do_sample",) and m.unknown == ("frobnicate",)
    assert {"n", "stop", "min_p", "presence_penalty", "prompt_logprobs"} <= set(UNSUPPORTED_KEYS)
    assert not IGNORED_KEYS & set(UNSUPPORTED_KEYS)
    # sglang-style key, top_k=0 means off, logprobs falsy like verl's vLLM server
    p = to_sampling_params({"max_new_tokens": 8, "top_k": 0, "logprobs": 0}, prompt_len=3, max_context_len=64).params
    assert (p.max_new_tokens, p.top_k, p.logprobs) == (8, -1, False)
    # default budget = min(response_length, prompt_length + response_length - len(prompt)), clamped to context
    p = to_sampling_params({}, prompt_len=100, max_context_len=4096, response_length=64, prompt_length=120).params
    assert p.max_new_tokens == 64
    p = to_sampling_params({}, prompt_len=150, max_context_len=4096, response_length=64, prompt_length=120).params
    assert p.max_new_tokens == 34
    p = to_sampling_params({"max_tokens": 1000}, prompt_len=60, max_context_len=64).params
    assert p.max_new_tokens == 4
    src = {"max_tokens": 5}
    to_sampling_params(src, prompt_len=1, max_context_len=64)
    assert src == {"max_tokens": 5}                                   # caller's dict untouched
    with pytest.raises(ContextLengthError):
        to_sampling_params({}, prompt_len=64, max_context_len=64)
    with pytest.raises(InvalidRequestError):
        to_sampling_params({"temperature": -1}, prompt_len=1, max_context_len=64)


# ---------------------------------------------------------------------------- verl helpers
# (the Ray fixture, ``ray_cluster``, is session-scoped in tests/conftest.py)
def rollout_config(routing_replay: bool = False, **engine):
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    rc = RolloutConfig(name="ainfer_pd", tensor_model_parallel_size=1, n_gpus_per_node=1, nnodes=1,
                       prompt_length=256, response_length=64, free_cache_engine=True, dtype="float32",
                       enable_rollout_routing_replay=routing_replay,
                       engine_kwargs={"ainfer_pd": {"config": TINY, **engine}})
    def strip(x):   # structured configs carry empty ``_target_`` fields; verl's YAML configs carry real ones
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not (k == "_target_" and not v)}
        return x
    d = strip(OmegaConf.to_container(OmegaConf.structured(rc)))
    d["_target_"] = "verl.workers.config.RolloutConfig"
    return OmegaConf.create(d)


def trainer_config(rc):
    from omegaconf import OmegaConf
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rc, "model": {}}, "data": {}})


async def launch_replica(suffix: str, model_config=None, routing_replay: bool = False, **engine):
    import verl  # noqa: F401  (loads the verl.plugins entry point)
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    cls = get_rollout_replica_class("ainfer_pd")
    replica = cls(replica_rank=0, config=rollout_config(routing_replay, **engine), model_config=model_config or {},
                  gpus_per_node=1,
                  name_suffix=suffix)
    await replica.init_local(RolloutMode.HYBRID)
    return replica


async def kill(replica):
    import ray
    await replica.shutdown()
    for s in replica.servers:
        ray.kill(s)


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


# ---------------------------------------------------------------------------- tests
@needs_verl
def test_registration_entry_point_and_env():
    """verl finds the backend through the verl.plugins entry point and VERL_USE_EXTERNAL_MODULES."""
    import os
    import subprocess
    import sys
    from importlib.metadata import entry_points
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "ainfer_pd"]
    assert eps and eps[0].value == "ainfer_pd.integrations.verl.register"
    eps[0].load()
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    assert RolloutReplicaRegistry.get("ainfer_pd").__name__ == "AInferPDReplica"
    assert get_rollout_class("ainfer_pd", "async").__name__ == "AInferPDServerAdapter"
    assert "ainfer_pd_tool_agent" in _agent_loop_registry
    # VERL_USE_EXTERNAL_MODULES with entry-point discovery switched off
    code = ("import verl\nfrom verl.workers.rollout.replica import RolloutReplicaRegistry\n"
            "from verl.workers.rollout.base import _ROLLOUT_REGISTRY\n"
            "assert 'ainfer_pd' in RolloutReplicaRegistry._registry\n"
            "assert ('ainfer_pd','async') in _ROLLOUT_REGISTRY\nprint('ok')\n")
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none",
           "VERL_USE_EXTERNAL_MODULES": "ainfer_pd.integrations.verl.register"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@needs_verl
async def test_llm_server_manager_and_client_prefix_reuse(verl_llm_servers):
    """verl's LLMServerManager launches the replica (for verl's own ppo_trainer config: tests/conftest.py
    ``verl_llm_servers``), LLMServerClient + router reach it through Ray; a ToolAgentLoop-style
    full-context resend under a fresh request id reuses the retained KV."""
    from verl.workers.rollout.replica import TokenOutput

    manager, _ = verl_llm_servers
    client = manager.get_client()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]
    out = await client.generate(uuid.uuid4().hex, prompt_ids=prompt, sampling_params={**GREEDY, "max_tokens": 8})
    assert isinstance(out, TokenOutput) and out.stop_reason == "completed"
    assert 1 <= len(out.token_ids) <= 8 and len(out.log_probs) == len(out.token_ids)
    assert out.extra_fields["num_cached_tokens"] == 0
    # turn 2: the whole context again (prompt + answer + observation), new request id
    ctx = prompt + list(out.token_ids) + [7, 8, 9, 10]
    out2 = await client.generate(uuid.uuid4().hex, prompt_ids=ctx, sampling_params={**GREEDY, "max_tokens": 8})
    assert out2.extra_fields["num_cached_tokens"] >= len(prompt)
    assert out2.extra_fields["ainfer_pd_trajectory_id"] == out.extra_fields["ainfer_pd_trajectory_id"]
    # the same context from scratch gives the same greedy tokens (reuse is exact)
    fresh = await client.generate(uuid.uuid4().hex, prompt_ids=[0] + ctx[1:],
                                  sampling_params={**GREEDY, "max_tokens": 2})
    assert fresh.extra_fields["num_cached_tokens"] == 0
    # unsupported input is a clear error
    with pytest.raises(Exception, match="text-only"):
        await client.generate("x", prompt_ids=prompt, sampling_params=GREEDY, image_data=[1])


# ---- the scripted tokenizer and tool (ainfer_pd.integrations.verl.scripted)
def _tokenizer(words: int = 508):
    from ainfer_pd.integrations.verl.scripted import word_tokenizer
    return word_tokenizer(words)


def _register_test_parts():
    from ainfer_pd.integrations.verl.scripted import scripted_tool
    return scripted_tool("ainfer_pd_test", latency_s=0.01)      # the random tiny model "calls" a tool every turn


@needs_verl
async def test_agent_loop_multi_turn_continue_reports_cached_tokens(verl_replica, verl_router):
    """The registered ainfer_pd_tool_agent loop (verl ToolAgentLoop machinery, verl LLMServerClient)
    runs a 3-turn episode; turns 2-3 send only the observation tokens and report cached prompt tokens."""
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    import hydra

    tool = _register_test_parts()
    replica = verl_replica
    rc = rollout_config()
    rc.multi_turn.format = "ainfer_pd_test"
    rc.multi_turn.max_assistant_turns = 3
    rc.multi_turn.max_tool_response_length = 256
    cfg = trainer_config(rc)
    client = LLMServerClient(cfg, load_balancer_handle=verl_router)
    loop = hydra.utils.instantiate(
        _agent_loop_registry["ainfer_pd_tool_agent"], trainer_config=DictConfigWrap(cfg), server_manager=client,
        tokenizer=_tokenizer(), processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([tool]))
    out = await loop.run({**GREEDY, "max_tokens": 6},
                         raw_prompt=[{"role": "user", "content": "t20 t21 t22 t23 t24 t25 t26 t27 t28"}])
    cached, sent = loop.episode.cached_tokens, loop.episode.sent_tokens
    from ainfer_pd.integrations.verl.server import EXTRA_FIELDS
    assert not {"ainfer_pd_cached_tokens", "ainfer_pd_sent_tokens"} & set(out.extra_fields)   # no keys of its own
    assert set(EXTRA_FIELDS) <= set(out.extra_fields)            # the server's, as every loop copies them
    assert len(cached) == 3 and cached[0] == 0
    assert all(c > 0 for c in cached[1:]), cached
    prompt_len = len(out.prompt_ids)
    assert sent[0] == prompt_len and all(s < prompt_len for s in sent[1:]), sent   # only new tokens sent
    assert out.num_turns >= 5 and 0 in out.response_mask and 1 in out.response_mask
    m = await replica.server_handle.metrics.remote()
    assert m["server"]["retained"] == 0                 # released at episode end


@needs_verl
async def test_update_weights_verl_generator_format(verl_replica):
    """ServerAdapter.update_weights with verl's (name, tensor) generator: outputs become those of a fresh
    worker loaded with the new weights; wrong names/shapes raise and leave the old weights intact
    (the shared replica gets its launch weights back at the end)."""
    import ray
    from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
    from ainfer_pd.errors import WeightUpdateError
    from verl.workers.rollout.base import get_rollout_class

    prompt = [5, 17, 33, 2, 99, 41, 7, 8, 250, 12]

    @ray.remote
    def reference(new_weights):
        """A fresh worker (own process, like the server's) loaded with ``new_weights``."""
        async def run():
            async with RolloutWorker(WorkerConfig.from_yaml(TINY)) as w:
                names = {n: p.detach().clone() for n, p in w.model.named_parameters()}
                if new_weights is not None:
                    await w.update_weights(new_weights.items())
                out = await w.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True))
                return names, out.token_ids
        return asyncio.run(run())

    names, base = ray.get(reference.remote(None))
    gen = torch.Generator().manual_seed(1)
    new = {n: (t + 0.5 * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for n, t in names.items()}
    _, expected = ray.get(reference.remote(new))
    assert expected != base, "perturbation too small to change greedy outputs"

    replica = verl_replica
    adapter = get_rollout_class("ainfer_pd", "async")(config=rollout_config(), model_config={}, device_mesh=None,
                                                       replica_rank=0, server_handle=replica.server_handle)
    try:
        adapter.bucket_bytes = 64 << 10                      # several buckets
        req = {**GREEDY, "max_tokens": 8}

        async def gen_tokens():
            return (await replica.server_handle.generate.remote(prompt, dict(req), uuid.uuid4().hex)).token_ids

        assert await gen_tokens() == base
        # wrong name (after valid tensors), then wrong shape: clear errors, old weights intact
        bad_name = (x for x in [*list(new.items())[:3], ("layers.99.nope.weight", torch.zeros(2))])
        with pytest.raises(WeightUpdateError, match="unknown weight name"):
            await adapter.update_weights(bad_name, global_steps=1)
        n0, t0 = next(iter(new.items()))
        with pytest.raises(WeightUpdateError, match="shape"):
            await adapter.update_weights(iter([(n0, torch.zeros(t0.numel() + 1))]))
        assert await gen_tokens() == base
        # verl's generator format, bf16 on the wire is cast to the model dtype only if asked: send fp32
        await adapter.update_weights(((n, t) for n, t in new.items()), global_steps=7)
        out = await replica.server_handle.generate.remote(prompt, dict(req), "r")
        assert out.token_ids == expected and out.extra_fields["global_steps"] == 7
    finally:
        await adapter.update_weights(iter(names.items()), global_steps=0)     # the launch weights, back
    assert await gen_tokens() == base


@needs_verl
async def test_sleep_wake_abort_resume_keep_other_trajectories(ray_cluster):
    import ray
    replica = await launch_replica("control", sleep_keep_weights=True)   # level 2, weights to host memory
    server = replica.server_handle
    try:
        req = {**GREEDY, "max_tokens": 6}
        a = await server.generate.remote([11, 12, 13, 14, 15, 16, 17, 18], dict(req), "a")
        b = await server.generate.remote([21, 22, 23, 24, 25, 26, 27, 28], dict(req), "b")
        tid_a, tid_b = a.extra_fields["ainfer_pd_trajectory_id"], b.extra_fields["ainfer_pd_trajectory_id"]
        # abort_all while a long turn of a third trajectory is in flight
        long = server.generate.remote([31, 32, 33, 34], {**GREEDY, "max_tokens": 2000, "ignore_eos": True}, "c")
        await asyncio.sleep(0.5)
        res = await replica.abort_all_requests(reset_prefix_cache=False)   # keep a and b's KV
        out_c = await long
        # partial rollout: the aborted turn returns what it produced so far
        assert out_c.stop_reason == "aborted" and 0 < len(out_c.token_ids) < 2000 and "c" in res["request_ids"]
        assert len(out_c.log_probs) == len(out_c.token_ids)
        # while paused a new request parks; it runs after resume_generation
        parked = server.generate.remote([41, 42, 43], dict(req), "d")
        await asyncio.sleep(0.2)
        await replica.resume_generation()
        assert (await parked).stop_reason == "completed"
        # a and b survived: continue_ with only new tokens reuses their KV
        a2 = await server.generate.remote([1, 2], dict(req), "a2", ainfer_pd_trajectory_id=tid_a,
                                          ainfer_pd_continue=True)
        assert a2.extra_fields["num_cached_tokens"] >= 8 and a2.extra_fields["ainfer_pd_trajectory_id"] == tid_a
        # sleep / wake_up (hybrid mode): trajectories survive (KV is re-prefilled after sleep)
        await replica.sleep()
        await replica.wake_up()
        b2 = await server.generate.remote([3, 4], dict(req), "b2", ainfer_pd_trajectory_id=tid_b,
                                          ainfer_pd_continue=True)
        assert b2.stop_reason == "completed" and b2.extra_fields["num_prompt_tokens"] == 8 + len(b.token_ids) + 2
        # same tokens as a never-slept context
        ref = await server.generate.remote([21, 22, 23, 24, 25, 26, 27, 28] + list(b.token_ids) + [3, 4], dict(req),
                                           "ref")
        assert ref.token_ids == b2.token_ids
        # reject mode: requests arriving behind a closed gate come back aborted at once
        await replica.abort_all_requests(reject_request=True)
        rej = await server.generate.remote([5, 6, 7], dict(req), "rej")
        assert rej.stop_reason == "aborted" and rej.token_ids == []
        await replica.resume_generation()
        await replica.clear_kv_cache()
        assert (await server.metrics.remote())["server"]["retained"] == 0
    finally:
        await kill(replica)


@needs_verl
async def test_replica_serves_actor_rollout_ref_model_path_and_syncs_transformers_names(verl_hf_replica):
    """The model comes from verl's actor_rollout_ref.model.path (a Hugging Face directory); the
    adapter streams a perturbed transformers model's named_parameters() in buckets (the shared
    replica gets its checkpoint's weights back at the end)."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    from ainfer_pd.errors import WeightUpdateError
    from tests import _hf_models
    replica, path = verl_hf_replica
    prompt = [5, 17, 33, 2, 99, 41, 7, 8, 250, 12]
    ref = _hf_models.make("qwen3_moe", seed=0)
    base = _hf_models.hf_greedy(ref, prompt, 8)[0]
    original = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
    _hf_models.randomize(ref, seed=123)
    expected = _hf_models.hf_greedy(ref, prompt, 8)[0]
    assert expected != base
    model_config = HFModelConfig(path=str(path), load_tokenizer=False)   # verl's actor_rollout_ref.model
    wc = await replica.server_handle.get_worker_config.remote()
    assert wc["model"]["architecture"] == "qwen3_moe" and wc["model"]["path"] == str(path)
    req = {**GREEDY, "max_tokens": 8, "ignore_eos": True}

    async def gen_tokens():
        return (await replica.server_handle.generate.remote(prompt, dict(req), uuid.uuid4().hex)).token_ids

    assert await gen_tokens() == base
    adapter = get_rollout_class("ainfer_pd", "async")(config=rollout_config(), model_config=model_config,
                                                       device_mesh=None, replica_rank=0,
                                                       server_handle=replica.server_handle)
    adapter.bucket_bytes = 32 << 10                       # several buckets
    named = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
    try:
        with pytest.raises(WeightUpdateError, match="incomplete"):      # a bucket lost: nothing applied
            await adapter.update_weights(iter(named[:-2]), global_steps=1)
        assert await gen_tokens() == base
        await adapter.update_weights(iter(named), global_steps=2)
        assert await gen_tokens() == expected
    finally:
        await adapter.update_weights(iter(original), global_steps=0)    # the checkpoint's weights, back
    assert await gen_tokens() == base


@needs_verl
async def test_fully_async_client_partial_rollout_resumes_without_recompute(verl_replica, verl_router):
    """verl's FullyAsyncLLMServerClient: abort_all_requests mid-turn returns the partial tokens,
    the client resends prompt + partial tokens after resume_generation, the server reuses their
    KV (nothing of the partial turn is prefilled again) and the merged output equals an
    uninterrupted greedy run; with routing replay on (verl's ``enable_rollout_routing_replay``), the
    client's merge of the two TokenOutputs' ``routed_experts`` equals the uninterrupted run's, which
    equals the router's top-k of a full recompute."""
    import numpy as np
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    replica = verl_replica
    server = replica.server_handle
    prompt = [7, 3, 99, 41, 250, 12, 88, 17, 5, 64, 33, 2, 101, 77, 9]
    n = 300                            # the turn's tokens (the abort lands after ~100 of them on the 2-core VM)
    req = {**GREEDY, "max_tokens": n, "ignore_eos": True}
    ref = await server.generate.remote(prompt, dict(req), "reference")
    assert len(ref.token_ids) == n
    await replica.clear_kv_cache()
    before = (await server.metrics.remote())["server"]          # the shared server's counters so far
    cfg = trainer_config(rollout_config(routing_replay=True))
    client = FullyAsyncLLMServerClient(cfg, load_balancer_handle=verl_router)
    task = asyncio.ensure_future(client.generate("episode-1", prompt_ids=prompt, sampling_params=dict(req)))
    for _ in range(2000):
        if (await server.metrics.remote())["server"]["inflight"]:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    res = await replica.abort_all_requests(reset_prefix_cache=False)    # keep the partial turn's KV
    assert res["aborted_count"] == 1
    await asyncio.sleep(0.3)
    await replica.resume_generation()
    out = await asyncio.wait_for(task, 120)
    assert out.token_ids == ref.token_ids and len(out.log_probs) == n
    stats = (await server.metrics.remote())["server"]
    k = stats["partial_tokens"] - before.get("partial_tokens", 0)
    assert stats["aborted"] - before.get("aborted", 0) == 1 and 0 < k < n
    # the resumed turn fed only the last partial token again
    assert stats["cached_tokens"] - before.get("cached_tokens", 0) == len(prompt) + k - 1
    # routing replay: [every fed token, MoE layers, top_k], merged contiguously across the resume
    from ainfer_pd import WorkerConfig
    from ainfer_pd.engine.model.model import build_model
    from tests.test_routing_replay import _same, reference_routing
    wc = WorkerConfig.from_yaml(TINY)
    assert isinstance(ref.routed_experts, np.ndarray)
    assert ref.routed_experts.shape == (len(prompt) + n - 1, wc.model.num_layers, wc.model.top_k)
    assert np.array_equal(out.routed_experts, ref.routed_experts)
    seq = prompt + list(ref.token_ids)
    want = reference_routing(build_model(wc.model), wc, seq)[:len(seq) - 1]
    assert _same(torch.tensor(ref.routed_experts), want)
