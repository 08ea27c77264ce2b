"""The engine model out to Hugging Face form: ``config.json``, state dicts in the checkpoint's or
the installed transformers' layout, and a sharded safetensors directory.

The inverse of :mod:`.config` and :mod:`.checkpoint`: ``fields_from_hf(config_json(c))`` gives
``c``'s model fields back, and a directory written by :func:`save_pretrained` loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and with ``WorkerConfig.from_pretrained``.

An FP8 model (``model.quantization: fp8``) is written in the Hugging Face blockwise FP8 format:
its ``config.json`` carries ``quantization_config`` (:data:`.quant_config.FP8_CONFIG`), every FP8
projection's ``*.weight`` is its float8_e4m3fn values and ``*.weight_scale_inv`` their float32
block scales, exactly as held (loading the directory back gives the same bytes); the other
tensors are in the model dtype, and every Linear module written in the model dtype (the dense
projections without ``model.fp8_dense``, the routers, ``lm_head``, ...) is listed by its full name
in ``modules_to_not_convert``, as Qwen's FP8 checkpoints list theirs (transformers and vLLM
leave those modules unquantized). The ``transformers`` layout (packed experts, what a float
transformers model's ``state_dict()`` holds) has no FP8 form: refused (UnsupportedOptionError).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from ..config import ModelConfig
from .checkpoint import INDEX
from ..errors import UnsupportedOptionError
from .config import CAUSAL_LM
from .quant_config import FP8_CONFIG
from .names import Target, hf_targets, mtp_layer_of, name_table

LAYOUTS = ("checkpoint", "transformers")


def config_json(c: ModelConfig, mtp: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``config.json`` of the transformers model with ``c``'s architecture and math (``mtp``: the
    model's MTP layer, :func:`~.names.mtp_layer_of`, whose Linear modules an FP8 export lists too)."""
    a = c.architecture
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta}
    out: dict[str, Any] = {
        "architectures": [CAUSAL_LM[a]], "model_type": a, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.max_context_len, "tie_word_embeddings": c.tie_word_embeddings,
        "dtype": c.dtype, "eos_token_id": c.eos_token_id, "num_experts_per_tok": c.top_k,
        "rope_parameters": rope,
    }
    if c.quantization == "fp8":
        out["quantization_config"] = {**FP8_CONFIG, "modules_to_not_convert": unquantized_modules(c, mtp)}
    dense = c.dense_intermediate or 4 * c.hidden_size    # unused by a model without dense layers
    if a in ("qwen3_moe", "qwen2_moe"):
        out.update(num_experts=c.num_experts, moe_intermediate_size=c.expert_intermediate, intermediate_size=dense,
                   norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(c.dense_layers),
                   use_sliding_window=False)
        if a == "qwen3_moe":
            out["attention_bias"] = c.qkv_bias
        else:
            out.update(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=c.shared_expert_intermediate)
    elif a == "mixtral":
        out.update(num_local_experts=c.num_experts, intermediate_size=c.expert_intermediate, sliding_window=None)
    else:  # glm4_moe
        I = c.expert_intermediate
        if c.shared_expert_intermediate % I:
            raise ValueError("glm4_moe's shared expert is n_shared_experts x moe_intermediate_size wide")
        rope["partial_rotary_factor"] = c.partial_rotary_factor
        out.update(n_routed_experts=c.num_experts, moe_intermediate_size=I, intermediate_size=dense,
                   n_shared_experts=c.shared_expert_intermediate // I, first_k_dense_replace=len(c.dense_layers),
                   n_group=c.num_expert_groups, topk_group=c.topk_groups, norm_topk_prob=c.norm_topk_prob,
                   routed_scaling_factor=c.routed_scaling_factor, use_qk_norm=c.qk_norm, attention_bias=c.qkv_bias,
                   partial_rotary_factor=c.partial_rotary_factor, num_nextn_predict_layers=c.num_mtp_layers)
    return out


