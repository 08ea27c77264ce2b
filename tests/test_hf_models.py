"""Hugging Face checkpoints: for each architecture (and a tied-embedding Qwen3-MoE), the worker's
greedy multi-turn rollout over its sharded checkpoint equals transformers' own forward recomputed
over the whole context, under normal and fine-grained, with the earlier turns' KV reused."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from tests import _hf_models
from tests.conftest import hf_worker_cfg

MODELS = _hf_models.ARCHS + ("qwen3_moe_tied",)
LOGPROB_TOL = 2e-3


def _plans(seed: int) -> list[list[tuple[list[int], int]]]:
    """Per trajectory: [(prompt, n), (observation, n), (observation, n)]."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(2, _hf_models.VOCAB) for _ in range(n)]
    return [[(ids(rng.randrange(5, 40)), rng.randrange(4, 8))] + [(ids(rng.randrange(2, 10)), rng.randrange(3, 7))
                                                                 for _ in range(2)]
            for _ in range(3)]


_REFERENCE: dict = {}


def _reference(name: str, path, plans) -> list[list[tuple[list[int], list[float]]]]:
    """transformers' greedy tokens and logprobs of every turn (full recompute), once per model."""
    if name not in _REFERENCE:
        from transformers import AutoModelForCausalLM
        import torch
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out = []
        for plan in plans:
            ctx, turns = [], []
            for ids, n in plan:
                ctx = ctx + ids
                toks, lps = _hf_models.hf_greedy(model, ctx, n)
                turns.append((toks, lps))
                ctx = ctx + toks
            out.append(turns)
        _REFERENCE[name] = out
    return _REFERENCE[name]


