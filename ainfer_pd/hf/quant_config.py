"""``config.json``'s ``quantization_config``: the one format ainfer-pd reads and writes is blockwise
FP8, as DeepSeek-V3-style checkpoints (Qwen3-30B-A3B-FP8, ...) and transformers'
``FineGrainedFP8Config`` write it::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]}

with ``*.weight`` tensors in float8_e4m3fn and float32 ``*.weight_scale_inv`` per 128 x 128 block.
Every other method (gptq, awq, compressed-tensors, bitsandbytes, ...), block size, activation
scheme, element format or unknown key is refused by name (:class:`UnsupportedModelError`).
``modules_to_not_convert`` / ``ignored_layers`` (full module names or patterns) need no
reading beyond their type: the loader goes by each tensor's stored dtype (a float weight is
quantized at load into an FP8 projection, copied into a model-dtype one; an e4m3 weight is
copied, or dequantized into a model-dtype projection). The export lists every Linear it writes
in a float dtype there (:func:`ainfer_pd.hf.export.unquantized_modules`).
"""
from __future__ import annotations

from typing import Any

from ..errors import CheckpointError, UnsupportedModelError

FP8_CONFIG: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128]}
"""What an FP8 model's exported ``config.json`` says (:func:`ainfer_pd.hf.export.config_json`), with
its ``modules_to_not_convert``."""

_KNOWN = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
          "ignored_layers", "dequantize", "scale_fmt"}
# (key, default when absent, the only value read)
_FIXED = (("fmt", "e4m3", "e4m3"), ("activation_scheme", "dynamic", "dynamic"), ("scale_fmt", "float", "float"))


def quantization_of(hf: dict[str, Any]) -> str:
    """``model.quantization`` of a parsed ``config.json``: ``none`` without a quantization config,
    ``fp8`` for a blockwise FP8 one; anything else a typed error naming it."""
    q = hf.get("quantization_config")
    if q is None or q == {}:
        return "none"
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json quantization_config={q!r}: expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(f"config.json quantization_config quant_method {method!r} is not supported: "
                                    "ainfer-pd loads blockwise fp8 checkpoints (quant_method fp8, weight_block_size "
                                    "[128, 128]) and float ones (model.quantization: fp8 quantizes those at load)")
    unknown = sorted(set(q) - _KNOWN)
    if unknown:
        raise UnsupportedModelError(f"config.json quantization_config has key(s) ainfer-pd does not know: "
                                    f"{', '.join(unknown)}")
    block = q.get("weight_block_size")
    if block is None:
        raise UnsupportedModelError("config.json quantization_config fp8 without weight_block_size (per-tensor FP8 "
                                    "scales) is not supported: blockwise [128, 128] only")
    if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
        raise UnsupportedModelError(f"config.json quantization_config weight_block_size {block!r} is not supported: "
                                    "[128, 128] only")
    for key, default, only in _FIXED:
        v = q.get(key, default)
        if v != only:
            raise UnsupportedModelError(f"config.json quantization_config {key} {v!r} is not supported: {only!r} only")
    for key in ("modules_to_not_convert", "ignored_layers"):
        v = q.get(key)
        if v is not None and (not isinstance(v, list) or any(not isinstance(x, str) for x in v)):
            raise CheckpointError(f"config.json quantization_config {key}={v!r}: expected a list of module names")
    return "fp8"
