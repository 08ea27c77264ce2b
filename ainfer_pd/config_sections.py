"""The runtime sections of the config: KV cache, scheduler, multiplexing (turnstile),
parallelism and device. The model section is :mod:`.config_model`; the whole config,
its loading and cross-section checks are :mod:`ainfer_pd.config`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .comm.ordering import ORDERINGS  # (its one home)
from .config_checks import check_positive
from .errors import ConfigError, TopologyError, UnsupportedOptionError
from .sched.epoch_mode import POLICIES, policy_traits  # (its one home: the policy traits table)
from .sched.output_reserve import RESERVE_OUTPUT, OutputReserve  # (its one home)
from .sched.span import ACTIVATION_COSTS, FIXED_SPANS, MAX_SPAN, MIN_SPAN  # (their one home)

EXPERT_BACKENDS = ("local", "torch", "deepep")
SPANS = (*(str(k) for k in FIXED_SPANS), "auto", "measured")
P_HOST_PACINGS = ("auto", "layer", "epoch")
KERNEL_BACKENDS = ("auto", "torch", "triton")
KV_DTYPES = ("auto", "fp8_e4m3")
"""``cache.kv_dtype``: ``auto`` the model dtype; ``fp8_e4m3`` FP8 with per-layer K / V scales
(the format: ``engine.attention.kv_fp8``)."""
KV_SCALES = ("auto", "unit", "checkpoint")
"""``cache.kv_scales``: where an FP8 pool's per-layer K / V scales come from (``hf.kv_scales``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int = 0
    """KV blocks per rank. 0 (the default): sized from the device, on CUDA by
    ``gpu_memory_utilization`` or ``gpu_memory_fraction``; on the CPU stand-in 2,048 blocks."""
    gpu_memory_fraction: float = 0.85
    """Fraction of the GPU memory free after this rank's weights the KV cache takes when
    ``num_blocks`` is 0 (and ``gpu_memory_utilization`` is not set)."""
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
    kv_dtype: str = "auto"
    """The KV pool's element type: ``auto`` the model dtype; ``fp8_e4m3`` float8_e4m3fn with one
    float32 scale per layer for K and one for V (kept in a small device tensor, ``cache.kv_scales``
    says where they come from: ``engine/attention/kv_fp8.py``), 1 byte an element: twice the blocks
    in the same memory."""
    kv_scales: str = "auto"
    """Where the FP8 pool's K / V scales come from (``kv_dtype: fp8_e4m3`` only): ``unit`` 1.0
    (vLLM's default without scales); ``checkpoint`` the checkpoint's ``k_scale`` / ``v_scale`` of
    every layer (the names vLLM reads: ``self_attn.k_scale``, ``self_attn.attn.k_scale``, ModelOpt's
    ``self_attn.k_proj.k_scale``, ``self_attn.k_proj.output_scale``, compressed-tensors'
    ``self_attn.kv_scale``; ``hf/kv_scales.py``), a missing one a CheckpointError naming it;
    ``auto`` the checkpoint's when it has them, else 1.0. Either way a weight sync carrying those
    names or ``RolloutWorker.calibrate_kv_scales`` (an amax pass) rewrites them in place."""
    reserve_output: str = "estimate"
    """The KV a turn's output holds (``sched/output_reserve.py``): ``estimate`` (the default, as vLLM
    and SGLang take decode blocks) its blocks taken as it decodes, admission keeping room for
    ``ratio`` x the admitted turns' tokens left (the ratio below), a full pool preempting the
    lowest-priority decoding row (it re-prefills its prompt and output so far, the part still
    cached reused; its tokens are those it would have made); ``all`` its whole ``max_new_tokens``
    from admission on (never preempted): under a trainer's response budget every live turn then
    holds blocks it never writes (H100, grpo-long P1, a 2,048-token budget: twice the prompt tokens
    prefilled again)."""
    output_ratio_init: float = 0.7
    """``estimate``: the expected share of a turn's tokens left that it generates, at start and
    after every preemption."""
    output_ratio_min: float = 0.14
    """``estimate``: where that share decays to while nothing is preempted."""
    output_ratio_decay_iters: int = 600
    """``estimate``: D iterations the decay from init to min takes."""

    @property
    def output_reserve(self) -> OutputReserve:
        return OutputReserve(self.reserve_output, self.output_ratio_init, self.output_ratio_min,
                             self.output_ratio_decay_iters)

    def validate(self) -> None:
        check_positive(self, "block_size")
        if self.kv_dtype not in KV_DTYPES:
            raise UnsupportedOptionError(f"cache.kv_dtype={self.kv_dtype!r}: expected one of {KV_DTYPES} "
                                         "(auto: the model dtype)", key="cache.kv_dtype")
        if self.kv_scales not in KV_SCALES:
            raise UnsupportedOptionError(f"cache.kv_scales={self.kv_scales!r}: expected one of {KV_SCALES}",
                                         key="cache.kv_scales")
        if self.kv_scales == "checkpoint" and self.kv_dtype != "fp8_e4m3":
            raise UnsupportedOptionError(f"cache.kv_scales=checkpoint scales an FP8 KV pool: it needs cache.kv_dtype: "
                                         f"fp8_e4m3 (got {self.kv_dtype!r}, whose pool has no scales)",
                                         key="cache.kv_scales")
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
        if self.reserve_output not in RESERVE_OUTPUT:
            raise UnsupportedOptionError(f"cache.reserve_output={self.reserve_output!r}: expected one of "
                                         f"{RESERVE_OUTPUT}", key="cache.reserve_output")
        if not 0.0 < self.output_ratio_min <= self.output_ratio_init <= 1.0:
            raise ConfigError("cache.output_ratio_min / output_ratio_init must satisfy 0 < min <= init <= 1")
        check_positive(self, "output_ratio_decay_iters")


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
    short_prefill_tokens: int = 0
    """A waiting turn with at most this many prompt tokens left to prefill (its cached prefix not
    counted: e.g. a tool observation on retained KV) goes ahead of the turns not started yet:
    always under critical-path; under fifo only while the next turn to admit needs more KV blocks
    than are free (its admission would evict cached prefixes, the waiting continuations' among
    them: ``sched.priority.short_first_under_pressure``). 0: off."""
    max_live_trajectories: int | str = 0
    """At most this many trajectories in progress at once on a rank (its KV pool's): a new
    trajectory's first turn waits while this many others are in progress (a turn decoding,
    prefilling or waiting, or between turns: admitted once and not released). Continuations are
    never held, and when no trajectory has had a turn for 0.2 s first turns go ahead up to the cap
    (no caller waits for good: ``engine.loop.live_cap``). For a KV pool too
    small for every trajectory's context at once, which otherwise holds them all and evicts their
    contexts in turn (each continuation prefilling its whole context again). 0: no limit; ``auto``:
    as many as the pool holds at the mean final context of the trajectories finished so far on this
    worker (none before 4 have: an RL trainer's later rollouts; ``sched.planner.auto_live_cap``)."""
    overlap_decode: bool | str = "auto"
    """Overlapped D loop (the single-rank engine; not mixed-chunked, not the lockstep engine): D
    iteration n+1 is launched before the host has read iteration n's tokens, which feed it on the
    device; the host reads and books n while n+1 runs (``engine.d_overlap``). A row that ended at n
    (a stop token) runs once more in n+1, unused. Rows with a repetition penalty make the loop wait
    for n first. ``auto``: on wherever the engine runs it (``Engine.runs_overlap_decode``), the plain
    loop elsewhere; ``true`` refuses a configuration that cannot run it; ``false``: the plain loop."""

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy={self.policy!r}: unknown policy, expected one of {POLICIES}")
        check_positive(self, "max_prefill_tokens", "max_decode_batch", "mixed_chunk_tokens", "ttft_bound_tokens")
        m = self.max_live_trajectories
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ConfigError(f"scheduler.max_live_trajectories must be an int >= 0 (0: no limit) or 'auto', got {m!r}")
        if self.short_prefill_tokens < 0:
            raise ConfigError(f"scheduler.short_prefill_tokens must be >= 0 (0: off), got {self.short_prefill_tokens}")
        from .sched.priority import PRIORITIES
        if self.priority not in PRIORITIES:
            raise ConfigError(f"scheduler.priority={self.priority!r}: expected one of {PRIORITIES}")
        if not self.priority_aging_s > 0:
            raise ConfigError("scheduler.priority_aging_s must be > 0")
        if self.overlap_decode not in (True, False, "auto"):
            raise ConfigError(f"scheduler.overlap_decode={self.overlap_decode!r}: expected true, false or auto")
        if self.overlap_decode is True and policy_traits(self.policy).mixed_steps:
            raise ConfigError("scheduler.overlap_decode runs the D loop of the P/D policies; mixed-chunked has "
                              "one loop of its own")


