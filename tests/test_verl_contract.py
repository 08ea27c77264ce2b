"""verl's contract as vLLM users run it (issue 34): checkpoint engines' async generators, aborts that
abort every admitted request, one request per request id, agent loops that batch together,
Prometheus from verl's dataclass config, every rollout / sampling key given its meaning or named.

Real verl classes throughout; the tiny MoE on CPU. Skipped only when verl / ray are not installed.
"""
from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from tests.test_verl_integration import GREEDY, HAVE_VERL, TINY, kill, rollout_config

needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl/ray not installed: pip install -e '.[verl]'")


async def _server(**engine):
    """An in-process AInferPDServer (no Ray): the test drives its event loop step by step."""
    from ainfer_pd.integrations.verl.server import AInferPDServer
    server = AInferPDServer(config=rollout_config(**engine), rollout_mode="hybrid")
    await server.launch_server()
    return server


# ---------------------------------------------------------------------------- item 1
@needs_verl
async def test_adapter_takes_a_checkpoint_engines_async_generator(verl_hf_replica):
    """The nccl / nixl / hccl engines' ``receive_weights`` is an async generator: verl's
    ``merge_weight_chunks`` over the chunks of ``split_weight_chunks`` (what the sender cuts and the
    receiver reassembles, the wire between them left out). The adapter takes it bucket by bucket,
    all-or-nothing: an incomplete stream, or one that fails mid-way, leaves the old weights (the
    shared replica gets its checkpoint's weights back at the end)."""
    import inspect

    from verl.checkpoint_engine.base import merge_weight_chunks, split_weight_chunks
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    from ainfer_pd.errors import WeightUpdateError
    from tests import _hf_models

    replica, path = verl_hf_replica
    prompt = [5, 17, 33, 2, 99, 41, 7, 8, 250, 12]
    ref = _hf_models.make("qwen3_moe", seed=0)
    base = _hf_models.hf_greedy(ref, prompt, 8)[0]
    original = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
    _hf_models.randomize(ref, seed=321)
    expected = _hf_models.hf_greedy(ref, prompt, 8)[0]
    assert expected != base
    named = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
    bucket = 8 << 10                       # smaller than the embedding: some weights arrive in several chunks
    assert any(t.nbytes > bucket for _, t in named)

    def received(items):
        return merge_weight_chunks(split_weight_chunks(iter(items), bucket), bucket)

    assert inspect.isasyncgen(received(named))

    async def failing():
        async for item in received(named[:5]):
            yield item
        raise RuntimeError("the broadcast lost its peer")

    model_config = HFModelConfig(path=str(path), load_tokenizer=False)
    req = {**GREEDY, "max_tokens": 8, "ignore_eos": True}

    async def tokens():
        return (await replica.server_handle.generate.remote(prompt, dict(req), uuid.uuid4().hex)).token_ids

    assert await tokens() == base
    adapter = get_rollout_class("ainfer_pd", "async")(config=rollout_config(), model_config=model_config,
                                                       device_mesh=None, replica_rank=0,
                                                       server_handle=replica.server_handle)
    adapter.bucket_bytes = 16 << 10                          # several staged buckets
    try:
        with pytest.raises(WeightUpdateError, match="incomplete"):
            await adapter.update_weights(received(named[:-2]), global_steps=1)
        with pytest.raises(RuntimeError, match="lost its peer"):
            await adapter.update_weights(failing(), global_steps=1)
        assert await tokens() == base
        await adapter.update_weights(received(named), global_steps=2)
        out = await replica.server_handle.generate.remote(prompt, dict(req), "after")
        assert out.token_ids == expected and out.extra_fields["global_steps"] == 2
        with pytest.raises(WeightUpdateError, match="iterable"):
            await adapter.update_weights(42)
    finally:
        await adapter.update_weights(iter(original), global_steps=0)    # the checkpoint's weights, back
    assert await tokens() == base


