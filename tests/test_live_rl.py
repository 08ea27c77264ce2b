"""Live-RL example (issue 6 item 2): differentiable forward == inference forward, 3 GRPO steps
against a running worker with weight sync, and the entry point's outputs; the GPU path's pieces on
CPU: device choice, a bf16 worker fed by float32 master weights (in-place, converting sync)."""
import asyncio
import json
import math
import random
import time

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.engine.model.weights import apply_named_tensors
from ainfer_pd.hf.export import state_dict
from ainfer_pd.errors import BackendUnavailableError, ConfigError, WeightUpdateError
from trainer_examples.live_rl.env import EnvConfig, Episode, Task, ToolEnv
from trainer_examples.live_rl.grpo import group_advantages, pack
from trainer_examples.live_rl.placement import (
    LiveRLConfigError,
    parse_overrides,
    resolve_device,
    worker_config,
)
from trainer_examples.live_rl.run import ROOT, PolicyRun, main, parse_args
from trainer_examples.live_rl.train_forward import (
    forward_logits,
    inference_logits,
    make_trainable,
    token_logprobs,
)

from .conftest import tiny_cfg

SMALL = ["--steps", "3", "--prompts", "2", "--group", "4", "--action-tokens", "4",
         "--max-turns", "3", "--prompt-filler", "4", "16", "--obs-filler", "1", "4",
         "--tool-latency-ms", "1", "5", "--lr", "3e-3"]


