"""World size 1 / no expert parallelism: local routing only.

Shape legend: T = tokens, k = top-k, D = hidden, E = experts (all local), N = T * k rows.

dispatch = a permutation grouping the N rows by expert; counts come from ``scatter_add_``
into a fixed-size tensor and the order from a stable sort, so nothing syncs the host and
the D path stays CUDA-graph capturable. Buffers are phase-owned and preallocated (stable
addresses for the graph). ``-1`` in ``topk_idx`` (no selection) sorts last and adds zero.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from ...phase import Phase
from .base import (BaseDispatcher, Dispatched, DoubleBufferIndex, LifetimeToken, Notified,
                   RecvCounts, expert_keys, make_event, make_stream, qp_slice)


class LocalDispatcher(BaseDispatcher):
    backend = "local"
    needs_host_counts = False

    def __init__(self, phase: Phase, num_experts: int, *, hidden: int, top_k: int,
                 max_tokens: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", stream: Any = None,
                 recorder: Any = None, num_qps: int = 1) -> None:
        super().__init__(phase, num_experts=num_experts, ep_rank=0, ep_size=1, recorder=recorder)
        if hidden < 1 or top_k < 1 or max_tokens < 1 or top_k > num_experts:
            raise ConfigError(f"bad local dispatcher sizes: hidden={hidden} top_k={top_k} "
                              f"max_tokens={max_tokens} num_experts={num_experts}")
        dev = torch.device(device)
        self.hidden, self.top_k, self.max_tokens, self.dtype, self.device = hidden, top_k, max_tokens, dtype, dev
        rows = max_tokens * top_k
        tag = phase.value
        # counters: per-expert counts, plus a bucket (index E) collecting -1 selections
        self._counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
        # workspace
        self._ones = torch.ones(rows, dtype=torch.int64, device=dev)
        self._sorted = torch.empty(rows, dtype=torch.int64, device=dev)
        self._order = torch.empty(rows, dtype=torch.int64, device=dev)
        self._tok = torch.empty(rows, dtype=torch.int64, device=dev)
        # buffers: D double-buffers its grouped rows (like DeepEP low-latency)
        self._dbi = DoubleBufferIndex() if phase is Phase.DECODE else None
        num_sets = 2 if self._dbi is not None else 1
        self._grouped = [torch.empty(rows, hidden, dtype=dtype, device=dev) for _ in range(num_sets)]
        self._pairs = torch.empty(rows, hidden, dtype=dtype, device=dev)
        self.stream = stream if stream is not None else make_stream(dev, f"{tag}-expert-stream")
        self.events = {n: make_event(dev, f"{tag}-{n}") for n in ("notify_done", "combine_done")}

        reg = self._owned
        reg.register("counters", f"{tag}.local.counts", phase, self._counts)
        for name, t in (("ones", self._ones), ("sorted_keys", self._sorted),
                        ("order", self._order), ("token_of_row", self._tok)):
            reg.register("workspace", f"{tag}.local.{name}", phase, t)
        for i, t in enumerate(self._grouped):
            reg.register("buffer", f"{tag}.local.grouped[{i}]", phase, t)
        reg.register("buffer", f"{tag}.local.pairs", phase, self._pairs)
        reg.register("stream", f"{tag}.stream", phase, self.stream)
        for n, ev in self.events.items():
            reg.register("events", f"{tag}.{n}", phase, ev)
        reg.register("qp_range", f"{tag}.qp_range", phase, identity=id(self) ^ 0x9E37,
                     qp_range=qp_slice(phase, num_qps),
                     note="logical slice: the local path uses no transport QPs")
        if self._dbi is not None:
            reg.register("double_buffer_index", f"{tag}.double_buffer_index", phase, self._dbi)

    @property
    def counts(self) -> Tensor:
        """[E] rows per expert of the current dispatch (phase-owned counter)."""
        return self._counts[: self.num_experts]

    def _notify_impl(self, topk_idx: Tensor, seq: int,
                     tokens: tuple[LifetimeToken, ...]) -> Notified:
        T, k = topk_idx.shape
        if T > self.max_tokens or k != self.top_k:
            raise ConfigError(f"{self.phase.value} local dispatch of [{T}, {k}] exceeds "
                              f"max_tokens={self.max_tokens} / top_k={self.top_k}")
        n = T * k
        keys = expert_keys(topk_idx, self.num_experts)                    # [N]
        self._counts.zero_()
        self._counts.scatter_add_(0, keys, self._ones[:n])                 # [E + 1]
        torch.sort(keys, stable=True, out=(self._sorted[:n], self._order[:n]))
        torch.div(self._order[:n], k, rounding_mode="floor", out=self._tok[:n])
        _record(self.events["notify_done"])
        counts = self.counts

        def wait() -> RecvCounts:
            per_expert = tuple(int(c) for c in counts.tolist())
            return RecvCounts(per_expert=per_expert, per_source=(sum(per_expert),))

        notified = Notified(self, seq, tokens, T, ready=lambda: True, wait=wait)
        notified.impl.update(n=n, T=T)
        return notified

    def _dispatch_impl(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> Dispatched:
        n = notified.impl["n"]
        buf = self._grouped[self._dbi.flip() if self._dbi is not None else 0]
        grouped = buf[:n]
        torch.index_select(x, 0, self._tok[:n], out=grouped)               # [N, D]
        return Dispatched(notified, grouped, self.counts,
                          impl={"w": topk_weights.to(self.dtype), "valid": topk_idx >= 0})

    def _combine_impl(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:
        n, T = dispatched.notified.impl["n"], dispatched.notified.impl["T"]
        pairs = self._pairs[:n]
        pairs.index_copy_(0, self._order[:n], expert_out[:n])              # back to (token, slot) order
        y = pairs.view(T, self.top_k, self.hidden)                          # [T, k, D]
        w, valid = dispatched.impl["w"], dispatched.impl["valid"]           # [T, k]
        out = torch.where(valid.unsqueeze(-1), y * w.unsqueeze(-1), 0).sum(1)  # [T, D]
        _record(self.events["combine_done"])
        return out


def _record(ev: Any) -> None:
    if hasattr(ev, "record"):
        ev.record()