# ---------------------------------------------------------------------------- item 4
@needs_verl
async def test_abort_all_aborts_every_admitted_request_at_every_step_of_its_admission():
    """abort_all_requests, called directly (no task switch before it runs) after 0..3 loop steps of
    six concurrent requests: every request past the gate comes back "aborted" well short of its 400
    tokens, whether its turn was running, queued in the worker or not submitted yet (before the fix,
    a request admitted but not yet at the worker ran all its tokens while the drain waited)."""
    server = await _server()
    try:
        n = 300
        req = {**GREEDY, "max_tokens": n, "ignore_eos": True}
        for steps in range(4):
            ids = [f"r{steps}-{i}" for i in range(6)]
            tasks = [asyncio.ensure_future(server.generate([11 + i, 12, 13, 14, 15, 16], dict(req), rid))
                     for i, rid in enumerate(ids)]
            for _ in range(steps):
                await asyncio.sleep(0)
            admitted = set(server._inflight)
            res = await server.abort_all_requests()
            assert set(res["request_ids"]) == admitted and (steps == 0) == (not admitted)
            assert not server._inflight                      # drained: every admitted request returned
            await server.resume_generation()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for rid, o in zip(ids, outs):
                if rid in admitted:
                    assert o.stop_reason == "aborted" and len(o.token_ids) < n, (steps, o.stop_reason, len(o.token_ids))
                else:                                        # it arrived after the gate closed: parked, then ran
                    assert o.stop_reason == "completed" and len(o.token_ids) == n
        # a request arriving behind the closed gate parks and runs after resume
        await server.abort_all_requests()
        parked = asyncio.ensure_future(server.generate([21, 22, 23], {**GREEDY, "max_tokens": 4}, "parked"))
        await asyncio.sleep(0.05)
        assert not parked.done()
        await server.resume_generation()
        assert (await asyncio.wait_for(parked, 60)).stop_reason == "completed"
    finally:
        await server.shutdown()


@needs_verl
async def test_abort_all_resets_the_prefix_cache_by_default():
    """As vLLM's ``abort_all_requests(reset_prefix_cache=True)``: the cached KV is dropped (the
    retained trajectory recomputes its context, same greedy tokens); ``reset_prefix_cache=False``
    keeps it."""
    server = await _server()
    try:
        req = {**GREEDY, "max_tokens": 6}
        prompt = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]
        first = await server.generate(prompt, dict(req), "a")
        ctx = prompt + list(first.token_ids) + [5, 6]

        await server.abort_all_requests(reset_prefix_cache=False)
        await server.resume_generation()
        kept = await server.generate(ctx, dict(req), "b")
        assert kept.extra_fields["num_cached_tokens"] >= len(prompt)

        ctx2 = ctx + list(kept.token_ids) + [7, 8]
        await server.abort_all_requests()                    # the default
        await server.resume_generation()
        again = await server.generate(ctx2, dict(req), "c")
        assert again.extra_fields["num_cached_tokens"] == 0
        assert again.extra_fields["ainfer_pd_trajectory_id"] == first.extra_fields["ainfer_pd_trajectory_id"]
        await server.clear_kv_cache()
        fresh = await server.generate(ctx2, dict(req), "d")
        assert fresh.token_ids == again.token_ids
    finally:
        await server.shutdown()


