"""P's DeepEP path: the normal (high-throughput) intranode ``Buffer``, split at the
notification (:mod:`.deepep` explains the split with the V1 API)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ...errors import ConfigError
from ...phase import Phase
from .base import Dispatched, LifetimeToken, Notified, RecvCounts, expert_keys
from .deepep_buffer import DeepEPConfig, DeepEPDispatcherBase, deepep_event, round_up_bytes

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


class DeepEPNormalDispatcher(DeepEPDispatcherBase):
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
            nvl = round_up_bytes(max(c.get_nvl_buffer_size_hint(hidden_bytes, R)
                                for c in (self.dispatch_config, self.combine_config)))
        self.num_nvl_bytes = nvl
        # NOTE: num_rdma_bytes=0 + low_latency_mode=False: this Buffer never touches NVSHMEM.
        self.buffer = Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=0, low_latency_mode=False,
                             num_qps_per_rank=1, explicitly_destroy=True)
        self._exchange = counts_exchange if counts_exchange is not None else torch_counts_exchange(group)
        self.stream = self.buffer.get_comm_stream()
        self.events = {"notify_done": deepep_event(), "combine_done": deepep_event()}
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
