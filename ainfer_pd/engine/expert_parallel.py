"""Bridge between the model's MoE layers and the phase-owned expert dispatchers.

The phase is always explicit: every call takes the :class:`PhaseContext` of the work
it belongs to, and the dispatcher is chosen from it (``PhaseDispatchers.get(ctx)``).

Prefill splits a MoE layer at the notification (SPEC 3.4): ``notify`` (counts exchange,
peers learn the shape) -> the P task awaits the receive counts and then the turnstile
permit -> ``finish`` (routed data movement, local experts, combine). Decode runs the
three steps back to back inside its iteration.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..comm.experts.base import Notified, PhaseDispatchers
from ..phase import PhaseContext
from .model import MoETransformer
from .moe import Routing, swiglu_grouped


class ExpertParallel:
    def __init__(self, model: MoETransformer, dispatchers: PhaseDispatchers) -> None:
        self.model = model
        self.dispatchers = dispatchers

    def _local_fn(self, layer: int, disp: Any):
        lo, hi = disp.local_expert_range
        lyr = self.model.layers[layer]
        w13, w2 = lyr.w13[lo:hi], lyr.w2[lo:hi]

        def fn(xg: Tensor, counts: Tensor) -> Tensor:       # xg [N, D] grouped by local expert
            offs = torch.cumsum(counts, 0).to(torch.int32)
            n = xg.shape[0]
            out = swiglu_grouped(xg, w13, w2, offs)
            return out if out.shape[0] == n else torch.cat([out, xg.new_zeros(n - out.shape[0], xg.shape[1])])
        return fn

    def notify(self, ctx: PhaseContext, routing: Routing, tokens=()) -> Notified:
        return self.dispatchers.get(ctx).notify(routing.topk_idx, tokens=tokens)

    def finish(self, ctx: PhaseContext, notified: Notified, x: Tensor, routing: Routing, layer: int) -> Tensor:
        disp = self.dispatchers.get(ctx)
        d = disp.dispatch(notified, x, routing.topk_idx, routing.topk_weights)
        return disp.combine(d, self._local_fn(layer, disp)(d.x, d.counts))

    def run(self, ctx: PhaseContext, x: Tensor, routing: Routing, layer: int) -> Tensor:
        disp = self.dispatchers.get(ctx)
        return disp.run_moe(x, routing.topk_idx, routing.topk_weights, self._local_fn(layer, disp))