def test_train_forward_matches_inference_forward():
    model = build_model(tiny_cfg().model)
    rng = random.Random(0)
    seqs = [[rng.randrange(2, 512) for _ in range(n)] for n in (37, 20, 5)]
    L = max(map(len, seqs))
    tok = torch.zeros(len(seqs), L, dtype=torch.int64)            # right padded batch
    for i, s in enumerate(seqs):
        tok[i, :len(s)] = torch.tensor(s)
    train = make_trainable(model)
    got = forward_logits(train, tok)
    for i, s in enumerate(seqs):
        ref = inference_logits(model, s)                          # engine forward_batch, paged KV
        assert torch.allclose(got[i, :len(s)], ref, atol=1e-4, rtol=1e-4), (got[i, :len(s)] - ref).abs().max()
    # and it is differentiable down to the router and the routed experts
    token_logprobs(train, tok).sum().backward()
    lyr = train.model.layers[0]
    for p in (lyr.mlp.gate.weight, lyr.mlp.experts.gate_up_proj, lyr.mlp.experts.down_proj, lyr.self_attn.q_proj.weight,
              lyr.self_attn.q_norm.weight, train.model.embed_tokens.weight, train.lm_head.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert type(train).__name__ == "Qwen3MoeForCausalLM"          # the trainer is transformers' own model


def test_env_reward_is_verifiable():
    env = ToolEnv(EnvConfig())
    task = Task(prompt_id=0, key=70, num_turns=2, prompt_ids=[2, 3, 70])
    r0 = env.call_tool(task, 0, [100, 65, 300])                    # lookup(65)
    assert r0 == env.table[65]
    ep = Episode(task=task, actions=[[65, 300], [r0, 66]], results=[r0, 0])
    env.score(ep)
    assert ep.format_score == 0.75 and ep.hit_score == 1.0 and ep.reward == 0.875
    assert [round(a, 4) for a in group_advantages([1.0, 0.0, 0.5, 0.5], 2)] == [1.0, -1.0, 0.0, 0.0]


async def test_three_grpo_steps_sync_weights_into_the_worker():
    args = parse_args(SMALL + ["--policy", "fine-grained"])
    async with PolicyRun("fine-grained", args) as run:
        initial = {n: p.detach().clone() for n, p in run.worker.model.named_parameters()}
        for step in range(3):
            rec = await run.step(step)
            # the worker now holds exactly the trainer's weights (synced in transformers' names)
            held = state_dict(run.worker.model, "transformers")
            for n, p in run.trainable.named_parameters():
                assert torch.equal(p.detach(), held[n]), n
            assert any(n.endswith("mlp.experts.gate_up_proj") for n in run.worker.last_weight_sync.applied)
            # the rollout logprobs (continuation prefill + decode, paged KV) are the trainer's
            # differentiable forward on the same tokens and weights: the sync is exact
            assert rec["logprob_mismatch_max"] < 1e-3
            assert rec["rollout_s"] > 0 and rec["tokens_generated"] > 0
            assert 0.0 <= rec["reward_mean"] <= 1.0 and math.isfinite(rec["loss"])
            assert rec["cached_tokens"] > 0                     # continue_ reused the trajectory's KV
        changed = [n for n, p in run.worker.model.named_parameters() if not torch.equal(p, initial[n])]
        assert len(changed) == len(initial)                     # Adam moved every parameter
        res = run.result()
        assert res["kv_leak_free"] and res["worker"]["failures"] == 0
        assert len(res["steps"]) == 3 and res["cum_rollout_s"] > 0


def test_pack_aligns_actions_with_their_logprobs():
    ep = Episode(task=Task(0, 64, 1, [2, 3]), tokens=[2, 3, 10, 11, 4], action_mask=[False, False, True, True, False],
                 old_logprobs=[0.0, 0.0, -1.0, -2.0, 0.0])
    _, mask, old = pack([ep])
    assert mask[0].tolist() == [False, True, True, False]       # position t scores token t+1
    assert old[0, mask[0]].tolist() == [-1.0, -2.0]


def test_entry_point_writes_json_and_plot(tmp_path):
    out = tmp_path / "run"
    assert main(SMALL[:1] + ["1"] + SMALL[2:] + ["--policy", "both", "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "live_rl.json").read_text())
    assert set(doc["results"]) == {"normal", "fine-grained"}
    assert doc["summary"]["fine_over_normal"] > 0
    assert doc["summary"]["same_rewards_both_policies"] is True  # same seeds -> same rollouts under both policies
    assert (out / "live_rl.png").stat().st_size > 0


BF16 = torch.bfloat16


def _padded(seqs: list[list[int]]) -> torch.Tensor:
    tok = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tok[i, :len(s)] = torch.tensor(s)
    return tok


def test_bf16_compute_over_fp32_masters_matches_the_bf16_engine():
    model = build_model(tiny_cfg(**{"model.dtype": "bfloat16"}).model)
    masters = make_trainable(model)                               # float32 copy of the bf16 weights
    emb = masters.model.embed_tokens.weight
    assert emb.dtype == torch.float32 and torch.equal(emb.to(BF16), model.embed)
    rng = random.Random(1)
    seqs = [[rng.randrange(2, 512) for _ in range(n)] for n in (37, 20, 5)]
    tok = _padded(seqs)
    got = forward_logits(masters, tok, BF16)                      # transformers' forward over bf16 casts
    for i, s in enumerate(seqs):                                  # close to the engine's bf16 forward
        assert (got[i, :len(s)] - inference_logits(model, s)).abs().max() <= 0.1
    token_logprobs(masters, tok, BF16).sum().backward()           # grads reach the float32 masters
    for p in (masters.model.layers[0].mlp.experts.gate_up_proj, masters.model.layers[0].mlp.gate.weight,
              masters.lm_head.weight):
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0


async def test_update_weights_converts_fp32_into_a_bf16_worker_in_place():
    async with RolloutWorker(tiny_cfg(**{"model.dtype": "bfloat16"})) as w:
        params = dict(w.model.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in params.items()}
        g = torch.Generator().manual_seed(0)
        new = {n: p.float() + 1e-3 * torch.randn(p.shape, generator=g) for n, p in params.items()}
        assert await w.update_weights(new.items()) == len(params)
        for n, p in w.model.named_parameters():                   # rounded to bf16, same storage
            assert p.dtype == BF16 and p.data_ptr() == ptrs[n] and torch.equal(p, new[n].to(BF16)), n
        before = {n: p.clone() for n, p in params.items()}
        with pytest.raises(WeightUpdateError, match="shape"):
            await w.update_weights([("embed", new["embed"] + 1), ("lm_head", new["lm_head"][:, :-1])])
        with pytest.raises(WeightUpdateError, match="unknown"):
            await w.update_weights([("embed", new["embed"] + 1), ("no.such.weight", new["embed"])])
        with pytest.raises(WeightUpdateError, match="dtype"):
            await w.update_weights([("embed", new["embed"].long())])
        assert all(torch.equal(p, before[n]) for n, p in w.model.named_parameters())   # all-or-nothing
        out = await w.generate([2, 3, 70, 100, 200], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(out.token_ids) == 4
        await w.release(out.trajectory_id)
    half = torch.nn.Linear(2, 2).half()                           # float32 -> float16 would overflow to inf
    with pytest.raises(WeightUpdateError, match="beyond"):
        apply_named_tensors(half, [("weight", torch.full((2, 2), 1e6))])


def test_device_choice_and_config_overrides():
    assert resolve_device(None, "cpu", cuda_available=True) == "cpu"
    assert resolve_device(None, "auto", cuda_available=False) == "cpu"
    assert resolve_device(None, "auto", cuda_available=True) == "cuda"
    assert resolve_device("cpu", "cuda", cuda_available=True) == "cpu"
    assert resolve_device("cuda", "cpu", cuda_available=True) == "cuda"
    with pytest.raises(BackendUnavailableError):
        resolve_device(None, "cuda", cuda_available=False)
    with pytest.raises(LiveRLConfigError):
        resolve_device("tpu", "cpu")
    assert parse_overrides(["model.dtype=bfloat16", "cache.num_blocks=256"]) == \
        {"model.dtype": "bfloat16", "cache.num_blocks": 256}
    with pytest.raises(LiveRLConfigError):
        parse_overrides(["model.dtype"])
    h200 = ROOT / "configs" / "live-rl-h200.yaml"
    cfg = worker_config(h200, "fine-grained", "cpu", {})          # the GPU config, simulated on CPU
    assert (cfg.device.device, cfg.model.dtype, cfg.scheduler.policy) == ("cpu", "bfloat16", "fine-grained")
    gpu = WorkerConfig.from_yaml(h200)
    assert gpu.device.device == "cuda" and gpu.device.cuda_graphs and gpu.model.dtype == "bfloat16"
    assert min(gpu.scheduler.max_decode_batch, max(gpu.device.graph_batch_sizes)) >= 8 * 8   # README: 8 x 8
    with pytest.raises(ConfigError):
        worker_config(h200, "normal", "cpu", {"model.no_such_key": 1})


async def _tick(lags: list[float]) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t)


async def test_bf16_worker_trains_fp32_masters_and_syncs_bf16():
    """The GPU path on CPU: bf16 worker, float32 masters, bf16 compute, bf16 tensors in place."""
    args = parse_args(SMALL + ["--policy", "normal", "--set", "model.dtype=bfloat16"])
    async with PolicyRun("normal", args) as run:
        assert (run.worker_dtype, run.compute_dtype) == (BF16, BF16)
        ptrs = {n: p.data_ptr() for n, p in run.worker.model.named_parameters()}
        init = {n: p.detach().clone() for n, p in run.trainable.named_parameters()}
        for step in range(2):
            lags: list[float] = []
            ticker = asyncio.create_task(_tick(lags))
            rec = await run.step(step)
            ticker.cancel()
            assert max(lags) < 0.5 * rec["train_s"]               # the update ran off the event loop
            held = state_dict(run.worker.model, "transformers")
            for n, p in run.trainable.named_parameters():
                assert p.dtype == torch.float32 and held[n].dtype == BF16, n
                assert torch.equal(p.detach().to(BF16), held[n]), n
            assert all(q.data_ptr() == ptrs[n] for n, q in run.worker.model.named_parameters())   # in place
            assert rec["logprob_mismatch_mean"] < 0.05 and rec["cached_tokens"] > 0
        assert all(not torch.equal(p, init[n]) for n, p in run.trainable.named_parameters())
        res = run.result()
        assert res["kv_leak_free"] and res["worker"]["failures"] == 0
        assert res["train_compute_dtype"] == "torch.bfloat16" and res["decode_graphs"] is None