async def _rollout(worker: RolloutWorker, plan) -> list:
    """generate -> continue_ -> continue_ (greedy), returning (tokens, logprobs, cached, context)."""
    turns, ctx = [], []
    (prompt, n), rest = plan[0], plan[1:]
    o = await worker.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
    ctx = prompt + o.token_ids
    turns.append((o.token_ids, o.logprobs, o.num_cached_tokens, len(prompt)))
    for obs, n in rest:
        await asyncio.sleep(0.002)
        prev = len(ctx)
        o = await worker.continue_(o.trajectory_id, obs, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        turns.append((o.token_ids, o.logprobs, o.num_cached_tokens, prev))
        ctx = ctx + obs + o.token_ids
    await worker.release(o.trajectory_id)
    return turns


@pytest.mark.parametrize("policy", ["normal", "fine-grained"])
@pytest.mark.parametrize("name", MODELS)
async def test_multi_turn_greedy_rollout_equals_transformers_full_recompute(name, policy, hf_model_dir):
    path = hf_model_dir(name)
    plans = _plans(seed=len(name))
    ref = _reference(name, path, plans)
    cfg = hf_worker_cfg(path, policy)
    assert cfg.model.architecture == name.removesuffix("_tied")
    async with RolloutWorker(cfg) as w:
        report = w.model.load_report
        assert not report.random_init and len(report.files) > 1          # a sharded checkpoint, read lazily
        async with asyncio.TaskGroup() as tg:                           # several trajectories in flight
            jobs = [tg.create_task(_rollout(w, p)) for p in plans]
        assert w.kv_leak_free()
        epochs = w.metrics()["num_epochs"]
    for job, want in zip(jobs, ref):
        got = job.result()
        for t, ((toks, lps, cached, prev_len), (ref_toks, ref_lps)) in enumerate(zip(got, want)):
            assert toks == ref_toks, (name, policy, t)
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL, (name, t, lps, ref_lps)
            # turn 0 computes everything; later turns reuse every earlier token's KV except the last
            # sampled token (it had no KV yet)
            assert cached == (0 if t == 0 else prev_len - 1), (t, cached, prev_len)
    assert epochs >= 3


def test_config_json_sets_the_architecture_features(hf_model_dir):
    q2 = WorkerConfig.from_pretrained(hf_model_dir("qwen2_moe")).model
    assert (q2.qkv_bias, q2.qk_norm, q2.shared_expert_intermediate, q2.shared_expert_gate, q2.norm_topk_prob) \
        == (True, False, 48, True, False)
    glm = WorkerConfig.from_pretrained(hf_model_dir("glm4_moe")).model
    assert (glm.router, glm.num_expert_groups, glm.topk_groups, glm.routed_scaling_factor, glm.dense_layers,
            glm.rotary_dim, glm.qk_norm, glm.qkv_bias, glm.o_bias, glm.shared_expert_intermediate) \
        == ("sigmoid", 4, 2, 2.5, (0,), 8, True, True, False, 32)
    tied = WorkerConfig.from_pretrained(hf_model_dir("qwen3_moe_tied")).model
    assert tied.tie_word_embeddings and tied.dense_layers == (0, 2) and tied.o_bias
    q3 = WorkerConfig.from_pretrained(hf_model_dir("qwen3_moe"), {"model": {"max_context_len": 1024}}).model
    assert q3.dense_layers == (1,) and q3.max_context_len == 1024 and q3.dtype == "float32"
    mx = WorkerConfig.from_pretrained(hf_model_dir("mixtral")).model
    assert (mx.num_experts, mx.expert_intermediate, mx.rope_theta, mx.qk_norm) == (8, 32, 1e6, False)


def test_yaml_model_path_takes_config_json_and_its_overrides(hf_model_dir, tmp_path):
    y = tmp_path / "w.yaml"
    y.write_text(f"model:\n  path: {hf_model_dir('qwen3_moe')}\n  dtype: bfloat16\ndevice:\n  device: cpu\n")
    cfg = WorkerConfig.from_yaml(y)
    assert cfg.model.architecture == "qwen3_moe" and cfg.model.dtype == "bfloat16" and cfg.model.hidden_size == 64
    assert WorkerConfig.from_dict(cfg.to_dict()) == cfg


def test_cli_replay_and_bench_run_a_hugging_face_directory(hf_model_dir, capsys):
    from ainfer_pd.tools import cli
    d = str(hf_model_dir("qwen2_moe"))
    small = ["--conversations", "2", "--max-turns", "2", "--token-scale", "0.02", "--time-scale", "0.001",
             "--no-progress", "--priorities", "fifo", "--model", d]
    assert cli.main(["replay", *small]) == 0
    out = capsys.readouterr()
    assert "normal" in out.out and "fine-grained" in out.out and "qwen2_moe" in out.err
    assert cli.main(["bench", "--policies", "normal,global-enqueue", "--cells", "P1", "--repeats", "1", *small]) == 0
    assert "global-enqueue" in capsys.readouterr().out
    assert cli.main(["replay", "--model", str(hf_model_dir("qwen3_moe")) + "-nope", "--no-progress"]) == 2


@pytest.mark.parametrize("name", MODELS)
def test_export_round_trips_config_and_weights_through_transformers(name, hf_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from ainfer_pd.engine.model.model import build_model
    from ainfer_pd.hf.config import fields_from_hf
    from ainfer_pd.hf.export import config_json, save_pretrained, state_dict, transformers_config
    c = WorkerConfig.from_pretrained(hf_model_dir(name)).model
    assert {k: v for k, v in fields_from_hf(config_json(c)).items() if getattr(c, k) != v} == {}
    model = build_model(c)
    hf = AutoModelForCausalLM.from_config(transformers_config(c))
    hf.load_state_dict(state_dict(model, "transformers"), strict=not c.tie_word_embeddings)  # every name, every shape
    out = save_pretrained(model, tmp_path / "export", max_shard_bytes=50_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    x = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_model_dir(name)).eval()(x).logits
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(out).eval()(x).logits, want, atol=1e-5, rtol=1e-5)
        assert torch.allclose(hf.eval()(x).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["glm4_moe", "qwen2_moe"])
async def test_triton_kernels_serve_the_architectures_like_transformers(name, hf_model_dir):
    """The Triton backends (CPU interpreter here): partial RoPE, QK-norm, biases, the sigmoid and
    shared-expert paths through the fused prologue and the fused MoE give transformers' tokens."""
    path = hf_model_dir(name)
    plan = _plans(seed=len(name))[0][:2]
    ref = _reference(name, path, _plans(seed=len(name)))[0]
    cfg = hf_worker_cfg(path, "fine-grained", device={"attention_backend": "triton", "moe_backend": "triton"})
    async with RolloutWorker(cfg) as w:
        got = await _rollout(w, plan)
    for (toks, lps, _, _), (ref_toks, ref_lps) in zip(got, ref):
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < LOGPROB_TOL
