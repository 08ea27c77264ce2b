"""Bad Hugging Face inputs: each a typed error naming the cause, before anything is served;
the checkpoint itself is never touched and still loads."""
import json
import logging
import shutil

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import AInferPDError, CheckpointError, ConfigError, UnsupportedModelError
from tests.conftest import hf_worker_cfg


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    if config_changes:
        p = dst / "config.json"
        cfg = json.loads(p.read_text())
        for k, v in config_changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        p.write_text(json.dumps(cfg))
    return dst


def _config_only(src, dst, **config_changes):
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return _copy(dst, dst.parent / (dst.name + "-x"), **config_changes) if config_changes else dst


@pytest.mark.parametrize("changes,error,match", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, UnsupportedModelError, "model_type 'llama'"),
    ({"architectures": ["Qwen3MoeForSequenceClassification"]}, UnsupportedModelError, "Qwen3MoeForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, UnsupportedModelError, "'yarn'"),
    ({"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     UnsupportedModelError, "rope_scaling type 'dynamic'"),
    ({"use_sliding_window": True, "sliding_window": 128}, UnsupportedModelError, "sliding"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
    ({"use_mup": True, "attn_logit_softcapping": 30.0}, UnsupportedModelError, "attn_logit_softcapping, use_mup"),
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModelError, "fp8"),
    ({"num_experts_per_tok": 9}, ConfigError, "top_k=9"),
])
def test_config_json_the_engine_cannot_compute_is_refused_by_name(hf_model_dir, tmp_path, changes, error, match):
    bad = _config_only(hf_model_dir("qwen3_moe"), tmp_path / "m", **changes)
    with pytest.raises(error, match=match):
        WorkerConfig.from_pretrained(bad)


def test_broken_checkpoints_are_typed_errors_naming_the_cause(hf_model_dir, tmp_path):
    src = hf_model_dir("qwen3_moe")
    # a shard listed in the index is gone
    gone = _copy(src, tmp_path / "missing-shard")
    shard = sorted(gone.glob("model-*.safetensors"))[2]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        RolloutWorker(hf_worker_cfg(gone))
    # config.json and the weights disagree on a shape
    wrong = _copy(src, tmp_path / "wrong-shape", moe_intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.\w+_proj\.weight.*shape \(\d+, \d+\).*implies"):
        RolloutWorker(hf_worker_cfg(wrong))
    # fewer layers than the weights: tensors with no place in the model
    short = _copy(src, tmp_path / "short", num_hidden_layers=2)
    with pytest.raises(CheckpointError, match=r"no place for.*model\.layers\.2\."):
        RolloutWorker(hf_worker_cfg(short))
    # pickle only: never unpickled
    pick = _config_only(src, tmp_path / "pickle")
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, pick / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        RolloutWorker(hf_worker_cfg(pick))
    # not a model directory at all
    with pytest.raises(CheckpointError, match="config.json not found"):
        WorkerConfig.from_pretrained(tmp_path)
    for exc in (CheckpointError, UnsupportedModelError):
        assert issubclass(exc, AInferPDError) and issubclass(exc, ConfigError)


async def test_config_only_directory_is_a_seeded_random_init_of_the_real_shapes(hf_model_dir, tmp_path, caplog):
    d = _config_only(hf_model_dir("glm4_moe"), tmp_path / "cfg-only")
    cfg = hf_worker_cfg(d)
    with caplog.at_level(logging.INFO, logger="ainfer_pd.hf"):
        a = build_model(cfg.model)
    assert "no weight files: seeded random init" in caplog.text
    assert a.load_report.random_init and not a.load_report.tensors_read
    assert a.layers[1].w13.shape == (8, 64, 64) and a.layers[0].dense_w13.shape == (64, 192)
    b = build_model(cfg.model)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))    # seeded
    async with RolloutWorker(cfg) as w:
        o = await w.generate([3, 4, 5], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(o.token_ids) == 3
        await w.release(o.trajectory_id)


async def test_the_checkpoint_still_serves_after_the_rejections(hf_model_dir):
    async with RolloutWorker(hf_worker_cfg(hf_model_dir("qwen3_moe"))) as w:
        o = await w.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(o.token_ids) == 4
        await w.release(o.trajectory_id)