@dataclass(frozen=True, kw_only=True, slots=True)
class MuxConfig:
    span: str = "measured"
    """Turnstile span K: "measured" (from the measured P time per boundary and D iteration time, up
    to ``max_span``), "1".."4" or "auto" (the paper's selector among ``auto_spans``). On the H200's
    48-layer Qwen3 shape (P1, fine-grained) the measured span was 0.984x the best fixed one and
    ``auto`` 1.023x (session 8)."""
    auto_spans: tuple[int, ...] = (1, 2, 3, 4)
    """Spans the ``auto`` policy may choose among."""
    measured_share: float = 1.0
    """measured: P may cross as many boundaries per D round as fit in this share of one D iteration."""
    max_span: int = 32
    """measured: the largest span it may choose (<= sched.span.MAX_SPAN)."""
    activation_threshold: int = 64
    """Multiplexing switches on when at least this many prefill tokens wait while D runs
    (below it a P epoch runs as under ``normal``: no rendezvous, no segmenting)."""
    activation_cooldown_s: float = 0.05
    """Multiplexing stays on this long after concurrent P disappears."""
    activation_cost: str = "none"
    """none | measured. ``measured``: an epoch the activation lets through runs gated only while
    the decode rows it frees outnumber the waiting turns times P's measured slowdown beside D,
    less one (``sched.span.multiplexing_pays``); else exclusively, as under normal (a burst of
    first turns against a few rows: their first tokens are not stretched for little D gain)."""
    exclusive_backlog_tokens: int = 0
    """An epoch runs exclusively (as under normal) while the waiting turns (this epoch's included)
    have more than this many prompt tokens left to prefill (``sched.span.drains_exclusively``); 0:
    off. A burst drains at full P speed, only its tail is multiplexed (the p99 first-token latency
    is the burst's last turns)."""
    exclusive_wait_s: float = 0.0
    """An epoch runs exclusively (as under normal) while the longest-waiting turn (this epoch's
    included) has waited more than this many seconds since it was submitted, its first token not
    yet out (``sched.span.guards_first_token``); 0: off. A bound on first-token latency that acts
    only where it is late: the tail of a burst, a continuation held behind one."""
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
        if not self.auto_spans or any(k not in FIXED_SPANS for k in self.auto_spans):
            raise ConfigError(f"mux.auto_spans must be a non-empty list of spans in {FIXED_SPANS}")
        if self.activation_threshold < 1:
            raise ConfigError("mux.activation_threshold must be >= 1")
        if not 0 < self.measured_share <= 16:
            raise ConfigError("mux.measured_share must be in (0, 16]")
        if isinstance(self.max_span, bool) or not MIN_SPAN <= self.max_span <= MAX_SPAN:
            raise ConfigError(f"mux.max_span must be an integer in {MIN_SPAN}..{MAX_SPAN}")
        if self.activation_cooldown_s < 0:
            raise ConfigError("mux.activation_cooldown_s must be >= 0")
        if isinstance(self.exclusive_backlog_tokens, bool) or self.exclusive_backlog_tokens < 0:
            raise ConfigError(f"mux.exclusive_backlog_tokens must be an integer >= 0 (0: off), "
                              f"got {self.exclusive_backlog_tokens!r}")
        if not (isinstance(self.exclusive_wait_s, (int, float)) and not isinstance(self.exclusive_wait_s, bool)
                and math.isfinite(self.exclusive_wait_s) and self.exclusive_wait_s >= 0):
            raise ConfigError(f"mux.exclusive_wait_s must be a finite number of seconds >= 0 (0: off), "
                              f"got {self.exclusive_wait_s!r}")
        if self.activation_cost not in ACTIVATION_COSTS:
            raise ConfigError(f"mux.activation_cost={self.activation_cost!r}: expected one of {ACTIVATION_COSTS}")


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
    segments, completed requests) for this long -> StallError naming the cross-rank frontier.
    One rank: some stream item unfinished and none completed for this long (a device hang) ->
    DeviceStallError naming each stream's oldest unfinished item."""
    fast_rendezvous: bool = True
    """Use the same-host shared-memory rendezvous when every rank is on one host."""

    def validate(self) -> None:
        check_positive(self, "world_size", "attn_dp", "expert_parallel")
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
    """CPU stand-in: units of the device's collective residency (0 = no limit; ARCHITECTURE.md). A resident
    attention collective keeps its units until every peer joined, as a spinning NCCL kernel keeps its
    SMs; one that does not fit beside the resident ones waits. An attention-TP collective (P's
    all-reduce, D's reduce-scatter / all-gather) takes one unit."""
    dp_collective_slots: int = 1
    """CPU stand-in: the units D's DP-attention all-gather / reduce-scatter (``attn_dp.D``) take. With
    ``collective_slots: 2`` and 2 it fits beside no other collective: P's all-reduce and it, launched
    in opposite orders on crossed ranks, stall for real (the paper's Table 4), while P's and D's
    attention-TP collectives fit together; 1 is the paper's limited residency (no stall)."""
    cuda_graphs: bool = True
    """CUDA: decode by graph replay of batch-size buckets."""
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    graph_max_context: int = 0
    """CUDA: context length the captured decode graphs cover; 0 (the default): the model's whole
    ``max_context_len``, so every decode row replays. A smaller value leaves longer rows to the
    eager, host-bound path (said once at start)."""
    graph_context_tiers: tuple[int, ...] = (2048, 8192)
    """CUDA: context buckets below the covered context, so a batch of short rows replays a graph
    whose decode grid is sized for them, not for the longest row. Lengths are data: any row up to
    its bucket replays it."""
    prefill_graphs: bool = True
    """CUDA: P passes of up to the largest ``prefill_graph_tokens`` tokens replay piecewise CUDA graphs
    (every layer's fixed-shape pieces captured per token bucket; the varlen attention eager), so a short
    continuation's epoch is set by its GPU time, not its launches. Used where P is local (one rank, no
    expert parallelism), with the triton kernels, a 16-bit model and no routing replay; else eager."""
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832,
                                             896, 960, 1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048)
    """CUDA: the P graphs' token buckets (a pass pads to the smallest that fits; longer passes run eagerly).
    A padded row is computed like a real one (its routing sends it to experts), so the spacing is the
    waste: at most 11% of a pass from 512 tokens up, steps of 64 to 1,024 and of 128 to 2,048 (the H100
    at f197768, 11 buckets up to then: a 513-token continuation in the 768 bucket ran 29.6 ms of
    kernels against 20.6 for 512 tokens in the 512 bucket)."""
    high_priority_stream: str = "none"
    """CUDA: none | P | D. The named phase's stream gets the device's highest stream priority,
    so its kernels are scheduled first when both phases have work queued (P: first-token
    latency; D: decode iteration time). Equal priority by default."""
    p_stream_sms: int = 0
    """CUDA: a gated P epoch (P beside D) runs in a green context of this many SMs (0 = the whole
    device): D's kernels beside it always find the other SMs free, and fewer of P's blocks contend
    with D's (H200, Qwen3 shape, 96 of 132: P's device work -12%, its time alone halved, D's work
    about equal); an exclusive epoch (D waits) keeps the whole device. The
    driver rounds it to its SM granularity (8 on Hopper). A green context's stream has no
    priority: not with high_priority_stream=P. Refused off CUDA (the CPU stand-in has no SMs)."""
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
        if isinstance(self.p_stream_sms, bool) or not isinstance(self.p_stream_sms, int) or self.p_stream_sms < 0:
            raise ConfigError(f"device.p_stream_sms must be an integer >= 0, got {self.p_stream_sms!r}")
        if self.p_stream_sms and self.high_priority_stream == "P":
            raise ConfigError("device.p_stream_sms: a green context's stream takes no priority; "
                              "not with device.high_priority_stream=P")
        check_positive(self, "cpu_threads_per_stream", "residency_slots")
        if isinstance(self.graph_max_context, bool) or not isinstance(self.graph_max_context, int) \
                or self.graph_max_context < 0:
            raise ConfigError(f"device.graph_max_context must be an integer >= 0 (0: the model's max_context_len), "
                              f"got {self.graph_max_context!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in self.graph_context_tiers):
            raise ConfigError(f"device.graph_context_tiers must be positive integers, got {self.graph_context_tiers!r}")
        if isinstance(self.collective_slots, bool) or not isinstance(self.collective_slots, int) or self.collective_slots < 0:
            raise ConfigError(f"device.collective_slots must be an integer >= 0, got {self.collective_slots!r}")
        dps = self.dp_collective_slots
        if isinstance(dps, bool) or not isinstance(dps, int) or dps < 1 or (self.collective_slots and
                                                                            dps > self.collective_slots):
            raise ConfigError(f"device.dp_collective_slots must be an integer in [1, collective_slots], got {dps!r}")
        for key in ("attention_backend", "moe_backend"):
            if getattr(self, key) not in KERNEL_BACKENDS:
                raise ConfigError(f"device.{key}={getattr(self, key)!r}: expected one of {KERNEL_BACKENDS}")
        if not self.graph_batch_sizes or sorted(self.graph_batch_sizes) != list(self.graph_batch_sizes):
            raise ConfigError("device.graph_batch_sizes must be a non-empty ascending list")
