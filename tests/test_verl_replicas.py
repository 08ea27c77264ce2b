"""verl replicas as verl runs them (issue 15, items 5-6 on CPU): sleep levels by rollout mode, verl's
memory share, multi-rank replicas launched through verl's replica classes, torch.profiler traces
and a Prometheus scrape. Real verl classes, real Ray actors, real gloo processes."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from ainfer_pd.errors import ConfigError
from ainfer_pd.integrations.verl import residency_plan as rp
from ainfer_pd.integrations.verl.settings import build_worker_config
from tests.test_verl_integration import (GREEDY, HAVE_VERL, TINY, _register_test_parts, _tokenizer, kill,
                                         needs_verl, rollout_config, trainer_config)

ROOT = Path(__file__).resolve().parents[1]
TWO = str(ROOT / "configs" / "tiny-2rank-cpu.yaml")
PROMPT = [5, 17, 33, 2, 99, 41, 7, 8, 250, 12]
REQ = {**GREEDY, "max_tokens": 8, "ignore_eos": True}


# ---------------------------------------------------------------------------- pure policy
def test_sleep_plan_follows_verl_rollout_modes():
    if HAVE_VERL:
        from verl.workers.rollout.replica import RolloutMode
        hybrid, colocated, standalone = RolloutMode.HYBRID, RolloutMode.COLOCATED, RolloutMode.STANDALONE
    else:
        hybrid, colocated, standalone = "hybrid", "colocated", "standalone"
    assert rp.sleep_plan(hybrid, free_cache_engine=True) == rp.SleepPlan(2, False)      # vLLM level 2: dropped
    assert rp.sleep_plan(colocated, free_cache_engine=True) == rp.SleepPlan(1, False)
    assert rp.sleep_plan(standalone, free_cache_engine=True) is None
    assert rp.sleep_plan(hybrid, free_cache_engine=False) is None
    assert rp.sleep_plan(hybrid, free_cache_engine=True, node_rank=1) is None
    assert rp.sleep_plan(hybrid, free_cache_engine=True, level=1, keep_weights=True) == rp.SleepPlan(1, True)
    with pytest.raises(ConfigError):
        rp.sleep_plan(hybrid, free_cache_engine=True, level=3)
    with pytest.raises(ConfigError):
        rp.sleep_plan("disaggregated", free_cache_engine=True)
    assert rp.wake_tags(hybrid, ["weights"]) == ["weights"]
    assert rp.wake_tags(hybrid, None) == ["weights", "kv_cache"]
    assert rp.wake_tags(colocated, ["kv_cache"]) == ["weights", "kv_cache"]
    assert rp.wake_tags(standalone, None) is None
    assert rp.frees_kv_pool(standalone, free_cache_engine=True) and rp.frees_kv_pool(hybrid, free_cache_engine=True)
    assert not rp.frees_kv_pool(colocated, free_cache_engine=True)
    assert not rp.frees_kv_pool(hybrid, free_cache_engine=False)


@needs_verl
def test_rollout_gpu_memory_utilization_becomes_the_cache_budget():
    rc = rollout_config()
    rc.gpu_memory_utilization = 0.37
    cuda = build_worker_config({"config": str(ROOT / "configs" / "tiny-cuda.yaml")}, None, rc)
    assert cuda.cache.gpu_memory_utilization == 0.37 and cuda.cache.num_blocks == 0     # sized from the budget
    cpu = build_worker_config({"config": TINY}, None, rc)
    assert cpu.cache.gpu_memory_utilization == 0.37 and cpu.cache.num_blocks == 4096   # CPU: the YAML's pool
    pinned = build_worker_config({"config": str(ROOT / "configs" / "tiny-cuda.yaml"),
                                  "overrides": {"cache.num_blocks": 64, "cache.gpu_memory_utilization": 0.5}}, None, rc)
    assert (pinned.cache.num_blocks, pinned.cache.gpu_memory_utilization) == (64, 0.5)
    rc.gpu_memory_utilization = 1.5
    with pytest.raises(ConfigError):
        build_worker_config({"config": TINY}, None, rc)


# ---------------------------------------------------------------------------- helpers
def _trainer_weights(cfg_path: str) -> list:
    """The weights the served model starts from (the seeded init of ``cfg_path``), as a trainer's
    (name, tensor) list."""
    from ainfer_pd.config import WorkerConfig
    from ainfer_pd.engine.model.model import build_model
    return [(n, p.detach().clone()) for n, p in build_model(WorkerConfig.from_yaml(cfg_path).model).named_parameters()]


async def _launch(suffix: str, mode: str = "HYBRID", model_config=None, **engine):
    import verl  # noqa: F401  (loads the verl.plugins entry point)
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    cls = get_rollout_replica_class("ainfer_pd")
    rc = rollout_config(**engine)
    replica = cls(replica_rank=0, config=rc, model_config=model_config or {}, gpus_per_node=1, name_suffix=suffix)
    await replica.init_local(getattr(RolloutMode, mode))
    return replica, rc


async def _tokens(server, prompt=PROMPT):
    return (await server.generate.remote(prompt, dict(REQ), uuid.uuid4().hex)).token_ids


def _scrape(host: str, port: int) -> dict:
    """GET /metrics (a real HTTP request) parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = (fam.type, s.value)
    return out


