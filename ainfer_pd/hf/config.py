"""``config.json`` of a Hugging Face MoE model -> the fields of :class:`~ainfer_pd.config.ModelConfig`.

Pure functions over the parsed JSON. Every key of ``config.json`` is either used (it sets a
field), known not to change the inference math (training-only knobs, token ids other than EOS,
bookkeeping), or refused by name with :class:`~ainfer_pd.errors.UnsupportedModelError`: a key
this module does not know might change the math, so it is never silently ignored. Likewise
values the engine does not compute (``rope_scaling`` types, sliding windows, another activation)
are refused by name.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsupportedModelError
from .quant_config import quantization_of

log = logging.getLogger("ainfer_pd.hf")

CAUSAL_LM = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}

# Keys that never change the forward of a causal LM at inference (training knobs, ids other than
# EOS, generation defaults, bookkeeping of transformers' PretrainedConfig).
_INERT = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "initializer_range",
    "use_cache", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout",
    "bos_token_id", "pad_token_id", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "prune_heads", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "problem_type", "id2label",
    "label2id", "finetuning_task", "cross_attention_hidden_size", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "typical_p", "diversity_penalty", "num_beam_groups", "encoder_no_repeat_ngram_size",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "output_scores", "return_dict_in_generate", "tf_legacy_loss",
    "pruned_heads", "torch_dtype", "dtype",
}
# Keys every architecture reads.
_COMMON = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
    "rope_theta", "rope_scaling", "rope_parameters", "quantization_config",
}
_ARCH_KEYS = {
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                  "attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen2_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                  "mlp_only_layers", "qkv_bias", "use_sliding_window", "sliding_window", "max_window_layers",
                  "layer_types"},
    "mixtral": {"num_local_experts", "num_experts", "num_experts_per_tok", "intermediate_size", "sliding_window"},
    "glm4_moe": {"n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                 "norm_topk_prob", "routed_scaling_factor", "use_qk_norm", "attention_bias",
                 "partial_rotary_factor", "num_nextn_predict_layers"},
}
ROPE_TYPES = ("default",)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (typed errors for a missing or bad file)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model path {str(d)!r} is not a directory")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d.name}/config.json not found: a Hugging Face model directory needs it")
    return _read_json_object(d, "config.json")


def _read_json_object(d: Path, name: str) -> dict[str, Any]:
    """``d / name`` parsed, a JSON object (typed errors naming the file otherwise)."""
    try:
        data = json.loads((d / name).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{d.name}/{name} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{d.name}/{name}: top level must be an object")
    return data


def model_type_of(hf: dict[str, Any]) -> str:
    mt = hf.get("model_type")
    archs = hf.get("architectures")
    if archs is not None and (not isinstance(archs, list) or any(not isinstance(a, str) for a in archs)):
        raise CheckpointError(f"config.json architectures={archs!r}: expected a list of class names")
    if mt is None:                       # old configs name only the class
        by_class = {v: k for k, v in CAUSAL_LM.items()}
        mt = next((by_class[a] for a in archs or () if a in by_class), None)
    if mt is not None and not isinstance(mt, str):
        raise CheckpointError(f"config.json model_type={mt!r}: expected a string")
    if mt not in CAUSAL_LM:
        raise UnsupportedModelError(f"config.json model_type {mt!r} is not supported; supported: "
                                    f"{', '.join(CAUSAL_LM)}")
    if archs and CAUSAL_LM[mt] not in archs:
        raise UnsupportedModelError(f"config.json architectures {archs}: ainfer-pd serves {CAUSAL_LM[mt]} "
                                    f"(the causal LM head of {mt})")
    return mt


def model_fields(model_dir: str | Path) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the model in ``model_dir`` (``path`` included). The
    stop set is ``config.json``'s whole ``eos_token_id`` list plus ``generation_config.json``'s
    (issue 34, item 2: vLLM ends a turn on any of them; Qwen3 ships ``<|im_end|>`` and
    ``<|endoftext|>`` there)."""
    hf = read_config_json(model_dir)
    fields = fields_from_hf(hf)
    gen = read_generation_config(model_dir)
    if gen is not None:
        extra = [i for i in _eos_ids(gen, "generation_config.json") if i not in fields["stop_token_ids"]]
        fields["stop_token_ids"] = fields["stop_token_ids"] + tuple(extra)
        if fields["eos_token_id"] is None and fields["stop_token_ids"]:
            fields["eos_token_id"] = fields["stop_token_ids"][0]
    fields["path"] = str(model_dir)
    return fields


