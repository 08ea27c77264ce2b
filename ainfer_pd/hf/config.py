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
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, UnsupportedModelError

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
    p = d / "config.json"
    if not p.is_file():
        raise CheckpointError(f"{d.name}/config.json not found: a Hugging Face model directory needs it")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{d.name}/config.json is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{d.name}/config.json: top level must be an object")
    return data


def model_type_of(hf: dict[str, Any]) -> str:
    mt = hf.get("model_type")
    if mt is None:                       # old configs name only the class
        by_class = {v: k for k, v in CAUSAL_LM.items()}
        mt = next((by_class[a] for a in hf.get("architectures") or () if a in by_class), None)
    if mt not in CAUSAL_LM:
        raise UnsupportedModelError(f"config.json model_type {mt!r} is not supported; supported: "
                                    f"{', '.join(CAUSAL_LM)}")
    archs = hf.get("architectures")
    if archs and CAUSAL_LM[mt] not in archs:
        raise UnsupportedModelError(f"config.json architectures {archs}: ainfer-pd serves {CAUSAL_LM[mt]} "
                                    f"(the causal LM head of {mt})")
    return mt


def model_fields(model_dir: str | Path) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the model in ``model_dir`` (``path`` included)."""
    hf = read_config_json(model_dir)
    fields = fields_from_hf(hf)
    fields["path"] = str(model_dir)
    return fields


def fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a parsed ``config.json``."""
    mt = model_type_of(hf)
    unknown = sorted(k for k in hf if k not in _INERT | _COMMON | _ARCH_KEYS[mt] and not k.startswith("_"))
    if unknown:
        raise UnsupportedModelError(f"config.json ({mt}) has key(s) ainfer-pd does not know: {', '.join(unknown)}; "
                                    "they may change the model's math, so the model is refused")
    if hf.get("quantization_config"):
        raise UnsupportedModelError(f"config.json quantization_config "
                                    f"({hf['quantization_config'].get('quant_method', '?')}): quantized checkpoints "
                                    "are not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json hidden_act={act!r}: only silu (SwiGLU) is supported")
    H = _int(hf, "num_attention_heads")
    D = _int(hf, "hidden_size")
    L = _int(hf, "num_hidden_layers")
    head_dim = hf.get("head_dim") or D // H
    theta, partial = _rope(hf, mt)
    f: dict[str, Any] = {
        "architecture": mt,
        "vocab_size": _int(hf, "vocab_size"),
        "hidden_size": D,
        "num_layers": L,
        "num_heads": H,
        "num_kv_heads": int(hf.get("num_key_value_heads") or H),
        "head_dim": int(head_dim),
        "rms_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "partial_rotary_factor": partial,
        "max_context_len": int(hf.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dtype": _dtype(hf),
        "eos_token_id": _eos(hf),
    }
    f.update(_ARCH[mt](hf, L))
    return f


# ---------------------------------------------------------------------------- per architecture
def _qwen_moe_common(hf: dict[str, Any], L: int, mt: str) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"config.json use_sliding_window=true ({mt}): sliding-window attention "
                                    "is not supported")
    lt = hf.get("layer_types")
    if lt and any(t != "full_attention" for t in lt):
        raise UnsupportedModelError(f"config.json layer_types {sorted(set(lt))}: only full_attention is supported")
    E = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    if E <= 0:
        raise UnsupportedModelError(f"config.json num_experts={E} ({mt}): a dense model; ainfer-pd serves MoE models")
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(L) if i in mlp_only or (i + 1) % step != 0)
    return {
        "num_experts": E,
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": _int(hf, "moe_intermediate_size"),
        "dense_layers": dense,
        "dense_intermediate": int(hf.get("intermediate_size", 0)) if dense else 0,
        "router": "softmax",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
    }


def _qwen3_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    f = _qwen_moe_common(hf, L, "qwen3_moe")
    bias = bool(hf.get("attention_bias", False))
    f.update(qk_norm=True, qkv_bias=bias, o_bias=bias)
    return f


def _qwen2_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    f = _qwen_moe_common(hf, L, "qwen2_moe")
    shared = int(hf.get("shared_expert_intermediate_size", 0) or 0)
    f.update(qk_norm=False, qkv_bias=bool(hf.get("qkv_bias", True)), o_bias=False,
             shared_expert_intermediate=shared, shared_expert_gate=shared > 0)
    return f


def _mixtral(hf: dict[str, Any], L: int) -> dict[str, Any]:
    if hf.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json sliding_window={hf['sliding_window']} (mixtral): sliding-window "
                                    "attention is not supported")
    return {
        "num_experts": int(hf.get("num_local_experts", hf.get("num_experts", 8))),
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": _int(hf, "intermediate_size"),
        "router": "softmax", "norm_topk_prob": True,
        "qk_norm": False, "qkv_bias": False, "o_bias": False,
    }


def _glm4_moe(hf: dict[str, Any], L: int) -> dict[str, Any]:
    I = _int(hf, "moe_intermediate_size")
    k_dense = int(hf.get("first_k_dense_replace", 1))
    dense = tuple(range(min(k_dense, L)))
    bias = bool(hf.get("attention_bias", False))
    return {
        "num_experts": int(hf.get("n_routed_experts", hf.get("num_local_experts", 128))),
        "top_k": _int(hf, "num_experts_per_tok"),
        "expert_intermediate": I,
        "shared_expert_intermediate": I * int(hf.get("n_shared_experts", 1) or 0),
        "dense_layers": dense,
        "dense_intermediate": int(hf.get("intermediate_size", 0)) if dense else 0,
        "router": "sigmoid",
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "num_expert_groups": int(hf.get("n_group", 1) or 1),
        "topk_groups": int(hf.get("topk_group", 1) or 1),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "qk_norm": bool(hf.get("use_qk_norm", False)), "qkv_bias": bias, "o_bias": False,
    }


_ARCH = {"qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "mixtral": _mixtral, "glm4_moe": _glm4_moe}


def num_extra_layers(hf: dict[str, Any]) -> int:
    """Layers a checkpoint may hold past ``num_hidden_layers`` that inference does not use
    (glm4_moe's multi-token-prediction layers, ``num_nextn_predict_layers``)."""
    return int(hf.get("num_nextn_predict_layers", 0) or 0)


# ---------------------------------------------------------------------------- helpers
def _int(hf: dict[str, Any], key: str) -> int:
    v = hf.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise UnsupportedModelError(f"config.json {key}={v!r}: expected an integer")
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
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    default_partial = 0.5 if mt == "glm4_moe" else 1.0        # Glm4MoeConfig's default
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    if partial is None:
        partial = default_partial
    if mt not in ("glm4_moe",) and float(partial) != 1.0:
        raise UnsupportedModelError(f"config.json partial_rotary_factor={partial} ({mt}): its modeling code "
                                    "rotates every head dim")
    return float(theta), float(partial)


def _dtype(hf: dict[str, Any]) -> str:
    dt = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    dt = str(dt).removeprefix("torch.")
    if dt not in ("float32", "bfloat16", "float16"):
        raise UnsupportedModelError(f"config.json dtype {dt!r}: expected float32, bfloat16 or float16")
    return dt


def _eos(hf: dict[str, Any]) -> int | None:
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        if len(eos) > 1:
            log.info("config.json lists %d EOS ids; the first (%d) ends a turn, pass the others as "
                     "stop_token_ids", len(eos), eos[0])
        eos = eos[0] if eos else None
    return None if eos is None else int(eos)