# ---------------------------------------------------------------------------- item 17
@needs_verl
async def test_a_second_request_with_the_same_id_in_flight_is_refused():
    from ainfer_pd.errors import DuplicateRequestError, InvalidRequestError
    server = await _server()
    try:
        req = {**GREEDY, "max_tokens": 40, "ignore_eos": True}
        first = asyncio.ensure_future(server.generate([11, 12, 13, 14], dict(req), "same"))
        await asyncio.sleep(0)
        with pytest.raises(DuplicateRequestError, match="same"):
            await server.generate([21, 22, 23, 24], dict(req), "same")
        out = await asyncio.wait_for(first, 60)
        assert out.stop_reason == "completed" and len(out.token_ids) == 40
        assert not server._requests and not server._inflight
        # the id is free again once its request returned
        again = await server.generate([21, 22, 23, 24], {**GREEDY, "max_tokens": 3}, "same")
        assert again.stop_reason == "completed"
        # a request parked at the gate holds its id as well
        await server.abort_all_requests()
        parked = asyncio.ensure_future(server.generate([1, 2, 3], {**GREEDY, "max_tokens": 2}, "p"))
        await asyncio.sleep(0.01)
        with pytest.raises(DuplicateRequestError):
            await server.generate([1, 2, 3], {**GREEDY, "max_tokens": 2}, "p")
        await server.resume_generation()
        assert (await asyncio.wait_for(parked, 60)).stop_reason == "completed"
        with pytest.raises(InvalidRequestError):
            await server.generate([1, 2], dict(req), "")
    finally:
        await server.shutdown()


# ---------------------------------------------------------------------------- item 6
def _dataclass_config(**fields):
    """verl's own ``RolloutConfig`` dataclass, as ``omega_conf_to_dataclass`` hands it to a replica."""
    from verl.workers.config import RolloutConfig
    fields = {"dtype": "float32", **fields}
    return RolloutConfig(name="ainfer_pd", tensor_model_parallel_size=1, n_gpus_per_node=1, nnodes=1,
                         prompt_length=256, response_length=64, free_cache_engine=True,
                         engine_kwargs={"ainfer_pd": {"config": TINY}}, **fields)


@needs_verl
async def test_prometheus_enable_from_verls_dataclass_serves_metrics_at_the_scrape_target(ray_cluster, tmp_path):
    """``rollout.prometheus.enable`` in verl's ``RolloutConfig`` dataclass starts ``/metrics`` on a free
    port (not ``prometheus.port``, Prometheus's own 9090) and the replica's ``server_address`` is that
    endpoint; verl's own ``update_prometheus_config`` writes it as the ``rollout`` scrape target, and a
    scrape of that target returns the server's and the worker's metrics."""
    import urllib.request

    import yaml
    from verl.workers.config.rollout import PrometheusConfig
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    from verl.workers.rollout.utils import update_prometheus_config

    prom = PrometheusConfig(enable=True, port=9090, file=str(tmp_path / "prometheus.yml"))
    rc = _dataclass_config(prometheus=prom)
    replica = get_rollout_replica_class("ainfer_pd")(replica_rank=0, config=rc, model_config={}, gpus_per_node=1,
                                                     name_suffix="prom")
    await replica.init_local(RolloutMode.HYBRID)
    try:
        server = replica.server_handle
        out = await server.generate.remote([3, 4, 5, 6], {**GREEDY, "max_tokens": 3}, "p1")
        assert out.stop_reason == "completed"
        host, port = await server.get_metrics_address.remote()
        assert port not in (0, 9090)
        assert replica.server_address == f"{host}:{port}"
        update_prometheus_config(prom, [replica.server_address], "ainfer_pd")
        written = yaml.safe_load(open(prom.file))
        targets = [t for job in written["scrape_configs"] if job["job_name"] == "rollout"
                   for sc in job["static_configs"] for t in sc["targets"]]
        assert targets == [replica.server_address]
        with urllib.request.urlopen(f"http://{targets[0]}/metrics", timeout=30) as r:   # Prometheus's default path
            text = r.read().decode()
        assert "ainfer_pd_server_turns_total" in text and "ainfer_pd_" in text
    finally:
        await kill(replica)


