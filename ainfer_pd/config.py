"""Frozen configuration dataclasses, one per component; YAML in, validated once.

``WorkerConfig.from_yaml(path)`` is the only entry point most users need. Unknown
keys, wrong types and inconsistent values raise :class:`~ainfer_pd.errors.ConfigError`
naming the offending key. No flag silently changes another; derived values are
properties.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, TopologyError

POLICIES = ("normal", "global-complete", "global-enqueue", "fine-grained", "mixed-chunked")
from .comm.ordering import ORDERINGS  # noqa: E402  (its one home)
EXPERT_BACKENDS = ("local", "torch", "deepep")
SPANS = ("1", "2", "3", "4", "auto", "measured")
P_HOST_PACINGS = ("auto", "layer", "epoch")
KERNEL_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("float32", "bfloat16", "float16", "float64")


ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
ROUTERS = ("softmax", "sigmoid")

# What each architecture's Hugging Face layout can hold (its weight names have a place for it).
# A feature outside its architecture's set is refused: the model would carry a tensor that no
# checkpoint or weight sync in that architecture's names could ever fill.
_ARCH_FEATURES = {
    "qwen3_moe": {"qk_norm", "qkv_bias", "o_bias", "dense_layers"},
    "qwen2_moe": {"qkv_bias", "shared_expert", "shared_expert_gate", "dense_layers"},
    "mixtral": set(),
    "glm4_moe": {"qk_norm", "qkv_bias", "shared_expert", "dense_layers", "sigmoid_router",
                 "partial_rotary", "routed_scaling"},
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
    seed: int = 0
    """Seed of the deterministic random initialisation."""
    weights_path: str | None = None
    """Optional safetensors file in this engine's own parameter names, loaded over the random
    init (never pickle). Hugging Face checkpoints come through ``path`` instead."""
    eos_token_id: int | None = 1
    """Token that ends a turn (None: only ``max_new_tokens`` and stop tokens do)."""

    def validate(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
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
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError("model.eos_token_id outside the vocabulary")
        self._validate_architecture()

    def _validate_architecture(self) -> None:
        allowed = _ARCH_FEATURES[self.architecture]
        used = {
            "qk_norm": self.qk_norm, "qkv_bias": self.qkv_bias, "o_bias": self.o_bias,
            "dense_layers": bool(self.dense_layers), "shared_expert": self.shared_expert_intermediate > 0,
            "shared_expert_gate": self.shared_expert_gate, "sigmoid_router": self.router == "sigmoid",
            "partial_rotary": self.partial_rotary_factor != 1.0, "routed_scaling": self.routed_scaling_factor != 1.0,
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

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.dense_layers

    def rank_params(self, expert_parallel: int) -> int:
        """Parameters one rank holds when the routed experts are spread over ``expert_parallel`` ranks."""
        routed = (self.num_layers - len(self.dense_layers)) * self.num_experts * 3 * self.hidden_size \
            * self.expert_intermediate
        return self.num_params - routed + routed // max(1, expert_parallel)

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


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 2048
    """KV blocks per rank (0 = size from ``gpu_memory_fraction`` on CUDA)."""
    gpu_memory_fraction: float = 0.85
    """Fraction of free GPU memory the KV cache may take when ``num_blocks`` is 0."""
    prefix_sharing: bool = True
    """Content-addressed KV blocks shared by every request whose prefix is cached (GRPO siblings,
    a new request id for the same context, a trajectory's own next turn); a turn waits for a
    sibling that is writing its missing prefix. False: a block is reused only by the trajectory
    that wrote it (its own next turns)."""
    prefix_wait_min_tokens: int = 0
    """A waiting turn whose next missing prompt blocks a sibling is writing (GRPO samples submitted
    together) waits for that sibling's pass, to share them, only when they hold at least this many
    tokens; shorter ones it computes itself in the same epoch (waiting costs its TTFT one P epoch:
    with short prompts on a small model that can cost more than the compute it saves). 0: always wait."""
    routed_experts: bool = False
    """Routing replay (verl's ``enable_rollout_routing_replay``): keep every fed token's top-k
    expert ids per MoE layer beside its KV (int16 ``[moe_layers, slots, top_k]``), so requests
    with ``SamplingParams(return_routed_experts=True)`` get them in ``TurnOutput.routed_experts``.
    Off: nothing allocated or recorded, and such requests are refused."""
    gpu_memory_utilization: float = 0.0
    """When > 0 (and ``num_blocks`` is 0): the share of the device's *total* memory the whole
    rollout may hold, weights of this rank included (verl's ``rollout.gpu_memory_utilization``);
    the KV pool gets what is left after the weights and a 2 GiB activation / graph reserve."""

    def validate(self) -> None:
        _positive(self, "block_size")
        if not isinstance(self.prefix_sharing, bool):
            raise ConfigError("cache.prefix_sharing must be a bool")
        if isinstance(self.prefix_wait_min_tokens, bool) or not isinstance(self.prefix_wait_min_tokens, int) \
                or self.prefix_wait_min_tokens < 0:
            raise ConfigError("cache.prefix_wait_min_tokens must be an integer >= 0")
        if not isinstance(self.routed_experts, bool):
            raise ConfigError("cache.routed_experts must be a bool")
        if self.num_blocks < 0:
            raise ConfigError("cache.num_blocks must be >= 0")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError("cache.gpu_memory_fraction must be in (0, 1]")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ConfigError("cache.gpu_memory_utilization must be in [0, 1] (0 = use gpu_memory_fraction)")


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    policy: str = "normal"
    """One of normal | global-complete | global-enqueue | fine-grained | mixed-chunked."""
    max_prefill_tokens: int = 2048
    """Token budget of one P epoch (new tokens over all admitted requests)."""
    max_decode_batch: int = 64
    """Decode rows per D iteration."""
    mixed_chunk_tokens: int = 512
    """mixed-chunked: tokens per step (decode rows + a prefill chunk)."""
    priority: str = "fifo"
    """fifo | critical-path: the order waiting prefill is admitted and decode rows are batched
    (``ainfer_pd.sched.priority``): critical-path serves the trajectories with the most predicted
    work left first, with aging and a first-token bound. Composes with every policy."""
    priority_aging_s: float = 2.0
    """critical-path: seconds of waiting worth one typical turn of work."""
    ttft_bound_tokens: int = 16384
    """critical-path: prefill tokens admitted ahead of a waiting turn before it goes first."""

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy={self.policy!r}: unknown policy, expected one of {POLICIES}")
        _positive(self, "max_prefill_tokens", "max_decode_batch", "mixed_chunk_tokens", "ttft_bound_tokens")
        from .sched.priority import PRIORITIES
        if self.priority not in PRIORITIES:
            raise ConfigError(f"scheduler.priority={self.priority!r}: expected one of {PRIORITIES}")
        if not self.priority_aging_s > 0:
            raise ConfigError("scheduler.priority_aging_s must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class MuxConfig:
    span: str = "auto"
    """Turnstile span K: "1".."4", "auto" (load-selected among validated spans) or "measured"
    (from the measured P time per boundary and D iteration time, up to ``max_span``)."""
    auto_spans: tuple[int, ...] = (1, 2, 3, 4)
    """Spans the ``auto`` policy may choose among."""
    measured_share: float = 1.0
    """measured: P may cross as many boundaries per D round as fit in this share of one D iteration."""
    max_span: int = 32
    """measured: the largest span it may choose (<= 64)."""
    activation_threshold: int = 64
    """Multiplexing switches on when at least this many prefill tokens wait while D runs
    (below it a P epoch runs as under ``normal``: no rendezvous, no segmenting)."""
    activation_cooldown_s: float = 0.05
    """Multiplexing stays on this long after concurrent P disappears."""
    p_host_pacing: str = "auto"
    """When P's host waits for its device inside an epoch. ``layer``: after every attention
    segment (the receive counts of expert parallelism need it); ``epoch``: only at the epoch's
    end (its host enqueues ahead, the stream keeps the order); ``auto``: ``layer`` with expert
    parallelism or on the CPU stand-in (it models the EP system's paced host), else ``epoch``."""

    def validate(self) -> None:
        if self.p_host_pacing not in P_HOST_PACINGS:
            raise ConfigError(f"mux.p_host_pacing={self.p_host_pacing!r}: expected one of {P_HOST_PACINGS}")
        if str(self.span) not in SPANS:
            raise ConfigError(f"mux.span={self.span!r}: expected one of {SPANS}")
        if not self.auto_spans or any(not 1 <= k <= 4 for k in self.auto_spans):
            raise ConfigError("mux.auto_spans must be a non-empty list of spans in 1..4")
        if self.activation_threshold < 1:
            raise ConfigError("mux.activation_threshold must be >= 1")
        if not 0 < self.measured_share <= 16:
            raise ConfigError("mux.measured_share must be in (0, 16]")
        if isinstance(self.max_span, bool) or not 1 <= self.max_span <= 64:
            raise ConfigError("mux.max_span must be an integer in 1..64")
        if self.activation_cooldown_s < 0:
            raise ConfigError("mux.activation_cooldown_s must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    world_size: int = 1
    """g: ranks (one process each)."""
    attn_dp: int = 1
    """d: attention data-parallel replicas; ATP = g / d."""
    expert_parallel: int = 1
    """e: expert-parallel width; ETP = g / e."""
    ordering: str = "selective"
    """none (communicator isolation only) | global-implicit | selective (SPEC 3.3)."""
    expert_backend: str = "local"
    """local (no EP) | torch (torch.distributed all-to-all) | deepep."""
    rendezvous_timeout_s: float = 30.0
    """Deadline of every distributed wait."""
    stall_timeout_s: float = 20.0
    """Multi-rank watchdog: device work pending and no progress (collectives, D iterations, P
    segments, completed requests) for this long -> StallError naming the cross-rank frontier."""
    fast_rendezvous: bool = True
    """Use the same-host shared-memory rendezvous when every rank is on one host."""

    def validate(self) -> None:
        _positive(self, "world_size", "attn_dp", "expert_parallel")
        g, d, e = self.world_size, self.attn_dp, self.expert_parallel
        if g % d:
            raise TopologyError(f"world_size={g} is not divisible by attn_dp={d}")
        if g % e:
            raise TopologyError(f"world_size={g} is not divisible by expert_parallel={e}")
        if self.ordering not in ORDERINGS:
            raise ConfigError(f"parallel.ordering={self.ordering!r}: expected one of {ORDERINGS}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ConfigError(f"parallel.expert_backend={self.expert_backend!r}: expected one of {EXPERT_BACKENDS}")
        if self.rendezvous_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ConfigError("parallel.rendezvous_timeout_s and parallel.stall_timeout_s must be > 0")

    @property
    def atp(self) -> int:
        return self.world_size // self.attn_dp

    @property
    def etp(self) -> int:
        return self.world_size // self.expert_parallel

    @property
    def crossed(self) -> bool:
        """ATP and ADP groups intersect (both > 1): the SPEC section 2 hazard exists."""
        return self.atp > 1 and self.attn_dp > 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceConfig:
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    cpu_threads_per_stream: int = 1
    """CPU stand-in: torch intra-op threads used by each stream's executor."""
    residency_slots: int = 2
    """CPU stand-in: work items (kernels) a device runs at once across its streams."""
    collective_slots: int = 0
    """CPU stand-in: attention collectives resident on a device at once (0 = no limit). A resident
    collective holds its slot until every peer joined, as a spinning NCCL kernel holds SMs; with one
    slot, collectives of crossed groups launched in opposite orders on two ranks stall for real."""
    cuda_graphs: bool = True
    """CUDA: decode by graph replay of batch-size buckets."""
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    graph_max_context: int = 8192
    """CUDA: context length the captured decode graphs cover (longer rows run eager)."""
    high_priority_stream: str = "none"
    """CUDA: none | P | D. The named phase's stream gets the device's highest stream priority,
    so its kernels are scheduled first when both phases have work queued (P: first-token
    latency; D: decode iteration time). Equal priority by default."""
    attention_backend: str = "auto"
    """auto | torch | triton. ``triton``: paged kernels reading K/V in place through the block
    tables (decode split-KV, one varlen launch per P segment); ``torch``: the reference path
    (gather + SDPA). auto = triton on CUDA, torch on CPU."""
    moe_backend: str = "auto"
    """auto | torch | triton. ``triton``: the fused MoE kernels (block-aligned expert layout on
    the device, SwiGLU fused into the first GEMM); ``torch``: the reference grouped GEMM with
    gather / scatter. auto = triton on CUDA, torch on CPU."""
    warmup_prefill: bool = True
    """CUDA: at start, run P passes of 16 .. max_prefill_tokens tokens (first turn and
    continuation) on the P stream, so first-use kernel loading and GEMM selection do not land
    inside a measured P epoch."""

    def validate(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"device.device={self.device!r}: expected cpu | cuda | auto")
        if self.high_priority_stream not in ("none", "P", "D"):
            raise ConfigError(f"device.high_priority_stream={self.high_priority_stream!r}: expected none | P | D")
        _positive(self, "cpu_threads_per_stream", "residency_slots", "graph_max_context")
        if isinstance(self.collective_slots, bool) or not isinstance(self.collective_slots, int) or self.collective_slots < 0:
            raise ConfigError(f"device.collective_slots must be an integer >= 0, got {self.collective_slots!r}")
        for key in ("attention_backend", "moe_backend"):
            if getattr(self, key) not in KERNEL_BACKENDS:
                raise ConfigError(f"device.{key}={getattr(self, key)!r}: expected one of {KERNEL_BACKENDS}")
        if not self.graph_batch_sizes or sorted(self.graph_batch_sizes) != list(self.graph_batch_sizes):
            raise ConfigError("device.graph_batch_sizes must be a non-empty ascending list")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mux: MuxConfig = field(default_factory=MuxConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    trace_dir: str | None = None
    """Directory for the per-rank JSONL control trace (None = no file)."""
    faults: dict = field(default_factory=dict)
    """Fault injection for tests (see ainfer_pd.faults); empty in production."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for sub in (self.model, self.cache, self.scheduler, self.mux, self.parallel, self.device):
            sub.validate()
        if self.parallel.expert_parallel > 1 and self.model.num_experts % self.parallel.expert_parallel:
            raise TopologyError(f"model.num_experts={self.model.num_experts} is not divisible by "
                                f"expert_parallel={self.parallel.expert_parallel}")
        if self.parallel.atp > 1 and self.model.num_kv_heads % self.parallel.atp:
            raise TopologyError(f"model.num_kv_heads={self.model.num_kv_heads} is not divisible by ATP={self.parallel.atp}")
        if self.parallel.expert_backend == "local" and self.parallel.expert_parallel > 1:
            raise ConfigError("parallel.expert_backend=local cannot run expert_parallel > 1; use torch or deepep")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerConfig":
        return _build(cls, data, "")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "WorkerConfig":
        """The config of a Hugging Face model directory: the model section from its
        ``config.json`` (architecture, sizes, dtype), the rest defaults. ``overrides`` is nested
        like the YAML sections, e.g. ``{"model": {"dtype": "float32"}, "device": {"device": "cpu"}}``."""
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (overrides or {}).items()}
        model = data.setdefault("model", {})
        if not isinstance(model, dict):
            raise ConfigError("overrides['model'] must be a mapping")
        model["path"] = str(model_dir)
        return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "WorkerConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path.name}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"malformed YAML in {path.name}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path.name}: top level must be a mapping")
        data.pop("name", None)
        data.pop("description", None)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **dotted: Any) -> "WorkerConfig":
        """A copy with dotted keys replaced, e.g. ``cfg.replace(**{"scheduler.policy": "normal"})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            node = data
            parts = key.split(".")
            for p in parts[:-1]:
                if p not in node or not isinstance(node[p], dict):
                    raise ConfigError(f"unknown config key {key!r}")
                node = node[p]
            if parts[-1] not in node:
                raise ConfigError(f"unknown config key {key!r}")
            node[parts[-1]] = value
        return WorkerConfig.from_dict(data)


def _positive(obj: Any, *names: str) -> None:
    section = type(obj).__name__.removesuffix("Config").lower()
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{section}.{n} must be a positive integer, got {v!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    if cls is ModelConfig and data.get("path") is not None:
        # model: {path: DIR, ...}: the fields come from DIR/config.json, keys given here override them
        from .hf.config import model_fields
        if not isinstance(data["path"], str):
            raise ConfigError(f"{prefix}path must be a string, got {data['path']!r}")
        data = {**model_fields(data["path"]), **data}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value
