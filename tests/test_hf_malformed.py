"""Issue 34, items 14 and 15: malformed Hugging Face directories raise typed errors naming the
cause (every config.json value the loader reads is checked with its type; the index's
weight_map too), and an index entry outside the model directory is refused before any file is
opened."""
from __future__ import annotations

import builtins
import io
import json
import os
import shutil

import pytest
import safetensors

from ainfer_pd import RolloutWorker, WorkerConfig
from ainfer_pd.errors import AInferPDError, CheckpointError, ConfigError
from ainfer_pd.hf import checkpoint as ckpt
from ainfer_pd.hf.config import fields_from_hf
from ainfer_pd.hf.export import config_json
from tests.conftest import hf_worker_cfg, tiny_cfg


def _config_dir(d, **changes):
    d.mkdir()
    cj = config_json(tiny_cfg().model)
    cj.pop("rope_parameters")
    cj["rope_theta"] = 10000.0
    cj["mlp_only_layers"] = [1]
    cj.update(changes)                 # a None value is written as null
    (d / "config.json").write_text(json.dumps(cj))
    return d


# the cases, then one of every other kind the loader reads
CONFIG_CASES = [
    ({"rms_norm_eps": "x"}, "rms_norm_eps='x'"),
    ({"rms_norm_eps": None}, "rms_norm_eps=null"),
    ({"max_position_embeddings": None}, "max_position_embeddings=null"),
    ({"rope_theta": None}, "rope_theta=null"),
    ({"mlp_only_layers": 5}, "mlp_only_layers=5"),
    ({"intermediate_size": "a"}, "intermediate_size='a'"),
    ({"hidden_size": 128.0}, "hidden_size=128.0"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads='2'"),
    ({"head_dim": [32]}, r"head_dim=\[32\]"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes'"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1"),
    ({"decoder_sparse_step": "1"}, "decoder_sparse_step='1'"),
    ({"mlp_only_layers": [1, "2"]}, "mlp_only_layers"),
    ({"num_experts": None, "num_local_experts": "8"}, "num_local_experts='8'"),
    ({"layer_types": "full_attention"}, "layer_types"),
    ({"hidden_act": None}, "hidden_act=null"),
    ({"hidden_act": 3}, "hidden_act=3"),
    ({"attention_bias": "false"}, "attention_bias='false'"),
    ({"rope_theta": float("inf")}, "rope_theta=inf"),
    ({"dtype": 16}, "dtype=16"),
    ({"eos_token_id": "1"}, "eos_token_id='1'"),
    ({"architectures": "Qwen3MoeForCausalLM"}, "architectures"),
    ({"model_type": ["qwen3_moe"]}, "model_type"),
    ({"quantization_config": "fp8"}, "quantization_config"),
    ({"num_hidden_layers": None}, "num_hidden_layers=null"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta=null"),
]


@pytest.mark.parametrize("changes,match", CONFIG_CASES, ids=[m for _, m in CONFIG_CASES])
def test_every_config_json_value_the_loader_reads_is_type_checked(tmp_path, changes, match):
    d = _config_dir(tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=match) as ei:
        WorkerConfig.from_pretrained(d)
    assert isinstance(ei.value, AInferPDError)


def test_nulls_that_mean_none_are_still_accepted(tmp_path):
    """transformers writes null for "none" in these keys: they keep their defaults."""
    d = _config_dir(tmp_path / "m", head_dim=None, sliding_window=None, rope_scaling=None, layer_types=None,
                    use_sliding_window=None, eos_token_id=None)
    m = WorkerConfig.from_pretrained(d).model
    assert m.head_dim == 128 // 4 and m.eos_token_id is None and m.dense_layers == (1,)


# ---------------------------------------------------------------------- the index (item 14)
def _sharded(hf_model_dir, dst):
    shutil.copytree(hf_model_dir("qwen3_moe"), dst)
    return dst


def _index(d, weight_map):
    p = d / ckpt.INDEX
    data = json.loads(p.read_text())
    data["weight_map"] = weight_map(data["weight_map"]) if callable(weight_map) else weight_map
    p.write_text(json.dumps(data))


@pytest.mark.parametrize("case,match", [
    ("list", "weight_map must be an object"),
    ("value-5", r"weight_map\[.*\]=5"),
    ("value-null", r"weight_map\[.*\]=None"),
    ("no-map", "no weight_map"),
    ("not-json", "not readable JSON"),
])
def test_a_malformed_index_is_a_typed_error_naming_the_cause(hf_model_dir, tmp_path, case, match):
    d = _sharded(hf_model_dir, tmp_path / "m")
    first = lambda wm: {**wm, next(iter(wm)): None}      # noqa: E731
    if case == "list":
        _index(d, lambda wm: sorted(wm.items()))
    elif case == "value-5":
        _index(d, lambda wm: {**wm, next(iter(wm)): 5})
    elif case == "value-null":
        _index(d, first)
    elif case == "no-map":
        (d / ckpt.INDEX).write_text(json.dumps({"metadata": {}}))
    else:
        (d / ckpt.INDEX).write_text("{")
    with pytest.raises(CheckpointError, match=match):
        RolloutWorker(hf_worker_cfg(d))


# ---------------------------------------------------------------------- outside the directory (item 15)
@pytest.mark.parametrize("evil", ["../zz_escaped.safetensors", "{abs}", "sub/../../zz_escaped.safetensors",
                                  "..\\zz_escaped.safetensors", "sub/zz_escaped.safetensors"])
def test_an_index_entry_outside_the_model_directory_is_refused_before_anything_is_opened(
        hf_model_dir, tmp_path, monkeypatch, evil):
    d = _sharded(hf_model_dir, tmp_path / "m")
    outside = tmp_path / "zz_escaped.safetensors"
    shutil.copy(sorted(d.glob("model-*.safetensors"))[0], outside)     # a real shard: it would load
    entry = evil.format(abs=str(outside))
    _index(d, lambda wm: {**wm, next(iter(wm)): entry})
    touched = []
    real_open, real_safe_open, real_stat = builtins.open, safetensors.safe_open, os.stat

    def spy(fn):
        def wrapped(path, *a, **k):
            if str(path).endswith("zz_escaped.safetensors"):
                touched.append((fn.__name__, str(path)))
            return fn(path, *a, **k)
        return wrapped
    monkeypatch.setattr(builtins, "open", spy(real_open))
    monkeypatch.setattr(io, "open", spy(io.open))
    monkeypatch.setattr(safetensors, "safe_open", spy(real_safe_open))
    monkeypatch.setattr(os, "stat", spy(real_stat))
    with pytest.raises(CheckpointError, match="not a file of the model directory"):
        ckpt.weight_files(d)
    with pytest.raises(CheckpointError, match="not a file of the model directory"):
        RolloutWorker(hf_worker_cfg(d))
    assert touched == [], f"looked at a file outside the model directory: {touched}"


def test_the_checks_refuse_nothing_valid(hf_model_dir, tmp_path):
    d = _sharded(hf_model_dir, tmp_path / "m")
    files, wmap = ckpt.weight_files(d)
    assert len(files) > 1 and all(f.parent == d for f in files)
    RolloutWorker(hf_worker_cfg(d))
    cj = json.loads((d / "config.json").read_text())
    assert fields_from_hf(cj)["architecture"] == "qwen3_moe"
