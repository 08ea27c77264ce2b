"""DeepEP backend over the real ``deep_ep.Buffer`` V1 API (DeepEP 1.2.x; GPU hosts only).

Shape legend: T = tokens on this rank, k = top-k, H = hidden, E = experts, R = EP ranks,
L = E / R local experts, M = ``num_max_dispatch_tokens_per_rank`` (D), C = M * R.

Ownership (SPEC §3.4; see docs/DEEPEP.md):

- P owns a **normal intranode** ``Buffer(group_P, num_nvl_bytes>0, num_rdma_bytes=0)``: it
  never initialises NVSHMEM; its NVL buffer, host-mapped ``moe_recv_counter``s, 32 MiB
  workspace and comm stream are its own. P's QP slice ``[s, 2s)`` is reserved (intranode
  normal kernels move data over NVLink IPC, not QPs).
- D owns a **low-latency** ``Buffer(group_D, num_rdma_bytes>0, low_latency_mode=True,
  num_qps_per_rank=s)``: the one NVSHMEM initialisation, its RDMA buffer (with the two
  halves selected by the double-buffer index), its counters and workspace, QPs ``[0, s)``.
  ``low_latency_dispatch/combine(..., return_recv_hook=True)`` launch on the caller's (D
  graph) stream, so they are capturable in the D CUDA graph.
- Shared: NVSHMEM runtime + its process-global env vars, ``Buffer.num_sms`` (a class-level
  static), topology, links, weights, KV storage.

**Split at notification with the V1 API.** Upstream normal ``dispatch`` runs the notify
kernel and then busy-polls the host-mapped ``moe_recv_counter`` inside one call, so the
call cannot stop between "peers know the shape" and "data moves". This backend realises the
split without patching DeepEP:

1. ``notify``: ``get_dispatch_layout`` (local) and an async ``all_to_all`` of the
   ``[R, 1 + L]`` per-rank / per-expert counts over P's own process group (P's
   notification: peers learn the dispatch shape; nothing else moves).
2. ``Notified.wait``: the counts wait, on the P task's worker thread (never on the loop).
3. ``dispatch`` (after the turnstile permit): ``Buffer.dispatch(..., num_worst_tokens=R_recv)``
   with the exact receive count from step 2, which skips upstream's CPU busy-poll; the
   device-side notify inside it is a short NVLink barrier all ranks reach in the same
   turnstile round. (An upstream change — exposing ``notify_dispatch`` and a cached-layout
   data launch as two calls — would remove the duplicated counts exchange.)

The module imports ``deep_ep`` lazily; without it every constructor raises
:class:`BackendUnavailableError` pointing to docs/DEEPEP.md. Sizes are validated up front
(:class:`DeepEPConfig`) against the limits of the upstream kernels, cited per constant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ...errors import BackendUnavailableError, ConfigError
from ...phase import Phase
from .base import (BaseDispatcher, Dispatched, DoubleBufferIndex, HostEvent, LifetimeToken,
                   Notified, PhaseDispatchers, RecvCounts, expert_keys, qp_slice)
from .ownership import SHARED, OwnedObject, OwnershipRegistry

# Limits of DeepEP v1.2.1 (upstream source):
INTRANODE_RANKS = (2, 4, 8)
"""csrc/kernels/launch.cuh SWITCH_RANKS: intranode kernels instantiate 2, 4, 8 ranks (not 1)."""
LL_HIDDEN_SIZES = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
"""csrc/kernels/launch.cuh SWITCH_HIDDEN: hidden sizes the low-latency kernels instantiate."""
MAX_TOPK_LOW_LATENCY = 11
"""csrc/kernels/internode_ll.cu: ``kNumMaxTopK = 11`` (dispatch and combine host asserts)."""
MAX_TOPK_NORMAL = 32
"""csrc/kernels/intranode.cu: ``EP_DEVICE_ASSERT(num_topk <= 32)``."""
MAX_LOCAL_EXPERTS_NORMAL = 128
"""csrc/kernels/intranode.cu notify_dispatch: ``num_experts / num_ranks <= kNumThreads (128)``."""
BUFFER_ALIGNMENT_BYTES = 128
"""csrc/kernels/configs.cuh ``NUM_BUFFER_ALIGNMENT_BYTES``."""
WORKSPACE_BYTES = 32 << 20
"""csrc/kernels/configs.cuh ``NUM_WORKSPACE_BYTES``: one workspace per Buffer."""

_DOC = "docs/DEEPEP.md"


def import_deep_ep() -> Any:
    """``import deep_ep`` or a clear :class:`BackendUnavailableError`."""
    try:
        import deep_ep  # noqa: PLC0415 - optional, GPU hosts only
    except ImportError as exc:
        raise BackendUnavailableError(
            "parallel.expert_backend=deepep needs the deep_ep package (DeepEP, built from its "
            f"upstream source with NVSHMEM on a GPU host); see {_DOC} for the install steps, "
            "or use expert_backend=torch") from exc
    return deep_ep


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepEPConfig:
    num_experts: int
    """Routed experts E (global)."""
    hidden: int
    """Hidden size H (must be one of the low-latency kernels' sizes)."""
    top_k: int
    num_ranks: int
    """Intranode EP ranks R: 2, 4 or 8."""
    max_decode_tokens_per_rank: int = 128
    """M = ``num_max_dispatch_tokens_per_rank`` of the D low-latency buffer (same on all ranks)."""
    num_nvl_bytes: int | None = None
    """P normal buffer; None = max of the dispatch / combine ``Config`` hints."""
    num_rdma_bytes: int | None = None
    """D low-latency buffer; None = ``Buffer.get_low_latency_rdma_size_hint``."""
    num_qps_per_rank: int | None = None
    """s: D's QPs per peer; upstream low-latency mode wants it equal to L (default)."""
    decode_use_fp8: bool = False
    allow_nvlink_for_low_latency_mode: bool = True

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def qps_per_rank(self) -> int:
        return self.num_qps_per_rank if self.num_qps_per_rank is not None else self.num_local_experts

    def qp_range(self, phase: Phase) -> tuple[int, int]:
        """D ``[0, s)``, P ``[s, 2s)``."""
        return qp_slice(phase, self.qps_per_rank)

    def validate(self) -> None:
        if self.num_ranks not in INTRANODE_RANKS:
            raise ConfigError(f"DeepEP intranode kernels support 2, 4 or 8 ranks, got num_ranks="
                              f"{self.num_ranks} (use expert_backend=torch or local for 1)")
        if self.hidden < 1 or self.hidden % 128:
            raise ConfigError(f"DeepEP hidden={self.hidden} must be a positive multiple of 128")
        if self.hidden not in LL_HIDDEN_SIZES:
            raise ConfigError(f"DeepEP low-latency kernels support hidden in {LL_HIDDEN_SIZES}, "
                              f"got hidden={self.hidden}")
        if not 1 <= self.top_k <= min(MAX_TOPK_LOW_LATENCY, MAX_TOPK_NORMAL):
            raise ConfigError(f"DeepEP top_k={self.top_k} outside [1, {MAX_TOPK_LOW_LATENCY}] "
                              f"(low-latency <= {MAX_TOPK_LOW_LATENCY}, normal <= {MAX_TOPK_NORMAL})")
        if self.num_experts < self.num_ranks or self.num_experts % self.num_ranks:
            raise ConfigError(f"DeepEP num_experts={self.num_experts} is not divisible by "
                              f"the EP ranks ({self.num_ranks})")
        if self.num_local_experts > MAX_LOCAL_EXPERTS_NORMAL:
            raise ConfigError(f"DeepEP normal dispatch supports <= {MAX_LOCAL_EXPERTS_NORMAL} local experts "
                              f"per rank, got {self.num_local_experts}")
        if self.max_decode_tokens_per_rank < 1:
            raise ConfigError("DeepEP max_decode_tokens_per_rank must be >= 1")
        for name in ("num_nvl_bytes", "num_rdma_bytes"):
            v = getattr(self, name)
            if v is not None and (v <= 0 or v % BUFFER_ALIGNMENT_BYTES):
                raise ConfigError(f"DeepEP {name}={v} must be a positive multiple of "
                                  f"{BUFFER_ALIGNMENT_BYTES} bytes")
        if self.num_qps_per_rank is not None and self.num_qps_per_rank != self.num_local_experts:
            raise ConfigError(f"DeepEP low-latency mode needs num_qps_per_rank == local experts "
                              f"({self.num_local_experts}), got {self.num_qps_per_rank}")


CountsExchange = Callable[[Tensor], tuple[Callable[[], bool], Callable[[], Tensor]]]
"""``exchange(send [R, 1 + L] int64) -> (ready(), wait() -> recv [R, 1 + L])``."""


def torch_counts_exchange(group: Any) -> CountsExchange:
    """P's notification over P's own process group (async ``all_to_all_single``)."""
    import torch.distributed as dist

    def exchange(send: Tensor):
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)

        def wait() -> Tensor:
            work.wait()
            return recv
        return work.is_completed, wait
    return exchange