# ---------------------------------------------------------------------------- item 7
def test_every_listed_rollout_key_gets_its_meaning_or_a_typed_error():
    """verl's ``RolloutConfig`` dataclass: each key of issue 34's list sets its worker-config key, is
    refused with UnsupportedOptionError naming it, or gets one note (logged once as a warning)."""
    if not HAVE_VERL:
        pytest.skip("verl not installed")
    from verl.workers.config.model import MtpConfig

    from ainfer_pd.config import WorkerConfig
    from ainfer_pd.errors import UnsupportedOptionError
    from ainfer_pd.integrations.verl.settings import (ROLLOUT_KEYS, build_worker_config, rollout_notes,
                                                      rollout_overrides)
    listed = {"max_model_len", "dtype", "seed", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
              "enforce_eager", "cudagraph_capture_sizes", "quantization", "mtp", "load_format", "enable_sleep_mode",
              "profiler", "expert_parallel_size"}
    assert listed <= set(ROLLOUT_KEYS)
    base = WorkerConfig.from_yaml(TINY)
    rc = _dataclass_config(max_model_len=40, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=256,
                           enable_prefix_caching=False, enforce_eager=True, cudagraph_capture_sizes=[4, 1, 2],
                           load_format="dummy", enable_sleep_mode=False, seed=7)
    got = rollout_overrides(rc, base, {})
    assert got == {"model.max_context_len": 40, "model.dtype": "bfloat16", "scheduler.max_decode_batch": 8,
                   "scheduler.max_prefill_tokens": 256, "cache.prefix_sharing": False, "device.cuda_graphs": False,
                   "device.graph_batch_sizes": (1, 2, 4)}
    cfg = build_worker_config({"config": TINY}, None, rc)
    assert (cfg.model.max_context_len, cfg.model.dtype, cfg.scheduler.max_decode_batch,
            cfg.cache.prefix_sharing) == (40, "bfloat16", 8, False)
    # explicit engine overrides win over the rollout keys
    assert build_worker_config({"config": TINY, "overrides": {"model.dtype": "float32"}}, None, rc).model.dtype \
        == "float32"
    notes = " ".join(rollout_notes(rc, cfg))
    assert "rollout.seed=7" in notes and "load_format=dummy" in notes and "enable_sleep_mode=False" in notes
    # the config's cap stands below verl's default max_num_seqs / max_num_batched_tokens: said
    notes = " ".join(rollout_notes(_dataclass_config(), base))
    assert "max_num_seqs=1024" in notes and "max_num_batched_tokens=8192" in notes
    assert rollout_overrides(_dataclass_config(quantization="fp8"), base, {})["model.quantization"] == "fp8"
    mtp = rollout_overrides(_dataclass_config(mtp=MtpConfig(enable=True, enable_rollout=True,
                                                            num_speculative_tokens=3)), base, {})
    assert (mtp["spec.method"], mtp["spec.num_draft_tokens"]) == ("mtp", 3)
    assert "spec.method" not in rollout_overrides(_dataclass_config(mtp=MtpConfig(enable=True)), base, {})
    for bad, key in [(dict(quantization="torchao"), "quantization"),
                     (dict(mtp=MtpConfig(enable=True, enable_rollout=True, method="eagle")), "mtp"),
                     (dict(mtp=MtpConfig(enable=True, enable_rollout=True, speculative_eagle_topk=4)), "mtp"),
                     (dict(load_format="gguf"), "load_format"),
                     (dict(max_model_len=base.model.max_context_len + 1), "max_model_len")]:
        with pytest.raises(UnsupportedOptionError, match=key) as ei:
            rollout_overrides(_dataclass_config(**bad), base, {})
        assert ei.value.key == key
    ep2 = _dataclass_config(expert_parallel_size=2, data_parallel_size=2)
    assert rollout_overrides(ep2, base, {})["parallel.expert_parallel"] == 2


def test_every_listed_sampling_key_gets_its_meaning_or_a_typed_error():
    from ainfer_pd.errors import AInferPDError, UnsupportedOptionError
    from ainfer_pd.integrations.verl.sampling import to_sampling_params
    neutral = {"min_p": 0.0, "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0, "stop": [],
               "prompt_logprobs": None, "n": 1}
    m = to_sampling_params(neutral, prompt_len=4, max_context_len=64)
    assert m.ignored == () and m.unknown == ()
    for key, value in [("min_p", 0.05), ("min_tokens", 4), ("presence_penalty", 0.5), ("frequency_penalty", -0.2),
                       ("stop", ["</answer>"]), ("prompt_logprobs", 0), ("prompt_logprobs", 5), ("n", 2)]:
        with pytest.raises(UnsupportedOptionError, match=key) as ei:
            to_sampling_params({key: value}, prompt_len=4, max_context_len=64)
        assert ei.value.key == key and isinstance(ei.value, AInferPDError)


