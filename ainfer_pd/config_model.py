"""The model section of the config: :class:`ModelConfig` and the architectures it may name.

Loaded and validated through :class:`~ainfer_pd.config.WorkerConfig` (import it from
:mod:`ainfer_pd.config`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config_checks import check_positive
from .errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16", "float64")

ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
QUANTIZATIONS = ("none", "fp8")
ROUTERS = ("softmax", "sigmoid")

# What each architecture's Hugging Face layout can hold (its weight names have a place for it).
# A feature outside its architecture's set is refused: the model would carry a tensor that no
# checkpoint or weight sync in that architecture's names could ever fill.
_ARCH_FEATURES = {
    "qwen3_moe": {"qk_norm", "qkv_bias", "o_bias", "dense_layers"},
    "qwen2_moe": {"qkv_bias", "shared_expert", "shared_expert_gate", "dense_layers"},
    "mixtral": set(),
    "glm4_moe": {"qk_norm", "qkv_bias", "shared_expert", "dense_layers", "sigmoid_router",
                 "partial_rotary", "routed_scaling", "mtp"},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str = "qwen3_moe"
    """Which Hugging Face architecture this model is (its weight names, its variant of the one
    decoder): qwen3_moe | qwen2_moe | mixtral | glm4_moe. The feature fields below say what the
    math is; ``validate`` refuses features the architecture's layout has no tensor for."""
    path: str | None = None
    """A Hugging Face model directory (``config.json`` + ``*.safetensors``). In YAML,
    ``model: {path: DIR}`` takes every field below from ``config.json``; keys given next to
    ``path`` override them. Without weight files the model is a seeded random init."""
    vocab_size: int = 512
    """Vocabulary size; token ids must lie in ``[0, vocab_size)``."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    """Query heads (GQA: a multiple of ``num_kv_heads``)."""
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    expert_intermediate: int = 128
    """SwiGLU intermediate width of one routed expert."""
    shared_expert_intermediate: int = 0
    """Intermediate width of the shared expert of every MoE layer (0 = none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by ``sigmoid(x @ gate)`` (qwen2_moe)."""
    dense_layers: tuple[int, ...] = ()
    """Layers whose FFN is a dense SwiGLU MLP instead of the MoE (qwen's ``mlp_only_layers`` /
    ``decoder_sparse_step``, glm's ``first_k_dense_replace``): no router, no expert exchange."""
    dense_intermediate: int = 0
    """Intermediate width of the dense MLP layers (``intermediate_size``)."""
    router: str = "softmax"
    """softmax: softmax over all experts, then top-k (qwen, mixtral). sigmoid: sigmoid scores plus
    ``e_score_correction_bias`` choose the experts, group-limited (glm4_moe)."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen weights to sum to 1 (mixtral always does)."""
    num_expert_groups: int = 1
    """sigmoid router: experts split in this many groups (``n_group``) ..."""
    topk_groups: int = 1
    """... of which the best ``topk_group`` (by the sum of their top-2 scores) may be chosen."""
    routed_scaling_factor: float = 1.0
    """The combine weights of the routed experts are multiplied by this (glm4_moe)."""
    qk_norm: bool = True
    """RMSNorm over each query and key head (before RoPE): qwen3_moe, glm4_moe ``use_qk_norm``."""
    qkv_bias: bool = False
    """Bias on the q, k and v projections."""
    o_bias: bool = False
    """Bias on the output projection (qwen3_moe's ``attention_bias`` sets both)."""
    max_context_len: int = 4096
    """Context limit: prompt (cached + new) plus generated tokens."""
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    """RoPE rotates the first ``head_dim * partial_rotary_factor`` dims of each head (half-split
    over those, as transformers' ``rotate_half``); the rest pass through."""
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    """The output head is the embedding matrix (one tensor)."""
    dtype: str = "float32"
    quantization: str = "none"
    """Weight format of the projections: ``none`` (the model dtype) or ``fp8`` (blockwise e4m3,
    128 x 128 weight blocks with float32 scales, activations quantized per token in 1 x 128
    groups: :mod:`ainfer_pd.engine.model.linear`). ``fp8`` on a checkpoint in a float dtype or a
    random init quantizes at load (the random init: drawn in ``dtype``, then quantized); an FP8
    checkpoint (``quantization_config.quant_method: fp8``) sets it. Which projections are FP8:
    the routed experts (``w13`` / ``w2``) always, the dense ones with ``fp8_dense``. The router,
    the embedding, the head, the norms and the biases stay in ``dtype``."""
    fp8_dense: bool = False
    """With ``quantization: fp8``, the *dense* projections are FP8 too: attention q/k/v and o, the
    shared expert and the dense layers' MLPs (the projections every token runs). Off (default):
    only the routed experts are FP8, the dense projections stay in ``dtype``, because that measures
    faster on the H200 (Qwen3-30B-A3B shape): the routed experts' FP8 kernel is 1.67x faster than
    bf16, while the FP8 dense GEMM plus its activation quantization costs ~1 ms more per decode step
    than bf16 cuBLAS (batch 64, ctx 2K) and 0.134 ms against 0.060 ms for the QKV GEMM of a
    2,048-token prefill. On Hopper, where torch reaches cuBLASLt's blockwise FP8 GEMM, the dense GEMMs of
    64 rows or more run there (:mod:`ainfer_pd.engine.quant.fp8_cublas`: H100, QKV at 2,048 / 4,096 rows
    0.054 / 0.094 ms against bf16's 0.062 / 0.120, at 64 rows 0.018 against 0.016), so ``true`` trades
    slower decode for faster long prefills. An FP8 checkpoint's dense weights are then dequantized at load (and at a
    weight sync sending e4m3 + ``weight_scale_inv``). ``true``: every projection FP8, for hardware
    or kernels where the FP8 dense GEMMs measure better. Needs ``quantization: fp8``."""
    num_mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds past ``num_layers`` (glm4_moe's
    ``num_nextn_predict_layers``; DeepSeek-V3's MTP shape). The first is built, loaded and synced
    only with ``spec.method: mtp`` (its draft head, ``ainfer_pd.engine.model.mtp_layer``);
    otherwise the checkpoint's MTP tensors are skipped."""
    seed: int = 0
    """Seed of the deterministic random initialisation."""
    weights_path: str | None = None
    """Optional safetensors file in this engine's own parameter names, loaded over the random
    init (never pickle). Hugging Face checkpoints come through ``path`` instead."""
    eos_token_id: int | None = 1
    """Token that ends a turn (None: only ``max_new_tokens`` and stop tokens do)."""
    stop_token_ids: tuple[int, ...] = ()
    """The rest of the model's stop set: every id that ends a turn besides ``eos_token_id``
    (from a Hugging Face directory: ``config.json``'s whole ``eos_token_id`` list and
    ``generation_config.json``'s ``eos_token_id``, as vLLM uses them). Like ``eos_token_id``,
    ``SamplingParams(ignore_eos=True)`` turns them off; ``SamplingParams.stop_token_ids`` add to them."""

    def validate(self) -> None:
        check_positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "num_experts", "top_k", "expert_intermediate", "max_context_len",
                  "num_expert_groups", "topk_groups")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"model.architecture={self.architecture!r}: expected one of {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads={self.num_heads} is not a multiple of "
                              f"model.num_kv_heads={self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError("model.partial_rotary_factor must be in (0, 1]")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(f"model.head_dim * partial_rotary_factor = {self.head_dim * self.partial_rotary_factor:g} "
                              "must be a positive even integer (RoPE)")
        if self.num_mtp_layers < 0:
            raise ConfigError(f"model.num_mtp_layers={self.num_mtp_layers} must be >= 0")
        if self.shared_expert_intermediate < 0 or self.dense_intermediate < 0:
            raise ConfigError("model.shared_expert_intermediate and model.dense_intermediate must be >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate:
            raise ConfigError("model.shared_expert_gate needs model.shared_expert_intermediate > 0")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers) or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ConfigError(f"model.dense_layers={list(self.dense_layers)}: distinct layer ids in [0, {self.num_layers})")
        if self.dense_layers and not self.dense_intermediate:
            raise ConfigError("model.dense_layers needs model.dense_intermediate > 0")
        if self.router not in ROUTERS:
            raise ConfigError(f"model.router={self.router!r}: expected one of {ROUTERS}")
        E, G = self.num_experts, self.num_expert_groups
        if E % G or self.topk_groups > G:
            raise ConfigError(f"model.num_expert_groups={G} must divide num_experts={E} and be >= topk_groups={self.topk_groups}")
        if G > 1 and (self.router != "sigmoid" or E // G < 2):
            raise ConfigError("model.num_expert_groups > 1 needs router=sigmoid and >= 2 experts per group")
        if self.topk_groups < G and self.top_k > self.topk_groups * (E // G):
            raise ConfigError(f"model.top_k={self.top_k} exceeds the experts of topk_groups={self.topk_groups} groups")
        if not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0:
            raise ConfigError("model.routed_scaling_factor must be > 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} not one of {DTYPES}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"model.quantization={self.quantization!r}: expected one of {QUANTIZATIONS}")
        if self.fp8_dense and self.quantization != "fp8":
            raise ConfigError("model.fp8_dense makes the dense projections FP8: it needs model.quantization: fp8")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError("model.eos_token_id outside the vocabulary")
        bad_stops = [i for i in self.stop_token_ids if not 0 <= i < self.vocab_size]
        if bad_stops:
            raise ConfigError(f"model.stop_token_ids {bad_stops} outside the vocabulary [0, {self.vocab_size})")
        self._validate_architecture()

    def _validate_architecture(self) -> None:
        allowed = _ARCH_FEATURES[self.architecture]
        used = {
            "qk_norm": self.qk_norm, "qkv_bias": self.qkv_bias, "o_bias": self.o_bias,
            "dense_layers": bool(self.dense_layers), "shared_expert": self.shared_expert_intermediate > 0,
            "shared_expert_gate": self.shared_expert_gate, "sigmoid_router": self.router == "sigmoid",
            "partial_rotary": self.partial_rotary_factor != 1.0, "routed_scaling": self.routed_scaling_factor != 1.0,
            "mtp": self.num_mtp_layers > 0,
        }
        bad = sorted(k for k, on in used.items() if on and k not in allowed)
        if bad:
            raise ConfigError(f"model.architecture={self.architecture} has no place for: {', '.join(bad)} "
                              f"(its features: {', '.join(sorted(allowed)) or 'none of the optional ones'})")
        a = self.architecture
        if a == "qwen3_moe" and not self.qk_norm:
            raise ConfigError("model.architecture=qwen3_moe always has QK-norm (model.qk_norm: true)")
        if a == "qwen3_moe" and self.qkv_bias != self.o_bias:
            raise ConfigError("qwen3_moe's attention_bias covers q, k, v and o: model.qkv_bias must equal model.o_bias")
        if a == "qwen2_moe" and self.shared_expert_intermediate and not self.shared_expert_gate:
            raise ConfigError("qwen2_moe's shared expert is always gated (model.shared_expert_gate: true)")
        if a == "mixtral" and not self.norm_topk_prob:
            raise ConfigError("mixtral always renormalises its top-k weights (model.norm_topk_prob: true)")
        if a == "glm4_moe" and self.router != "sigmoid":
            raise ConfigError("glm4_moe routes with sigmoid scores (model.router: sigmoid)")
        if a == "glm4_moe" and self.dense_layers != tuple(range(len(self.dense_layers))):
            raise ConfigError("glm4_moe's dense layers are the first k (first_k_dense_replace): model.dense_layers "
                              "must be 0..k-1")

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers with routed experts (every layer that is not dense)."""
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def stop_set(self) -> frozenset[int]:
        """Every id that ends a turn unless ``ignore_eos``: ``eos_token_id`` and ``stop_token_ids``."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.dense_layers

    def rank_params(self, expert_parallel: int) -> int:
        """Parameters one rank holds when the routed experts are spread over ``expert_parallel`` ranks."""
        routed = (self.num_layers - len(self.dense_layers)) * self.num_experts * 3 * self.hidden_size \
            * self.expert_intermediate
        return self.num_params - routed + routed // max(1, expert_parallel)

    def fp8_projection(self, routed: bool) -> bool:
        """A projection (``routed``: the routed experts' ``w13`` / ``w2``; else a dense one) is held
        in FP8: the routed experts under ``quantization: fp8``, the dense ones also with ``fp8_dense``."""
        return self.quantization == "fp8" and (routed or self.fp8_dense)

    def rank_weight_bytes(self, expert_parallel: int) -> int:
        """Bytes of one rank's weights (:meth:`rank_params` in ``dtype``); the FP8 projections
        (:meth:`fp8_projection`) take 1 byte per value plus a float32 scale per 128 x 128 block."""
        nbytes = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[self.dtype]
        total = self.rank_params(expert_parallel) * nbytes
        h, L, nd = self.hidden_size, self.num_layers, len(self.dense_layers)
        proj = 0
        if self.fp8_projection(routed=True):
            proj += (L - nd) * 3 * h * (self.num_experts // max(1, expert_parallel) * self.expert_intermediate)
        if self.fp8_projection(routed=False):
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            proj += L * h * (2 * q + 2 * kv) + nd * 3 * h * self.dense_intermediate
            proj += (L - nd) * 3 * h * self.shared_expert_intermediate
        return total - proj * nbytes + proj + 4 * -(-proj // (128 * 128))

    @property
    def num_params(self) -> int:
        h, L = self.hidden_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + 2 * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        moe = h * self.num_experts + self.num_experts * 3 * h * self.expert_intermediate
        moe += 3 * h * self.shared_expert_intermediate + h * self.shared_expert_gate
        moe += self.num_experts * (self.router == "sigmoid")
        dense = 3 * h * self.dense_intermediate
        n_dense = len(self.dense_layers)
        head = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * attn + (L - n_dense) * moe + n_dense * dense + head + h
