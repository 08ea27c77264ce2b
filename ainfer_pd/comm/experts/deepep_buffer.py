"""The DeepEP backend's common part: the upstream limits, :class:`DeepEPConfig`, the lazy
``deep_ep`` import, and :class:`DeepEPDispatcherBase` - one phase's ``deep_ep.Buffer`` and the
ownership registration of everything it holds (buffer, counters, workspace, stream, events,
QP slice, process group). See :mod:`.deepep` for the P / D ownership split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BackendUnavailableError, ConfigError
from ...phase import Phase
from .base import BaseDispatcher, make_event, qp_slice

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


def round_up_bytes(v: int, a: int = BUFFER_ALIGNMENT_BYTES) -> int:
    return int(math.ceil(v / a) * a)


def _stream_identity(s: Any) -> int:
    raw = getattr(s, "cuda_stream", None)
    return int(raw) if raw else id(s)


def deepep_event() -> Any:
    """A CUDA event on a GPU host, its host stand-in elsewhere (the fake-``deep_ep`` tests)."""
    return make_event(torch.device("cuda" if torch.cuda.is_available() else "cpu"), "deepep-event")


class DeepEPDispatcherBase(BaseDispatcher):
    """One phase's ``deep_ep.Buffer`` on its own process group, and the registration of
    everything the Buffer holds as that phase's (subclasses create the Buffer)."""

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
        # NOTE: the counters and workspace live inside the runtime: their identities derive from
        # it (the same runtime in both phases collides, as it should) by hashing, not by XOR-ing
        # a constant into its address: ``id(rt) ^ 0xC0`` could be the address of another live
        # object (with the fake ``deep_ep`` it was the D stream stand-in: a false violation).
        reg.register("counters", f"{tag}.moe_recv_counters", ph, identity=hash(("counters", id(rt))),
                     size_bytes=8 + 4 * 1024 + 4, note="host-mapped, inside this Buffer's runtime")
        reg.register("workspace", f"{tag}.workspace", ph, identity=hash(("workspace", id(rt))),
                     size_bytes=WORKSPACE_BYTES, note="cudaMalloc'd by this Buffer's runtime")
        reg.register("stream", f"{tag}.stream", ph, stream, identity=_stream_identity(stream))
        for n, ev in events.items():
            reg.register("events", f"{tag}.{n}", ph, ev)
        reg.register("qp_range", f"{tag}.qp_range", ph, identity=hash(("qp_range", id(self))),
                     qp_range=self.cfg.qp_range(ph),
                     note=("reserved: intranode normal kernels use NVLink IPC, not QPs"
                           if ph is Phase.PREFILL else "NVSHMEM_IBGDA_NUM_RC_PER_PE = s"))
        reg.register("process_group", f"{tag}.group", ph, self.group)

    def close(self) -> None:
        """Release the Buffer (created with ``explicitly_destroy=True``)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None