@needs_verl
async def test_rollout_keys_reach_the_server_and_verls_distillation_gets_a_typed_error(caplog):
    """On a server: max_model_len refuses a 50-token prompt and stops a 30-token one at 40 tokens in
    all; enable_sleep_mode=False keeps the worker awake; the notes are logged once each; verl's
    teacher sampling params (prompt_logprobs) raise UnsupportedOptionError, not a KeyError later."""
    import logging
    from types import SimpleNamespace

    from verl.experimental.teacher_loop.teacher_manager import _get_teacher_sampling_params

    from ainfer_pd.errors import ContextLengthError, UnsupportedOptionError
    from ainfer_pd.integrations.verl.server import AInferPDServer

    with caplog.at_level(logging.WARNING, logger="ainfer_pd.integrations.verl.server"):
        server = AInferPDServer(config=_dataclass_config(max_model_len=40, enable_sleep_mode=False, seed=3),
                                rollout_mode="hybrid")
        await server.launch_server()
    try:
        assert sum("rollout.seed=3" in r.getMessage() for r in caplog.records) == 1
        assert server.worker_config.model.max_context_len == 40
        req = {**GREEDY, "max_tokens": 32, "ignore_eos": True}
        out = await server.generate(list(range(10, 40)), dict(req), "r30")
        assert len(out.token_ids) == 10
        with pytest.raises(ContextLengthError):
            await server.generate(list(range(10, 60)), dict(req), "r50")
        await server.sleep()
        assert server.worker.engine.residency.state.kv             # enable_sleep_mode=False: nothing released
        teacher = _get_teacher_sampling_params(
            SimpleNamespace(inference=SimpleNamespace(temperature=1.0)),
            SimpleNamespace(topk=4, loss_settings=SimpleNamespace(use_topk=True)))
        with pytest.raises(UnsupportedOptionError, match="prompt_logprobs"):
            await server.generate(list(range(10, 20)), teacher, "teacher")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ainfer_pd.integrations.verl.server"):
            for i in range(2):
                await server.generate([5, 6, 7], {**GREEDY, "max_tokens": 2, "skip_special_tokens": True}, f"s{i}")
        assert sum("skip_special_tokens" in r.getMessage() for r in caplog.records) == 1
    finally:
        await server.shutdown()


# ---------------------------------------------------------------------------- items 5, 8
def _ppo_config(model_dir: str, **over):
    """verl's own ``ppo_trainer`` config (hydra compose, as ``main_ppo`` builds it) with the rollout
    on ainfer_pd serving ``model_dir`` on CPU."""
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = {
        "actor_rollout_ref.model.path": model_dir, "actor_rollout_ref.rollout.name": "ainfer_pd",
        "actor_rollout_ref.rollout.dtype": "float32", "actor_rollout_ref.rollout.prompt_length": 64,
        "actor_rollout_ref.rollout.response_length": 16, "actor_rollout_ref.rollout.temperature": 0.0,
        "actor_rollout_ref.rollout.calculate_log_probs": True, "actor_rollout_ref.rollout.n": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1, "actor_rollout_ref.rollout.data_parallel_size": 1,
        "actor_rollout_ref.rollout.agent.num_workers": 2, "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1,
        "actor_rollout_ref.rollout.nnodes": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 1,
        "data.max_prompt_length": 64, "data.max_response_length": 16,
        "+actor_rollout_ref.rollout.engine_kwargs.ainfer_pd.config": TINY, **over}
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose("ppo_trainer", overrides=[f"{k}={v}" for k, v in overrides.items()])