def read_generation_config(model_dir: str | Path) -> dict[str, Any] | None:
    """The parsed ``generation_config.json`` of a model directory, None when it has none (typed
    errors for an unreadable one)."""
    d = Path(model_dir)
    if not (d / "generation_config.json").is_file():
        return None
    return _read_json_object(d, "generation_config.json")


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a parsed ``config.json``."""
    mt = model_type_of(hf)
    unknown = sorted(k for k in hf if k not in _INERT | _COMMON | _ARCH_KEYS[mt] and not k.startswith("_"))
    if unknown:
        raise UnsupportedModelError(f"config.json ({mt}) has key(s) ainfer-pd does not know: {', '.join(unknown)}; "
                                    "they may change the model's math, so the model is refused")
    quantization = quantization_of(hf)         # blockwise fp8 or none; anything else refused by name
    act = _str(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json hidden_act={act!r}: only silu (SwiGLU) is supported")
    H = _int(hf, "num_attention_heads")
    D = _int(hf, "hidden_size")
    L = _int(hf, "num_hidden_layers")
    if H <= 0:
        raise CheckpointError(f"config.json num_attention_heads={H}: expected a positive integer")
    head_dim = _int(hf, "head_dim", D // H, nullable=True)
    theta, partial = _rope(hf, mt)
    eos = _eos_ids(hf, "config.json")
    f: dict[str, Any] = {
        "architecture": mt,
        "vocab_size": _int(hf, "vocab_size"),
        "hidden_size": D,
        "num_layers": L,
        "num_heads": H,
        "num_kv_heads": _int(hf, "num_key_value_heads", H, nullable=True),
        "head_dim": head_dim,
        "rms_eps": _float(hf, "rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "max_context_len": _int(hf, "max_position_embeddings", 4096),
        "tie_word_embeddings": _bool(hf, "tie_word_embeddings", False),
        "dtype": _dtype(hf),
        "quantization": quantization,
        "eos_token_id": eos[0] if eos else None,
        "stop_token_ids": tuple(eos),
    }
    f.update(_ARCH[mt](hf, L))
    return f


# ---------------------------------------------------------------------------- per architecture
def _qwen_moe_common(hf: dict[str, Any], L: int, mt: str) -> dict[str, Any]:
    if _bool(hf, "use_sliding_window", False, nullable=True):
        raise UnsupportedModelError(f"config.json use_sliding_window=true ({mt}): sliding-window attention "
                                    "is not supported")
    lt = _list(hf, "layer_types", str)
    if lt and any(t != "full_attention" for t in lt):
        raise UnsupportedModelError(f"config.json layer_types {sorted(set(lt))}: only full_attention is supported")
    E = _int(hf, "num_experts", _int(hf, "num_local_experts", 0, nullable=True), nullable=True)
    if E <= 0:
        raise UnsupportedModelError(f"config.json num_experts={E} ({mt}): a dense model; ainfer-pd serves MoE models")
    step = _int(hf, "decoder_sparse_step", 1, nullable=True) or 1
    mlp_only = set(_list(hf, "mlp_only_layers", int))
    inter = _int(hf, "intermediate_size", 0, nullable=True)
    dense = tuple(i for i in range(L) if i in mlp_only or (i + 1) % step != 0)
    return {
        "num_experts": E,
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": _int(hf, "moe_intermediate_size"),
        "dense_layers": dense,
        "dense_intermediate": inter if dense else 0,
        "router": "softmax",
        "norm_topk_prob": _bool(hf, "norm_topk_prob", False),
    }


def _qwen3_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    f = _qwen_moe_common(hf, L, "qwen3_moe")
    bias = _bool(hf, "attention_bias", False)
    f.update(qk_norm=True, qkv_bias=bias, o_bias=bias)
    return f


def _qwen2_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    f = _qwen_moe_common(hf, L, "qwen2_moe")
    shared = _int(hf, "shared_expert_intermediate_size", 0, nullable=True)
    f.update(qk_norm=False, qkv_bias=_bool(hf, "qkv_bias", True), o_bias=False,
             shared_expert_intermediate=shared, shared_expert_gate=shared > 0)
    return f


def _mixtral(hf: dict[str, Any], L: int) -> dict[str, Any]:
    if hf.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json sliding_window={hf['sliding_window']} (mixtral): sliding-window "
                                    "attention is not supported")
    return {
        "num_experts": _int(hf, "num_local_experts", _int(hf, "num_experts", 8)),
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": _int(hf, "intermediate_size"),
        "router": "softmax", "norm_topk_prob": True,
        "qk_norm": False, "qkv_bias": False, "o_bias": False,
    }


def _glm4_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    I = _int(hf, "moe_intermediate_size")
    k_dense = _int(hf, "first_k_dense_replace", 1)
    dense = tuple(range(min(k_dense, L)))
    inter = _int(hf, "intermediate_size", 0, nullable=True)
    bias = _bool(hf, "attention_bias", False)
    return {
        "num_experts": _int(hf, "n_routed_experts", _int(hf, "num_local_experts", 128)),
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": I,
        "shared_expert_intermediate": I * _int(hf, "n_shared_experts", 1, nullable=True, when_null=0),
        "dense_layers": dense,
        "dense_intermediate": inter if dense else 0,
        "router": "sigmoid",
        "norm_topk_prob": _bool(hf, "norm_topk_prob", True),
        "num_expert_groups": _int(hf, "n_group", 1, nullable=True) or 1,
        "topk_groups": _int(hf, "topk_group", 1, nullable=True) or 1,
        "routed_scaling_factor": _float(hf, "routed_scaling_factor", 1.0),
        "qk_norm": _bool(hf, "use_qk_norm", False), "qkv_bias": bias, "o_bias": False,
        "num_mtp_layers": num_extra_layers(hf),
    }


_ARCH = {"qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "mixtral": _mixtral, "glm4_moe": _glm4_moe}


def num_extra_layers(hf: dict[str, Any]) -> int:
    """Layers a checkpoint may hold past ``num_hidden_layers`` that the forward pass does not walk
    (glm4_moe's multi-token-prediction layers, ``num_nextn_predict_layers``: the first is the MTP
    draft head under ``spec.method: mtp``, the rest are never read)."""
    return _int(hf, "num_nextn_predict_layers", 0, nullable=True)


# ---------------------------------------------------------------------------- helpers
_REQUIRED = object()


def _value(hf: dict[str, Any], key: str, default: Any, nullable: bool, when_null: Any, what: str) -> tuple[bool, Any]:
    """(present, value) of ``key``: absent -> its default (a required key raises); an explicit
    null -> ``when_null`` (default: the default) where transformers reads null as "none", else a
    typed error naming the key."""
    if key not in hf:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json has no {key}: expected {what}")
        return False, default
    v = hf[key]
    if v is None:
        if nullable and default is not _REQUIRED:
            return False, default if when_null is _REQUIRED else when_null
        raise CheckpointError(f"config.json {key}=null: expected {what}")
    return True, v


def _int(hf: dict[str, Any], key: str, default: Any = _REQUIRED, *, nullable: bool = False,
         when_null: Any = _REQUIRED) -> int:
    """``config.json``'s integer ``key`` (a bool, float or string is a typed error naming it)."""
    present, v = _value(hf, key, default, nullable, when_null, "an integer")
    if present and (isinstance(v, bool) or not isinstance(v, int)):
        raise CheckpointError(f"config.json {key}={v!r}: expected an integer")
    return v


