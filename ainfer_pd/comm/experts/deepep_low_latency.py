"""D's DeepEP path: the low-latency ``Buffer`` (IBGDA / NVLink, the process's one NVSHMEM
initialisation), launched in hook mode on the D graph stream so it is CUDA-graph capturable."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from ...phase import Phase
from .base import Dispatched, DoubleBufferIndex, LifetimeToken, Notified, RecvCounts
from .deepep_buffer import DeepEPConfig, DeepEPDispatcherBase, deepep_event, round_up_bytes

class DeepEPLowLatencyDispatcher(DeepEPDispatcherBase):
    """D: the low-latency path (IBGDA/NVLink), capturable in the D CUDA graph."""

    needs_host_counts = False

    def __init__(self, group: Any, cfg: DeepEPConfig, *, deep_ep: Any = None,
                 stream: Any = None, recorder: Any = None) -> None:
        super().__init__(Phase.DECODE, group, cfg, deep_ep=deep_ep, recorder=recorder)
        Buffer, R, M = self.deep_ep.Buffer, cfg.num_ranks, cfg.max_decode_tokens_per_rank
        rdma = cfg.num_rdma_bytes
        if rdma is None:
            rdma = round_up_bytes(Buffer.get_low_latency_rdma_size_hint(M, cfg.hidden, R, cfg.num_experts))
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
        self.events = {"graph_done": deepep_event(), "combine_done": deepep_event()}
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
