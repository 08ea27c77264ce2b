"""Routing replay (issue 15, verl's ``enable_rollout_routing_replay`` / R3): every token's top-k
expert ids, kept beside its KV.

With ``cache.routed_experts`` the runner allocates one int16 buffer ``[moe_layers, S, top_k]`` (S =
the KV pool's slots, scratch block included) and every forward pass writes, for each MoE layer,
the router's choice of each token it feeds into that token's KV slot (``index_copy_`` with the
pass's ``write_slots``: no host sync, inside a captured decode graph too). A turn that asked for
them (``SamplingParams(return_routed_experts=True)``) gathers its sequence's slots once, when it
ends: ``TurnOutput.routed_experts`` is an int16 CPU tensor ``[n, moe_layers, top_k]``, row ``p`` the
ids of the token at position ``p`` of ``prompt + token_ids``, for every position a pass fed: ``n
= len(prompt) + len(token_ids) - 1`` (the last generated token was sampled, never fed), fewer for
an aborted turn (what its completed passes computed). The last ``len(token_ids)`` rows are the
passes that produced the generated tokens, so verl's partial-rollout merge
(``routed_experts[-len(token_ids):]``) stays contiguous. A shared prefix (prefix sharing, a
retained context) carries the ids its writer computed: the same prefix routes the same way.

Without ``cache.routed_experts`` nothing is allocated and the forward is unchanged (the model's
``routing_sink`` is None).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...config import ModelConfig


class RoutedExpertsCache:
    """The per-slot expert ids of one rank's KV pool (see the module docstring)."""

    def __init__(self, mc: ModelConfig, num_slots: int, device: torch.device) -> None:
        self.moe_layers = [i for i in range(mc.num_layers) if mc.is_moe_layer(i)]
        self._index = {layer: j for j, layer in enumerate(self.moe_layers)}
        self.top_k = mc.top_k
        self.num_slots = num_slots
        self.device = device
        self.buf: Tensor | None = None
        if mc.num_experts > torch.iinfo(torch.int16).max:
            raise ValueError(f"{mc.num_experts} experts do not fit int16 expert ids")

    def allocate(self) -> None:
        """(Re)allocate the buffer, zeroed (with the KV pool: at start and after ``wake_up``)."""
        self.buf = torch.zeros(len(self.moe_layers), self.num_slots, self.top_k, dtype=torch.int16,
                               device=self.device)

    def release(self) -> None:
        """Give the buffer back (with the KV pool: ``sleep``); passes refuse to run until allocate()."""
        self.buf = None

    @property
    def nbytes(self) -> int:
        return len(self.moe_layers) * self.num_slots * self.top_k * 2

    def record(self, layer: int, slots: Tensor, topk_idx: Tensor) -> None:
        """A pass fed tokens into KV ``slots`` [T] and layer ``layer`` chose ``topk_idx`` [T, k]."""
        buf = self.buf
        if buf is None:
            raise RuntimeError("routed-experts buffer released (the worker is asleep)")
        if slots.shape[0] != topk_idx.shape[0]:
            raise RuntimeError(f"layer {layer}: {topk_idx.shape[0]} routed tokens for {slots.shape[0]} KV slots")
        buf[self._index[layer]].index_copy_(0, slots, topk_idx.to(torch.int16))

    def gather(self, slots: Tensor) -> Tensor:
        """The ids of KV ``slots`` [n] (host int64): an int16 CPU tensor [n, moe_layers, top_k]. One
        device-to-host copy (the slots' passes completed: the engine saw their results)."""
        assert self.buf is not None
        idx = slots.to(self.buf.device)
        return self.buf.index_select(1, idx).permute(1, 0, 2).contiguous().cpu()


def of_turn(cache: RoutedExpertsCache | None, kv, t) -> Tensor | None:
    """The routed experts of turn ``t`` as it ends (finished or aborted), gathered while its
    sequence still holds its blocks: None unless it asked for them; else the rows of every
    position its sequence has computed (the shared prefix included), at most ``seq_len - 1``."""
    if cache is None or not t.params.return_routed_experts:
        return None
    seq = kv.trajectories.get(t.tid) if t.lifetime else None
    n = 0 if seq is None or seq.lifetime != t.lifetime else min(seq.num_tokens, t.seq_len - 1)
    if n == 0:
        return torch.zeros(0, len(cache.moe_layers), cache.top_k, dtype=torch.int16)
    return cache.gather(kv.slots(t.tid, 0, n))