@needs_verl
async def test_agent_loop_manager_batches_mixed_agent_loops_over_two_workers(verl_llm_servers):
    """verl's AgentLoopManager with two AgentLoopWorkers: one worker's chunk runs only
    ``single_turn_agent``, the other's only ``ainfer_pd_tool_agent``; ``DataProto.concat`` of their
    outputs needs the same non-tensor keys (before the fix the tool loop added its own and concat failed)."""
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.protocol import DataProto

    servers, cfg = verl_llm_servers          # LLMServerManager.create over _ppo_config (tests/conftest.py)
    manager = await AgentLoopManager.create(config=cfg, llm_client=servers.get_client())
    assert len(manager.agent_loop_workers) == 2
    prompts = [[{"role": "user", "content": f"t{20 + i} t21 t22 t23 t24 t25"}] for i in range(4)]
    batch = DataProto(non_tensor_batch={
        "raw_prompt": np.array(prompts + [None], dtype=object)[:4],
        "agent_name": np.array(["single_turn_agent"] * 2 + ["ainfer_pd_tool_agent"] * 2, dtype=object),
        "index": np.arange(4)})
    out = await manager.generate_sequences(batch)
    assert len(out) == 4 and out.batch["responses"].shape[0] == 4
    from ainfer_pd.integrations.verl.server import EXTRA_FIELDS
    assert set(EXTRA_FIELDS) <= set(out.non_tensor_batch)          # the server's fields, copied by both loops
    assert not {"ainfer_pd_cached_tokens", "ainfer_pd_sent_tokens"} & set(out.non_tensor_batch)
    assert list(out.non_tensor_batch["agent_name"]) == list(batch.non_tensor_batch["agent_name"])


@needs_verl
async def test_every_token_output_has_the_same_extra_fields():
    """verl's agent loops copy ``TokenOutput.extra_fields`` into their outputs: completed, aborted
    mid-turn, aborted before the worker and refused at a rejecting gate all carry one key set."""
    from ainfer_pd.integrations.verl.server import EXTRA_FIELDS
    server = await _server()
    try:
        done = await server.generate([3, 4, 5], {**GREEDY, "max_tokens": 3}, "done")
        long = asyncio.ensure_future(server.generate([6, 7, 8], {**GREEDY, "max_tokens": 3000, "ignore_eos": True},
                                                     "long"))
        while not server.worker.trajectories or not any(t.tokens or t.turn for t in server.worker.trajectories.values()):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await server.abort_all_requests(reject_request=True)
        mid = await long
        rejected = await server.generate([9, 10], {**GREEDY, "max_tokens": 3}, "rejected")
        await server.resume_generation()
        assert (done.stop_reason, mid.stop_reason, rejected.stop_reason) == ("completed", "aborted", "aborted")
        assert 0 < len(mid.token_ids) < 3000
        for out in (done, mid, rejected):
            assert tuple(out.extra_fields) == EXTRA_FIELDS, out.extra_fields
    finally:
        await server.shutdown()


@needs_verl
async def test_tool_agent_under_fully_async_client_sends_only_new_tokens_and_releases(verl_replica, verl_router):
    """``ainfer_pd_tool_agent`` driven through verl's FullyAsyncLLMServerClient (which rebuilds each
    TokenOutput and keeps none of the server's fields): turns 2-3 send only the new tokens (the
    server receives the prompt once plus the observations), and the trajectory is released at the
    end of the episode (before the fix: the whole context each turn, and the trajectory kept)."""
    replica = verl_replica
    server = replica.server_handle
    before = (await server.metrics.remote())["server"]          # the shared server's counters so far
    rc = rollout_config()
    rc.multi_turn.format = "ainfer_pd_test"
    rc.multi_turn.max_assistant_turns = 3
    rc.multi_turn.max_tool_response_length = 256
    loop = _tool_agent_under_fully_async_client(verl_router, rc)
    out = await loop.run({**GREEDY, "max_tokens": 6},
                         raw_prompt=[{"role": "user", "content": "t20 t21 t22 t23 t24 t25 t26 t27 t28"}])
    stats = (await server.metrics.remote())["server"]
    assert stats["retained"] == 0                                 # released at the end of the episode
    sent, cached = loop.episode.sent_tokens, loop.episode.cached_tokens
    prompt_len = len(out.prompt_ids)
    assert len(sent) == 3 and sent[0] == prompt_len and all(0 < s < prompt_len for s in sent[1:]), sent
    assert all(c > 0 for c in cached[1:]), cached
    assert stats["request_tokens"] - before.get("request_tokens", 0) == sum(sent)   # what reached the server