def unquantized_modules(c: ModelConfig, mtp: tuple[str, ...] | None = None) -> list[str]:
    """The full names of the Linear modules an FP8 model of ``c`` (with the MTP layer ``mtp``, if
    not None) is exported with in the model dtype: the projections it keeps in ``dtype``, the
    routers, qwen2's shared-expert gate, the MTP layer's ``eh_proj`` / ``shared_head.head`` and
    ``lm_head`` (embeddings are no Linear)."""
    out = [] if not c.tie_word_embeddings else ["lm_head"]
    for name, t in _written(hf_targets(c, (0, c.num_experts), mtp), packed=False):
        if (name.endswith(".weight") and t.fp8 is None and t.scale_of is None and len(t.shape) == 2
                and not name.endswith("embed_tokens.weight")):
            out.append(name.removesuffix(".weight"))
    return out


def _written(targets: Iterable[tuple[str, Target]], packed: bool) -> Iterator[tuple[str, Target]]:
    """The (name, target) pairs a state dict of this layout holds, each part of the model once."""
    seen: set = set()
    for name, t in targets:
        if t.param is None or (packed and t.expert is not None) or (not packed and t.expert_axis):
            continue
        if packed and ".block_sparse_moe." in name:
            continue                              # transformers 5 names mixtral's MoE mlp.*
        if any(u in seen for u in t.units):
            continue
        seen.update(t.units)
        yield name, t


def transformers_config(c: ModelConfig):
    """The installed transformers' config object for ``c``."""
    from transformers import AutoConfig
    kw = config_json(c)
    kw.pop("architectures")
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def state_dict(model: nn.Module, layout: str = "checkpoint") -> dict[str, Tensor]:
    """The model's weights under Hugging Face names, as contiguous copies: ``checkpoint`` (what
    ``save_pretrained`` writes: per-expert tensors, glm's ``e_score_correction_bias``) or
    ``transformers`` (the installed version's ``state_dict()`` layout: packed experts). Needs the
    whole model (no expert-parallel shard). Tied models carry no ``lm_head.weight``."""
    return {name: view().contiguous().clone() for name, _, view in _tensors(model, layout)}


def _tensors(model: nn.Module, layout: str):
    """(name, bytes, () -> view of the engine's storage in that name's layout), lazily."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    if layout == "transformers" and model.cfg.quantization == "fp8":
        raise UnsupportedOptionError("an FP8 model has no transformers-layout state dict (packed float experts); "
                                     "export it in the checkpoint layout (FP8 + weight_scale_inv)", key="layout")
    if not model.holds_all_experts:
        raise ValueError("the Hugging Face state needs the whole model (this one holds an expert-parallel shard)")
    table = name_table(model)
    for name, t in _written(table.hf.items(), packed=layout == "transformers"):
        p = table.params[t.param]

        def view(p=p, t=t) -> Tensor:
            region = p[t.index] if t.index else p
            return (region.transpose(-1, -2) if t.transpose else region).detach()
        yield name, math.prod(t.shape) * p.element_size(), view


def save_pretrained(model: nn.Module, path: str | Path, *, max_shard_bytes: int = 2 << 30) -> Path:
    """Write ``config.json``, ``model-0000k-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own) and the index; one
    shard's tensors are copied at a time. A model built with its MTP layer writes it too
    (``model.layers.L.*``), one without says ``num_nextn_predict_layers: 0``."""
    from safetensors.torch import save_file
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cj = config_json(model.cfg, mtp_layer_of(model))
    if getattr(model, "mtp", None) is None and cj.get("num_nextn_predict_layers"):
        cj["num_nextn_predict_layers"] = 0                # no MTP layer built: none written
    (d / "config.json").write_text(json.dumps(cj, indent=2))
    shards: list[list] = [[]]
    size = total = 0
    for name, n, view in _tensors(model, "checkpoint"):
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, view))
        size += n
        total += n
    wmap = {}
    for k, items in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: v().contiguous() for n, v in items}, str(d / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n, _ in items})
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=1))
    return d
