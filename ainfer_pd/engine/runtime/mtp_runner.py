"""The model runner of ``spec.method: mtp``: every target pass hands its hidden states to the MTP
drafter (:mod:`ainfer_pd.spec.mtp`), which runs the MTP layer over them in the same stream item.

:class:`MtpRunner` is a :class:`~.runner.ModelRunner` whose model holds the MTP layer (its KV is one
more layer of the pool) and whose batches carry their catch-up (:class:`MtpPlan`, built with the
batch on the event loop). A D pass replays a decode graph that holds its catch-up too
(:mod:`.mtp_graphs`); a P pass may replay the P graphs, its catch-up then runs eagerly on the hidden
states they leave; a mixed pass, a batch past the graphs and a device without graphs run eagerly.
On several ranks every pass's catch-up runs on every rank through the phase's hooks, a pass
without MTP rows included (its collectives join the other ranks'); under attention TP a follower's
plans carry its leader's catch-ups (:mod:`.mtp_wire`, ``DistRanks``), run on its drafter's mirror.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor

from ...phase import PhaseContext
from ...spec.mtp import MtpDrafter, PendingCatchUp
from ...spec.mtp_batch import CatchUp, DecodeCatchUp
from ..model.model import SegmentState
from .runner import BatchPlan, ModelRunner, Replayed
from .tensor_parallel import LOCAL


@dataclass(slots=True)
class MtpPlan(BatchPlan):
    """A batch and the MTP layer's catch-up after it."""

    catch_up: CatchUp | DecodeCatchUp | None = None

    @classmethod
    def of(cls, plan: BatchPlan, catch_up: CatchUp | DecodeCatchUp) -> "MtpPlan":
        """``plan`` with its catch-up (a TP follower's: its leader's, as it came)."""
        return cls(**{f.name: getattr(plan, f.name) for f in fields(BatchPlan)}, catch_up=catch_up)


class MtpRunner(ModelRunner):
    def __init__(self, sections, device, kv, tp_shard: tuple[int, int] | None = None) -> None:
        super().__init__(sections, device, kv, tp_shard)
        self.drafter = MtpDrafter(self)

    def build(self, prefill, decode, ahead=None, drafts=None) -> MtpPlan:
        plan = super().build(prefill, decode, ahead, drafts)
        return MtpPlan.of(plan, self.drafter.catch_up_for(plan.num_tokens, prefill, decode, ahead, drafts))

    def after_layers(self, st: SegmentState | Replayed, plan: BatchPlan, ctx: PhaseContext) -> None:
        """A P epoch's catch-up, run by the walk after the last layer's experts (inside the last
        layer's segment: before the epoch's final boundary, so on several ranks its expert
        exchange keeps the turnstile's order), on the P graphs' hidden states when the pass
        replayed them."""
        self._after(plan, _hidden(st), ctx)

    def after_layers_attention(self, st: SegmentState | Replayed, plan: BatchPlan, ctx: PhaseContext) -> PendingCatchUp:
        """:meth:`after_layers` up to the MTP layer's attention, for a P walk under attention TP:
        the walk routes its all-reduce by the ordering, as it routes the other layers', then runs
        :meth:`after_layers_rest` (on several ranks a plan's catch-up always runs the layer)."""
        return self.drafter.begin_catch_up(plan.catch_up, plan.fb, _hidden(st), ctx.comm.hooks)

    def after_layers_rest(self, pend: PendingCatchUp, o: Tensor, ctx: PhaseContext) -> None:
        """The rest of the P catch-up's MTP layer on its all-reduced attention output ``o``."""
        self.drafter.end_catch_up(pend, o, ctx.comm.hooks)

    def forward(self, plan: BatchPlan, ctx: PhaseContext) -> Tensor:
        """Every segment back to back, eagerly, then the catch-up."""
        h = ctx.comm.hooks or LOCAL
        return self.model.forward_batch(plan.fb, self.kv_cache, h.experts, h.attn_reduce, h.gather,
                                        on_hidden=lambda hidden: self._after(plan, hidden, ctx))

    def graph_inputs(self, plan: BatchPlan) -> tuple:
        """A decode graph replays the pass and its catch-up (:mod:`.mtp_graphs`; a plan without
        one, a cost measurement's, replays with every MTP row padding)."""
        return (getattr(plan, "catch_up", None),)

    def _after(self, plan: BatchPlan, hidden: Tensor, ctx: PhaseContext) -> None:
        cu = getattr(plan, "catch_up", None)          # a plan built elsewhere (a cost measurement) has none
        if cu is not None:
            self.drafter.catch_up(cu, plan.fb, hidden, ctx.comm.hooks)

    def new_decode_graphs(self, sizes: tuple[int, ...], ctxs: tuple[int, ...], ctx: PhaseContext):
        from .mtp_graphs import MtpDecodeGraphs
        return MtpDecodeGraphs(self, sizes, ctxs, self.scratch_slot, ctx, self.phase_stream(ctx))

    def release_cuda(self) -> None:  # pragma: no cover - CUDA only
        self.drafter.clear()
        super().release_cuda()


def _hidden(st: SegmentState | Replayed) -> Tensor:
    """The last layer's outputs of a pass: the P graphs' static hidden states when it replayed them."""
    return st.binding.hidden() if type(st) is Replayed else st.h
