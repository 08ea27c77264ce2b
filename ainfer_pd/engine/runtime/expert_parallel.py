"""Bridge between the model's MoE layers and the phase-owned expert dispatchers.

The phase is always explicit: every call takes the :class:`PhaseContext` of the work
it belongs to, and the dispatcher is chosen from it (``PhaseDispatchers.get(ctx)``): P's
(normal path) and D's (low-latency path) never share mutable state (SPEC 3.4).

Prefill splits a MoE layer at the notification (SPEC 3.4): ``notify`` (counts exchange,
peers learn the shape) -> the P task awaits the receive counts and then the turnstile
permit -> ``finish`` (routed data movement, local experts, combine). Decode runs the
three steps back to back inside its iteration (under attention TP on its TP rank's share of
the replica's rows: :class:`~ainfer_pd.engine.runtime.tensor_parallel.DecodeHooks`). The data movement
runs on the device's communication budget
(:meth:`~ainfer_pd.engine.runtime.device.Device.comm_budget`), not in a compute residency slot.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from ...comm.experts.base import Notified, PhaseDispatchers
from ...phase import PhaseContext
from ..model.model import MoETransformer
from ..model.linear import grouped
from ..model.moe import Routing


def expert_shard(cfg: Any, rank: int | None = None) -> tuple[int, int] | None:
    """Global ids [lo, hi) of the routed experts rank ``rank`` (default: this process's
    ``torch.distributed`` rank) holds under expert parallelism; None without it (all experts).
    The same split as the dispatchers' ``local_expert_range``: ``ep_rank * E / e ...``."""
    pc = cfg.parallel
    if pc.expert_parallel <= 1:
        return None
    if rank is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            return None                  # make_engine refuses this configuration with its own error
        rank = dist.get_rank()
    from ...comm.topology import Topology
    ep_rank = Topology.from_config(pc, rank).ep_rank
    n = cfg.model.num_experts // pc.expert_parallel
    return ep_rank * n, (ep_rank + 1) * n


class ExpertParallel:
    def __init__(self, model: MoETransformer, dispatchers: PhaseDispatchers, device: Any = None) -> None:
        self.model = model
        self.dispatchers = dispatchers
        self.device = device
        """The device whose communication budget the data movement runs on (None: no residency)."""

    def _get(self, ctx: PhaseContext) -> Any:
        return self.dispatchers.get(ctx)

    def _budget(self):
        import contextlib
        return self.device.comm_budget() if self.device is not None else contextlib.nullcontext()

    def _local_fn(self, layer: int, disp: Any):
        lo, hi = disp.local_expert_range
        base, top = self.model.expert_range        # the experts this model holds (its shard, or all)
        if not base <= lo < hi <= top:
            raise RuntimeError(f"dispatcher serves experts [{lo}, {hi}) but the model holds [{base}, {top})")
        lyr, kernels = self.model.layers[layer], self.model.fp8_kernels

        def fn(xg: Tensor, counts: Tensor) -> Tensor:       # xg [N, D] grouped by local expert
            return grouped(lyr, lo - base, hi - base, xg, counts, kernels)   # in the layer's format (FP8 too)
        return fn

    def notify(self, ctx: PhaseContext, routing: Routing, tokens=()) -> Notified:
        return self._get(ctx).notify(routing.topk_idx, tokens=tokens)

    def finish(self, ctx: PhaseContext, notified: Notified, x: Tensor, routing: Routing, layer: int) -> Tensor:
        disp = self._get(ctx)
        with self._budget():
            d = disp.dispatch(notified, x, routing.topk_idx, routing.topk_weights)
        y = self._local_fn(layer, disp)(d.x, d.counts)
        with self._budget():
            return disp.combine(d, y)

    def run(self, ctx: PhaseContext, x: Tensor, routing: Routing, layer: int) -> Tensor:
        disp = self._get(ctx)
        with self._budget():
            return disp.run_moe(x, routing.topk_idx, routing.topk_weights, self._local_fn(layer, disp))