def _float(hf: dict[str, Any], key: str, default: Any = _REQUIRED, *, nullable: bool = False) -> float:
    """``config.json``'s finite number ``key``."""
    present, v = _value(hf, key, default, nullable, _REQUIRED, "a number")
    if present and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise CheckpointError(f"config.json {key}={v!r}: expected a finite number")
    return float(v)


def _bool(hf: dict[str, Any], key: str, default: Any = _REQUIRED, *, nullable: bool = False) -> bool:
    """``config.json``'s boolean ``key`` (true / false, not 0 / 1 or a string)."""
    present, v = _value(hf, key, default, nullable, _REQUIRED, "true or false")
    if present and not isinstance(v, bool):
        raise CheckpointError(f"config.json {key}={v!r}: expected true or false")
    return v


def _str(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> str:
    present, v = _value(hf, key, default, False, _REQUIRED, "a string")
    if present and not isinstance(v, str):
        raise CheckpointError(f"config.json {key}={v!r}: expected a string")
    return v


def _list(hf: dict[str, Any], key: str, item: type) -> list:
    """``config.json``'s list ``key`` of ``item`` values (absent or null: empty)."""
    _, v = _value(hf, key, [], True, [], "a list")
    name = {int: "integers", str: "strings"}[item]
    if not isinstance(v, list) or any(not isinstance(x, item) or isinstance(x, bool) for x in v):
        raise CheckpointError(f"config.json {key}={v!r}: expected a list of {name}")
    return v


def _rope(hf: dict[str, Any], mt: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (transformers 5) or the
    legacy ``rope_theta`` / ``rope_scaling`` keys; any scaled RoPE type is refused by name."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for src, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(d, dict):
            raise UnsupportedModelError(f"config.json {src}={d!r}: expected an object")
        rt = d.get("rope_type", d.get("type", "default"))
        if rt not in ROPE_TYPES:
            raise UnsupportedModelError(f"config.json {src} type {rt!r} is not supported (only plain RoPE: "
                                        f"{', '.join(ROPE_TYPES)}); refusing rather than ignoring it")
        extra = sorted(set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            raise UnsupportedModelError(f"config.json {src} has unsupported key(s) {', '.join(extra)}")
    theta = _float(params, "rope_theta") if "rope_theta" in params else _float(hf, "rope_theta", 10000.0)
    default_partial = 0.5 if mt == "glm4_moe" else 1.0        # Glm4MoeConfig's default
    if params.get("partial_rotary_factor") is not None:
        partial = _float(params, "partial_rotary_factor")
    else:
        partial = _float(hf, "partial_rotary_factor", default_partial, nullable=True)
    if mt not in ("glm4_moe",) and float(partial) != 1.0:
        raise UnsupportedModelError(f"config.json partial_rotary_factor={partial} ({mt}): its modeling code "
                                    "rotates every head dim")
    return float(theta), float(partial)


def _dtype(hf: dict[str, Any]) -> str:
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    dt = hf.get(key) or "float32"
    if not isinstance(dt, str):
        raise CheckpointError(f"config.json {key}={dt!r}: expected a dtype name")
    dt = dt.removeprefix("torch.")
    if dt not in ("float32", "bfloat16", "float16"):
        raise UnsupportedModelError(f"config.json dtype {dt!r}: expected float32, bfloat16 or float16")
    return dt


def _eos_ids(data: dict[str, Any], source: str) -> list[int]:
    """Every id of ``data``'s ``eos_token_id`` (an integer or a list of them; null or absent:
    none), in order, without repeats."""
    eos = data.get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise CheckpointError(f"{source} eos_token_id={eos!r}: expected a token id or a list of them")
    return list(dict.fromkeys(ids))