def _trace_ops(path: str) -> set:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e.get("name", "") for e in events if e.get("ph") == "X"}


# ---------------------------------------------------------------------------- one rank
@needs_verl
async def test_hybrid_and_colocated_sleep_levels_profile_and_metrics(ray_cluster, tmp_path):
    """HYBRID: verl's sleep() drops the weights (level 2), turns are refused until verl's sequence
    resume(["weights"]) -> full sync -> resume(["kv_cache"]) restores the outputs; release_kv_cache
    frees the KV pool around a sync. COLOCATED: level 1, weights stay, wake_up restores. The same
    replica writes a torch.profiler trace and serves /metrics with http off."""
    from verl.workers.rollout.base import get_rollout_class

    names = _trainer_weights(TINY)
    # both replicas launched together (a launch is ~5 s of the server process's imports on 2 cores)
    (replica, rc), (coloc, _) = await asyncio.gather(
        _launch("hyb", metrics_port=0, profile_dir=str(tmp_path / "prof")), _launch("coloc", mode="COLOCATED"))
    server = replica.server_handle
    try:
        adapter = get_rollout_class("ainfer_pd", "async")(config=rc, model_config={}, device_mesh=None,
                                                           replica_rank=0, server_handle=server)
        await server.start_profile.remote(profile_step=3)
        base = await _tokens(server)                              # the outputs before any sleep
        (trace,) = await server.stop_profile.remote()
        assert os.path.basename(trace) == "ainfer_pd_rank0_step3.pt.trace.json" and os.path.getsize(trace) > 0
        ops = _trace_ops(trace)
        assert {"aten::mm", "aten::softmax"} & ops or any(o.startswith("aten::") for o in ops), sorted(ops)[:20]
        assert any(o in ops for o in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"))

        host, port = await server.get_metrics_address.remote()
        assert (await server.get_server_address.remote())[1] == 0            # the generation API stays off
        r0, rep = (("rank", "0"),), (("replica", "0"),)
        long = server.generate.remote([31, 32, 33, 34] * 10, {**GREEDY, "max_tokens": 400, "ignore_eos": True}, "l")
        for _ in range(200):                                      # scrape while a turn decodes
            m = await asyncio.to_thread(_scrape, host, port)
            if m[("ainfer_pd_queue_decoding", r0)][1] == 1.0:
                break
            await asyncio.sleep(0.02)
        assert m[("ainfer_pd_queue_decoding", r0)] == ("gauge", 1.0) and m[("ainfer_pd_queue_waiting", r0)][1] == 0
        assert m[("ainfer_pd_server_inflight_requests", rep)][1] == 1.0
        used, free = m[("ainfer_pd_kv_used_blocks", r0)][1], m[("ainfer_pd_kv_free_blocks", r0)][1]
        assert used + free == m[("ainfer_pd_kv_total_blocks", r0)][1] == 4096 and used >= 3   # 40 prompt tokens
        assert len((await long).token_ids) == 400
        m = await asyncio.to_thread(_scrape, host, port)
        assert m[("ainfer_pd_server_turns_total", rep)] == ("counter", 2.0)
        assert m[("ainfer_pd_server_output_tokens_total", rep)][1] == 408.0
        assert m[("ainfer_pd_finished_total", r0)] == ("counter", 2.0)
        assert m[("ainfer_pd_queue_decoding", r0)][1] == 0 and m[("ainfer_pd_rendezvous_total", r0)][1] == 0

        await replica.sleep()                                     # verl: level 2 in hybrid mode
        assert (await server.metrics.remote())["server"]["sleeps_level2"] == 1
        with pytest.raises(Exception, match="asleep"):
            await _tokens(server)
        await adapter.resume(tags=["weights"])
        with pytest.raises(Exception, match="asleep"):             # dropped weights: values not back yet
            await _tokens(server)
        await adapter.update_weights(iter(names), global_steps=1)
        await adapter.resume(tags=["kv_cache"])
        assert await _tokens(server) == base

        await replica.release_kv_cache()                          # checkpoint engine: pool freed for the sync
        with pytest.raises(Exception, match="asleep"):
            await _tokens(server)
        await replica.resume_kv_cache()
        assert await _tokens(server) == base
    finally:
        await kill(replica)

    replica = coloc
    server = replica.server_handle
    try:
        assert await _tokens(server) == base
        await replica.sleep()
        assert (await server.metrics.remote())["server"]["sleeps_level1"] == 1
        with pytest.raises(Exception, match="asleep"):
            await _tokens(server)
        await replica.wake_up()                                   # no sync: the weights never left
        assert await _tokens(server) == base
    finally:
        await kill(replica)


# ---------------------------------------------------------------------------- two ranks
def _small_tokenizer():
    """A word-level tokenizer inside the tiny Hugging Face model's 256-token vocabulary."""
    return _tokenizer(200)


@needs_verl
async def test_two_rank_replica_serves_agent_loop_syncs_profiles_and_fails_typed_when_a_rank_dies(ray_cluster, tmp_path,
                                                                                    hf_model_dir):
    """A 2-rank (ADP2 / EP2) replica of verl's actor_rollout_ref.model (a Hugging Face directory)
    through verl's replica class: rank 1 is a real gloo process; greedy outputs equal transformers'
    own forward, before and after a weight sync of the trainer's named_parameters() (each rank
    keeps its own experts of it) and after verl's hybrid sleep / weights / sync / KV sequence; the
    ainfer_pd_tool_agent loop runs a 3-turn episode with KV reuse; profile and metrics cover both ranks."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from tests import _hf_models
    path = hf_model_dir("qwen3_moe")
    ref = _hf_models.make("qwen3_moe", seed=0)
    base = _hf_models.hf_greedy(ref, PROMPT, 8)[0]
    original = [(n, p.detach().clone()) for n, p in ref.named_parameters()]
    _hf_models.randomize(ref, seed=77)
    expected = _hf_models.hf_greedy(ref, PROMPT, 8)[0]
    assert expected != base
    model_config = HFModelConfig(path=str(path), load_tokenizer=False)
    replica, rc = await _launch("two", model_config=model_config, config=TWO, metrics_port=0,
                                profile_dir=str(tmp_path / "prof"), overrides={"cache.num_blocks": 256})
    server = replica.server_handle
    # verl's router to it (a Ray actor: it starts while the checks below run, ~5 s on 2 cores)
    router = get_router_handle(servers={replica.server_address: server})
    try:
        wc = await server.get_worker_config.remote()
        assert wc["parallel"]["world_size"] == 2 and wc["model"]["architecture"] == "qwen3_moe"
        pids = await server.get_rank_pids.remote()
        assert list(pids) == [1] and pids[1] != os.getpid()
        await server.start_profile.remote()
        assert await _tokens(server) == base
        traces = await server.stop_profile.remote()
        assert [os.path.basename(t).split("_")[2] for t in traces] == ["rank0", "rank1"]
        assert all(any(o.startswith("aten::") for o in _trace_ops(t)) for t in traces)
        host, port = await server.get_metrics_address.remote()
        m = await asyncio.to_thread(_scrape, host, port)
        assert m[("ainfer_pd_server_replica_ranks", (("replica", "0"),))][1] == 2.0
        for r in ("0", "1"):                                      # both ranks stepped in lockstep
            assert m[("ainfer_pd_step_rendezvous_total", (("rank", r),))][1] > 0
            assert m[("ainfer_pd_num_epochs_total", (("rank", r),))][1] >= 1
            assert ("ainfer_pd_rendezvous_total", (("rank", r),)) in m

        # the agent loop (verl's LLMServerClient + router) against the 2-rank replica
        tool = _register_test_parts()
        rc.multi_turn.format = "ainfer_pd_test"
        rc.multi_turn.max_assistant_turns = 3
        rc.multi_turn.max_tool_response_length = 256
        cfg = trainer_config(rc)
        client = LLMServerClient(cfg, load_balancer_handle=router)
        loop = hydra.utils.instantiate(
            _agent_loop_registry["ainfer_pd_tool_agent"], trainer_config=DictConfigWrap(cfg), server_manager=client,
            tokenizer=_small_tokenizer(), processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([tool]))
        out = await loop.run({**GREEDY, "max_tokens": 6},
                             raw_prompt=[{"role": "user", "content": "t20 t21 t22 t23 t24 t25 t26 t27 t28"}])
        cached = loop.episode.cached_tokens
        assert len(cached) == 3 and cached[0] == 0 and all(c > 0 for c in cached[1:]), cached

        adapter = get_rollout_class("ainfer_pd", "async")(config=rc, model_config=model_config, device_mesh=None,
                                                           replica_rank=0, server_handle=server)
        adapter.bucket_bytes = 32 << 10
        await adapter.update_weights(iter([(n, p.detach().clone()) for n, p in ref.named_parameters()]),
                                     global_steps=5)
        assert await _tokens(server) == expected                   # both ranks' experts were synced
        # verl's hybrid sequence on both ranks: sleep (level 2, weights dropped), weights, sync, KV
        await replica.sleep()
        with pytest.raises(Exception, match="asleep"):
            await _tokens(server)
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(iter(original), global_steps=6)
        await adapter.resume(tags=["kv_cache"])
        assert await _tokens(server) == base

        # a rank that dies: the turn in flight and every later request get a typed error naming it, at once
        long = server.generate.remote([31, 32, 33, 34], {**GREEDY, "max_tokens": 3000, "ignore_eos": True}, "long")
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)                            # the follower this test's replica started
        with pytest.raises(Exception, match=r"RankFailedError.*replica rank 1 of 2 died \(signal 9\)"):
            await long
        with pytest.raises(Exception, match=r"RankFailedError.*replica rank 1"):
            await _tokens(server)
        assert time.monotonic() - t0 < 8.0                          # noticed at once, not at a timeout
    finally:
        t0 = time.monotonic()
        await kill(replica)
        assert time.monotonic() - t0 < 30.0                         # and the replica still shuts down


# ---------------------------------------------------------------------------- the endpoint alone
async def test_metrics_endpoint_serves_get_metrics_only_and_survives_a_failing_collect():
    from prometheus_client.parser import text_string_to_metric_families

    from ainfer_pd.metrics.prometheus import MetricsEndpoint, render, worker_families
    fail = {"now": False}

    async def collect():
        if fail["now"]:
            raise RuntimeError("boom")
        return render(worker_families({"finished": 3, "kv_free_blocks": 10, "kv_total_blocks": 16, "policy": "x",
                                       "ttft_s_samples": [0.1], "busy_fraction": 0.5, "step_sync_s_count": 7},
                                      rank=1, waiting=2, decoding=4))
    ep = MetricsEndpoint(collect)
    port = await ep.start()

    async def get(request: bytes) -> tuple[str, str]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(request)
        await w.drain()
        data = await r.read()
        w.close()
        head, _, body = data.decode().partition("\r\n\r\n")
        return head.split("\r\n")[0], body
    try:
        status, body = await get(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == "HTTP/1.1 200 OK"
        got = {(s.name, s.labels["rank"]): (f.type, s.value)
               for f in text_string_to_metric_families(body) for s in f.samples}
        assert got[("ainfer_pd_finished_total", "1")] == ("counter", 3.0)
        assert got[("ainfer_pd_kv_used_blocks", "1")] == ("gauge", 6.0)
        assert got[("ainfer_pd_queue_waiting", "1")][1] == 2.0 and got[("ainfer_pd_queue_decoding", "1")][1] == 4.0
        assert got[("ainfer_pd_step_rendezvous_total", "1")][1] == 7.0 and got[("ainfer_pd_rendezvous_total", "1")][1] == 0
        assert not any("policy" in n or "samples" in n for n, _ in got)       # strings and lists are not metrics
        assert (await get(b"GET /other HTTP/1.1\r\n\r\n"))[0].startswith("HTTP/1.1 404")
        assert (await get(b"POST /metrics HTTP/1.1\r\n\r\n"))[0].startswith("HTTP/1.1 405")
        fail["now"] = True
        assert (await get(b"GET /metrics HTTP/1.1\r\n\r\n"))[0].startswith("HTTP/1.1 500")
        fail["now"] = False
        assert (await get(b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == "HTTP/1.1 200 OK"
        assert ep.scrapes == 2
    finally:
        await ep.close()