@needs_verl
async def test_tool_agent_under_fully_async_client_resumes_an_aborted_turn_with_new_tokens_only(verl_replica, verl_router):
    """A turn of an ``ainfer_pd_tool_agent`` episode aborted mid-way (verl's partial rollout) is resumed
    by FullyAsyncLLMServerClient with only the turn's new tokens plus the partial ones (the server
    holds the context before the turn), and the episode's trajectory is released at the end."""
    replica = verl_replica
    server = replica.server_handle
    before = (await server.metrics.remote())["server"]          # the shared server's counters so far

    def since(stats: dict) -> dict:
        return {k: v - before.get(k, 0) for k, v in stats.items() if k not in ("retained", "inflight")}

    rc = rollout_config()
    rc.multi_turn.format = "ainfer_pd_test"
    rc.multi_turn.max_assistant_turns = 2
    rc.multi_turn.max_tool_response_length = 256
    rc.response_length = 2000
    loop = _tool_agent_under_fully_async_client(verl_router, rc)
    n = 300                                                      # tokens of each turn
    task = asyncio.ensure_future(loop.run({**GREEDY, "max_tokens": n, "ignore_eos": True},
                                          raw_prompt=[{"role": "user", "content": " ".join(f"t{20 + i}" for i in range(30))}]))
    iters = None
    for _ in range(6000):            # the second turn is running and has decoded a few tokens (not a fixed sleep:
        full = await server.metrics.remote()                     # under load its first token came after 0.1 s)
        m = full["server"]
        if iters is None and since(m).get("turns", 0) >= 1 and m["inflight"]:
            iters = full.get("d_iter_s_count", 0)
        if iters is not None and full.get("d_iter_s_count", 0) >= iters + 5:
            break
        await asyncio.sleep(0.01)
    await replica.abort_all_requests(reset_prefix_cache=False)
    await replica.resume_generation()
    out = await asyncio.wait_for(task, 300)
    stats = (await server.metrics.remote())["server"]
    d = since(stats)
    assert d["aborted"] == 1 and d["partial_tokens"] > 0 and d["turns"] == 2
    sent = loop.episode.sent_tokens
    assert len(sent) == 2 and sent[1] < sent[0]
    # the server received the prompt, turn 2's new tokens, and on resume those again plus the partial ones
    assert d["request_tokens"] == sent[0] + 2 * sent[1] + d["partial_tokens"]
    assert stats["retained"] == 0
    assert sum(out.response_mask) == 2 * n                       # both turns generated all their tokens


def _tool_agent_under_fully_async_client(router, rc):
    """An ``ainfer_pd_tool_agent`` (scripted tool) whose server manager is verl's
    FullyAsyncLLMServerClient over ``router`` (verl's router to the replica), under the rollout config ``rc``."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from ainfer_pd.integrations.verl.scripted import scripted_tool, word_tokenizer
    from tests.test_verl_integration import trainer_config

    cfg = trainer_config(rc)
    client = FullyAsyncLLMServerClient(cfg, load_balancer_handle=router)
    return hydra.utils.instantiate(
        _agent_loop_registry["ainfer_pd_tool_agent"], trainer_config=DictConfigWrap(cfg), server_manager=client,
        tokenizer=word_tokenizer(), processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(OmegaConf.create({})),
        tools=ToolListWrap([scripted_tool("ainfer_pd_test", latency_s=0.01)]))