def _round_up(v: int, a: int = BUFFER_ALIGNMENT_BYTES) -> int:
    return int(math.ceil(v / a) * a)


def _stream_identity(s: Any) -> int:
    raw = getattr(s, "cuda_stream", None)
    return int(raw) if raw else id(s)


def _make_event() -> Any:
    if torch.cuda.is_available():  # pragma: no cover - GPU host only
        return torch.cuda.Event()
    return HostEvent("deepep-event")


class _DeepEPBase(BaseDispatcher):
    backend = "deepep"

    def __init__(self, phase: Phase, group: Any, cfg: DeepEPConfig, *, deep_ep: Any,
                 recorder: Any) -> None:
        cfg.validate()
        if group is None or group.size() != cfg.num_ranks:
            raise ConfigError(f"DeepEP group size {None if group is None else group.size()} != "
                              f"num_ranks={cfg.num_ranks}")
        super().__init__(phase, num_experts=cfg.num_experts, ep_rank=group.rank(),
                         ep_size=cfg.num_ranks, recorder=recorder)
        self.cfg = cfg
        self.group = group
        self.deep_ep = deep_ep if deep_ep is not None else import_deep_ep()
        self.buffer: Any = None

    def _register_buffer(self, buffer_name: str, nbytes: int, use_rdma: bool,
                         stream: Any, events: dict[str, Any]) -> None:
        ph, tag, reg = self.phase, f"{self.phase.value}.deepep", self._owned
        raw = self.buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=use_rdma)
        start = raw.data_ptr()
        reg.register("buffer", f"{tag}.{buffer_name}", ph, identity=start,
                     address_range=(start, start + nbytes), size_bytes=nbytes)
        rt = self.buffer.runtime
        reg.register("counters", f"{tag}.moe_recv_counters", ph, identity=id(rt) ^ 0xC0,
                     size_bytes=8 + 4 * 1024 + 4, note="host-mapped, inside this Buffer's runtime")
        reg.register("workspace", f"{tag}.workspace", ph, identity=id(rt) ^ 0x3E,
                     size_bytes=WORKSPACE_BYTES, note="cudaMalloc'd by this Buffer's runtime")
        reg.register("stream", f"{tag}.stream", ph, stream, identity=_stream_identity(stream))
        for n, ev in events.items():
            reg.register("events", f"{tag}.{n}", ph, ev)
        reg.register("qp_range", f"{tag}.qp_range", ph, identity=id(self) ^ 0x9E37,
                     qp_range=self.cfg.qp_range(ph),
                     note=("reserved: intranode normal kernels use NVLink IPC, not QPs"
                           if ph is Phase.PREFILL else "NVSHMEM_IBGDA_NUM_RC_PER_PE = s"))
        reg.register("process_group", f"{tag}.group", ph, self.group)

    def close(self) -> None:
        """Release the Buffer (created with ``explicitly_destroy=True``)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


class DeepEPNormalDispatcher(_DeepEPBase):
    """P: the normal (high-throughput) intranode path, split at the notification."""

    def __init__(self, group: Any, cfg: DeepEPConfig, *, deep_ep: Any = None,
                 counts_exchange: CountsExchange | None = None, recorder: Any = None) -> None:
        super().__init__(Phase.PREFILL, group, cfg, deep_ep=deep_ep, recorder=recorder)
        Buffer, R = self.deep_ep.Buffer, cfg.num_ranks
        self.dispatch_config = Buffer.get_dispatch_config(R)
        self.combine_config = Buffer.get_combine_config(R)
        nvl = cfg.num_nvl_bytes
        if nvl is None:
            hidden_bytes = cfg.hidden * 2   # bf16
            nvl = _round_up(max(c.get_nvl_buffer_size_hint(hidden_bytes, R)
                                for c in (self.dispatch_config, self.combine_config)))
        self.num_nvl_bytes = nvl
        # NOTE: num_rdma_bytes=0 + low_latency_mode=False: this Buffer never touches NVSHMEM.
        self.buffer = Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=0, low_latency_mode=False,
                             num_qps_per_rank=1, explicitly_destroy=True)
        self._exchange = counts_exchange if counts_exchange is not None else torch_counts_exchange(group)
        self.stream = self.buffer.get_comm_stream()
        self.events = {"notify_done": _make_event(), "combine_done": _make_event()}
        self._register_buffer("nvl_buffer", nvl, False, self.stream, self.events)

    def _notify_impl(self, topk_idx: Tensor, seq: int,
                     tokens: tuple[LifetimeToken, ...]) -> Notified:
        R, L = self.ep_size, self.num_local_experts
        if topk_idx.shape[1] != self.cfg.top_k:
            raise ConfigError(f"topk_idx has k={topk_idx.shape[1]}, config top_k={self.cfg.top_k}")
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.num_experts, previous_event=None, async_finish=False,
            allocate_on_comm_stream=False)
        send = torch.cat([per_rank.view(R, 1), per_expert.view(R, L)], 1).to(torch.int64)  # [R, 1+L]
        ready, wait_recv = self._exchange(send)

        def wait() -> RecvCounts:
            recv = wait_recv().tolist()                                   # [R][1 + L] host
            return RecvCounts(per_expert=tuple(sum(r[1 + l] for r in recv) for l in range(L)),
                              per_source=tuple(r[0] for r in recv))

        notified = Notified(self, seq, tokens, topk_idx.shape[0], ready=ready, wait=wait)
        notified.impl.update(per_rank=per_rank, per_expert=per_expert, in_rank=in_rank)
        return notified

    def _dispatch_impl(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> Dispatched:
        if x.dtype != torch.bfloat16:
            raise ConfigError(f"DeepEP normal dispatch takes bf16 activations, got {x.dtype}")
        num_recv_tokens = sum(notified.counts.per_source)   # tokens (deduped per rank)
        lay = notified.impl
        recv_x, recv_idx, recv_w, _, handle, _ = self.buffer.dispatch(
            x, handle=None, num_tokens_per_rank=lay["per_rank"], num_tokens_per_rdma_rank=None,
            is_token_in_rank=lay["in_rank"], num_tokens_per_expert=lay["per_expert"],
            topk_idx=topk_idx, topk_weights=topk_weights.float(), expert_alignment=1,
            num_worst_tokens=num_recv_tokens, config=self.dispatch_config,
            previous_event=None, async_finish=False, allocate_on_comm_stream=False)
        # local grouping of the received tokens by local expert (recv_idx: local ids, -1 = other rank)
        Rn, k = recv_idx.shape
        L = self.num_local_experts
        keys = expert_keys(recv_idx, L)                                     # [Rn*k]
        counts = torch.zeros(L + 1, dtype=torch.int64, device=keys.device)
        counts.scatter_add_(0, keys, torch.ones_like(keys))
        order = torch.sort(keys, stable=True).indices
        n_valid = Rn * k - int(counts[L])   # host sync: fine on the eager P path
        grouped = recv_x.index_select(0, torch.div(order[:n_valid], k, rounding_mode="floor"))
        return Dispatched(notified, grouped, counts[:L],
                          impl=dict(handle=handle, order=order, n_valid=n_valid, Rn=Rn, k=k,
                                    recv_w=recv_w, valid=recv_idx >= 0))

    def _combine_impl(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:
        im = dispatched.impl
        Rn, k, H = im["Rn"], im["k"], expert_out.shape[-1]
        pairs = expert_out.new_zeros(Rn * k, H)
        pairs.index_copy_(0, im["order"][: im["n_valid"]], expert_out)
        w = torch.where(im["valid"], im["recv_w"], 0).to(expert_out.dtype)   # [Rn, k]
        reduced = (pairs.view(Rn, k, H) * w.unsqueeze(-1)).sum(1)           # [Rn, H]
        # upstream combine adds (without weights) the per-rank partial sums back to their tokens
        combined, _, _ = self.buffer.combine(reduced, im["handle"], topk_weights=None,
                                             config=self.combine_config, previous_event=None,
                                             async_finish=False, allocate_on_comm_stream=False)
        return combined


class DeepEPLowLatencyDispatcher(_DeepEPBase):
    """D: the low-latency path (IBGDA/NVLink), capturable in the D CUDA graph."""

    needs_host_counts = False

    def __init__(self, group: Any, cfg: DeepEPConfig, *, deep_ep: Any = None,
                 stream: Any = None, recorder: Any = None) -> None:
        super().__init__(Phase.DECODE, group, cfg, deep_ep=deep_ep, recorder=recorder)
        Buffer, R, M = self.deep_ep.Buffer, cfg.num_ranks, cfg.max_decode_tokens_per_rank
        rdma = cfg.num_rdma_bytes
        if rdma is None:
            rdma = _round_up(Buffer.get_low_latency_rdma_size_hint(M, cfg.hidden, R, cfg.num_experts))
        self.num_rdma_bytes = rdma
        # NOTE: the one NVSHMEM initialisation of the process happens here.
        self.buffer = Buffer(group, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                             num_qps_per_rank=cfg.qps_per_rank,
                             allow_nvlink_for_low_latency_mode=cfg.allow_nvlink_for_low_latency_mode,
                             explicitly_destroy=True)
        # hook mode launches on the caller's stream: the D graph stream
        if stream is None:
            stream = torch.cuda.Stream() if torch.cuda.is_available() else object()
        self.stream = stream
        self.events = {"graph_done": _make_event(), "combine_done": _make_event()}
        self._dbi = DoubleBufferIndex()   # mirrors the runtime's low_latency_buffer_idx
        self._register_buffer("rdma_buffer", rdma, True, stream, self.events)
        self._owned.register("double_buffer_index", "D.deepep.double_buffer_index", Phase.DECODE,
                             self._dbi, note="mirror of Buffer.low_latency_buffer_idx (flips per call)")

    def _notify_impl(self, topk_idx: Tensor, seq: int,
                     tokens: tuple[LifetimeToken, ...]) -> Notified:
        T = topk_idx.shape[0]
        M, R, L = self.cfg.max_decode_tokens_per_rank, self.ep_size, self.num_local_experts
        if T > M or topk_idx.shape[1] != self.cfg.top_k:
            raise ConfigError(f"D dispatch of [{T}, {topk_idx.shape[1]}] exceeds "
                              f"max_decode_tokens_per_rank={M} / top_k={self.cfg.top_k}")
        # The low-latency kernels send counts with the data (no host notification): the
        # shape is static, C = M * R rows per local expert.
        counts = RecvCounts(per_expert=(M * R,) * L, per_source=(M,) * R, exact=False)
        return Notified(self, seq, tokens, T, ready=lambda: True, wait=lambda: counts)

    def _dispatch_impl(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> Dispatched:
        if x.dtype != torch.bfloat16:
            raise ConfigError(f"DeepEP low-latency dispatch takes bf16 activations, got {x.dtype}")
        cfg = self.cfg
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, cfg.max_decode_tokens_per_rank, cfg.num_experts,
            use_fp8=cfg.decode_use_fp8, async_finish=False, return_recv_hook=True)
        self._dbi.flip()
        hook()   # data arrival (inside the D graph; callers may overlap work before it)
        return Dispatched(notified, recv_x, recv_count, layout="masked",
                          impl=dict(handle=handle, topk_idx=topk_idx, topk_weights=topk_weights.float()))

    def _combine_impl(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:
        im = dispatched.impl
        combined, _, hook = self.buffer.low_latency_combine(
            expert_out, im["topk_idx"], im["topk_weights"], im["handle"],
            async_finish=False, return_recv_hook=True)
        self._dbi.flip()
        hook()
        return combined

    def _drain_impl(self) -> None:
        """After a cancelled D dispatch the low-latency buffer may be mid-protocol: upstream
        requires ``clean_low_latency_buffer`` before the next low-latency kernel (collective:
        every D rank reaches this quiescent point)."""
        if self.state.value == "retired":
            cfg = self.cfg
            self.buffer.clean_low_latency_buffer(cfg.max_decode_tokens_per_rank, cfg.hidden,
                                                 cfg.num_experts)


def make_deepep_dispatchers(p_group: Any, d_group: Any, cfg: DeepEPConfig, *,
                            deep_ep: Any = None, d_stream: Any = None,
                            recorder: Any = None) -> PhaseDispatchers:
    """P normal intranode Buffer (no NVSHMEM) + D low-latency Buffer (the one NVSHMEM init)."""
    cfg.validate()
    if p_group is d_group:
        raise ConfigError("P and D need their own process groups (phase-owned communicators)")
    de = deep_ep if deep_ep is not None else import_deep_ep()
    p = DeepEPNormalDispatcher(p_group, cfg, deep_ep=de, recorder=recorder)
    d = DeepEPLowLatencyDispatcher(d_group, cfg, deep_ep=de, stream=d_stream, recorder=recorder)
    return PhaseDispatchers(p, d)


def deepep_shared_objects(deep_ep: Any) -> list[OwnedObject]:
    """What both phases share by design: the NVSHMEM runtime (+ process-global env) and
    the class-level ``Buffer.num_sms``."""
    reg = OwnershipRegistry()
    reg.register("runtime", "nvshmem runtime + NVSHMEM_* env (process-global)", SHARED,
                 identity=hash("nvshmem-runtime"))
    reg.register("runtime", "deep_ep.Buffer.num_sms (class static)", SHARED, deep_ep.Buffer)
    return list(reg.objects)


# ---- multi-GPU check: concurrent normal (P) + low-latency (D), then the audit -------------------
def _main(argv: list[str] | None = None) -> None:  # pragma: no cover - needs >= 2 GPUs + deep_ep
    """``torchrun --standalone --nproc-per-node 8 -m ainfer_pd.comm.experts.deepep ...``"""
    import argparse
    import json
    import os
    import threading

    import torch.distributed as dist
    import torch.nn.functional as F

    from .local import LocalDispatcher

    ap = argparse.ArgumentParser(description="DeepEP P normal + D low-latency, concurrently")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--p-tokens", type=int, default=4096)
    ap.add_argument("--d-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--audit-json", default=None)
    args = ap.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, R = dist.get_rank(), dist.get_world_size()
    p_group, d_group = dist.new_group(backend="nccl"), dist.new_group(backend="nccl")
    cfg = DeepEPConfig(num_experts=args.num_experts, hidden=args.hidden, top_k=args.top_k,
                       num_ranks=R, max_decode_tokens_per_rank=args.d_tokens)
    de = import_deep_ep()
    p_stream, d_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    pd = make_deepep_dispatchers(p_group, d_group, cfg, deep_ep=de, d_stream=d_stream)
    E, H, I, K, L = cfg.num_experts, cfg.hidden, args.inter, cfg.top_k, cfg.num_local_experts
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, H, 2 * I, generator=g) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    lo = rank * L

    def swiglu(h, e):
        a, b = (h @ w13[e]).chunk(2, -1)
        return (F.silu(a) * b) @ w2[e]

    def grouped(first):                       # rows sorted by local expert, counts [L]
        def fn(xg, counts):
            out, s = torch.zeros_like(xg), 0
            for l, c in enumerate(counts.tolist()):
                if c:
                    out[s:s + c] = swiglu(xg[s:s + c], first + l)
                    s += c
            return out
        return fn

    def masked(xm, counts):                   # DeepEP low-latency [L, C, H]
        out = torch.zeros_like(xm)
        for l, c in enumerate(counts.tolist()):
            if c:
                out[l, :c] = swiglu(xm[l, :c], lo + l)
        return out

    def batch(T, seed):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=gg).to(dev, torch.bfloat16)
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=gg), -1), K, -1)
        return x, idx.to(dev), (w / w.sum(-1, keepdim=True)).to(dev)

    errors: dict[str, list] = {"P": [], "D": []}

    def loop(phase: Phase, T: int, stream: Any, fn: Any) -> None:
        disp = pd.get(phase)
        # the EP = 1 reference of this thread (its own buffers: the threads' streams overlap)
        ref_disp = LocalDispatcher(phase, E, hidden=H, top_k=K, max_tokens=T,
                                   dtype=torch.bfloat16, device=dev)
        try:
            with torch.cuda.stream(stream):
                for i in range(args.iters):
                    x, idx, w = batch(T, 1000 * rank + 2 * i + (phase is Phase.DECODE))
                    out = disp.run_moe(x, idx, w, fn)
                    ref = ref_disp.run_moe(x, idx, w, grouped(0))
                    ok = torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
                    errors[phase.value].append(None if ok else float((out.float() - ref.float()).abs().max()))
        except BaseException as exc:
            errors[phase.value].append(repr(exc))

    threads = [threading.Thread(target=loop, args=(Phase.PREFILL, args.p_tokens, p_stream, grouped(lo))),
               threading.Thread(target=loop, args=(Phase.DECODE, args.d_tokens, d_stream, masked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    bad = {k: [e for e in v if e is not None] for k, v in errors.items()}
    report = pd.registry(deepep_shared_objects(de)).audit()
    summary = {"rank": rank, "iters": {k: len(v) for k, v in errors.items()}, "failures": bad,
               "audit": report.to_dict()}
    gathered: list[Any] = [None] * R
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        ok = all(not s["failures"]["P"] and not s["failures"]["D"] and s["audit"]["ok"] for s in gathered)
        print(json.dumps({"ok": ok, "ranks": [{k: v for k, v in s.items() if k != "audit"}
                                               | {"audit_ok": s["audit"]["ok"]} for s in gathered]}, indent=1))
        if args.audit_json:
            with open(args.audit_json, "w") as f:
                json.dump(gathered, f, indent=1)
    pd.prefill.close()
    pd.decode.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    _main()
