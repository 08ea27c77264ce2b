"""The model runner of ``spec.method: mtp``: every target pass hands its hidden states to the MTP
drafter (:mod:`ainfer_pd.spec.mtp`), which runs the MTP layer over them in the same stream item.

:class:`MtpRunner` is a :class:`~.runner.ModelRunner` whose model holds the MTP layer (its KV is one
more layer of the pool) and whose batches carry their catch-up (:class:`MtpPlan`, built with the
batch on the event loop). Its passes are eager: the catch-up needs every row's last hidden state,
which neither the captured decode graphs nor the P graphs give, so both are refused here with a
log line (a captured MTP path is future work). One rank only (``make_speculator`` refuses several).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from torch import Tensor

from ...phase import PhaseContext
from ...spec.mtp import MtpDrafter
from ...spec.mtp_batch import CatchUp
from ..model.model import SegmentState
from .runner import BatchPlan, ModelRunner
from .tensor_parallel import LOCAL

log = logging.getLogger("ainfer_pd.runner")

REFUSED = "spec.method mtp: the MTP layer reads every row's hidden state, which captured graphs do not give"


@dataclass(slots=True)
class MtpPlan(BatchPlan):
    """A batch and the MTP layer's catch-up after it."""

    catch_up: CatchUp | None = None


class MtpRunner(ModelRunner):
    def __init__(self, sections, device, kv, tp_shard: tuple[int, int] | None = None) -> None:
        super().__init__(sections, device, kv, tp_shard)
        self.drafter = MtpDrafter(self)

    def build(self, prefill, decode, ahead=None, drafts=None) -> MtpPlan:
        plan = super().build(prefill, decode, ahead, drafts)
        cu = self.drafter.catch_up_for(plan.num_tokens, prefill, decode, ahead, drafts)
        return MtpPlan(**{f.name: getattr(plan, f.name) for f in fields(BatchPlan)}, catch_up=cu)

    def head(self, st: SegmentState, plan: BatchPlan) -> Tensor:
        """The logits of a P epoch's pass, then its catch-up."""
        logits = super().head(st, plan)
        self._after(plan, st.h)
        return logits

    def forward(self, plan: BatchPlan, ctx: PhaseContext) -> Tensor:
        """Every segment back to back (no P graphs), then the catch-up."""
        h = ctx.comm.hooks or LOCAL
        return self.model.forward_batch(plan.fb, self.kv_cache, h.experts, h.attn_reduce, h.gather,
                                        on_hidden=lambda hidden: self._after(plan, hidden))

    def decode(self, plan: BatchPlan, ctx: PhaseContext) -> Tensor:
        """One D iteration, eager (no decode graphs under mtp), then the catch-up."""
        self.decode_paths["eager-no-graphs"] += 1
        return self.forward(plan, ctx)

    def _after(self, plan: BatchPlan, hidden: Tensor) -> None:
        cu = getattr(plan, "catch_up", None)          # a plan built elsewhere (a cost measurement) has none
        if cu is not None:
            self.drafter.catch_up(cu, plan.fb, hidden)

    def capture_decode_graphs(self, ctx: PhaseContext) -> int:
        log.info("decode and P graphs not captured: %s; passes run eagerly", REFUSED)
        return 0

    def prefill_graphs_refusal(self) -> str | None:
        return REFUSED

    def release_cuda(self) -> None:  # pragma: no cover - CUDA only
        self.drafter.clear()
        super().release_cuda()
