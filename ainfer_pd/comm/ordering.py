"""Conflicting collective pairs, the orderings, and the stream each collective goes to (SPEC 3.3).

The one home of :data:`ORDERINGS` and of the collective kinds the engine issues:

* P (eager): ``P:all_reduce@attn_tp.P``, the full attention-TP all-reduce of every layer;
* D (in its iteration, a graph replay on CUDA): ``D:reduce_scatter@attn_tp.D`` /
  ``D:all_gather@attn_tp.D`` around the experts (its own attention-TP reduce: each TP rank keeps
  its share of the rows through the experts, then the shares are gathered: the bytes of one
  all-reduce), and ``D:all_gather@attn_dp.D`` / ``D:reduce_scatter@attn_dp.D`` (the DP-attention
  gather / scatter of every replica's rows around each MoE layer's routed experts, ADP > 1:
  :meth:`~ainfer_pd.engine.runtime.tensor_parallel.DecodeHooks.experts_dp`).

A *conflicting pair* is a P and a D collective on different communicators that share ranks and
cannot both be resident on a device (ARCHITECTURE.md): if ranks launch them in opposite device orders, a
device-progress cycle can close. SPEC 2's crossed pair (P attention-TP all-reduce x D DP-attention
collectives, ATP > 1 and ADP > 1: the groups intersect, neither contains the other) closes a cycle
through four ranks; it is always registered. D's own attention-TP reduce-scatter / all-gather share
every rank with P's all-reduce (ATP > 1): on a device where the two can be resident together (a
GPU, per the paper's Table 4: ADP1 completes; the CPU stand-in's default model) they close no
cycle and are not registered; on a device model where they cannot (``same_group``: e.g. the CPU
stand-in with one collective unit) they would close one through two ranks, and are registered too.
Only registered pairs are serialised by the device-order edge; every other P work item
keeps its own stream and overlaps D. Expert exchanges are never registered: they run on their
own communication budget (phase-owned DeepEP-style state, SPEC 3.4).

Ordering modes (``ParallelConfig.ordering``):

* ``none``: communicator isolation only; every collective on its phase's stream.
* ``selective``: a registered P collective is enqueued on the **D stream** (after the D
  launch of the turnstile round that granted its permit): ``R- < G < R+`` by stream FIFO.
* ``global-implicit``: one total order of all attention collectives: every P collective goes
  onto the D stream, which carries D's (inside its iteration), in turnstile order (like
  NCCL_LAUNCH_ORDER_IMPLICIT); registered or not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..phase import Phase
from .topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, Topology, groups_cross

__all__ = ["CollectiveKind", "P_ATP_ALL_REDUCE", "D_ATP_REDUCE_SCATTER", "D_ATP_ALL_GATHER", "D_ADP_ALL_GATHER", "D_ADP_REDUCE_SCATTER",
           "ConflictRegistry", "ORDERINGS", "P_STREAM", "D_STREAM", "collective_stream", "check_ordering"]

ORDERINGS = ("none", "global-implicit", "selective")
P_STREAM, D_STREAM = "P", "D"


@dataclass(frozen=True, slots=True)
class CollectiveKind:
    """A collective identified by phase, operation and communicator family."""

    phase: Phase
    op: str                 # all_reduce | all_gather | reduce_scatter
    comm: str               # communicator family name (topology constant)

    @property
    def name(self) -> str:
        return f"{self.phase.value}:{self.op}@{self.comm}"


P_ATP_ALL_REDUCE = CollectiveKind(Phase.PREFILL, "all_reduce", ATTN_TP_P)
D_ATP_REDUCE_SCATTER = CollectiveKind(Phase.DECODE, "reduce_scatter", ATTN_TP_D)
D_ATP_ALL_GATHER = CollectiveKind(Phase.DECODE, "all_gather", ATTN_TP_D)
D_ADP_ALL_GATHER = CollectiveKind(Phase.DECODE, "all_gather", ATTN_DP_D)
D_ADP_REDUCE_SCATTER = CollectiveKind(Phase.DECODE, "reduce_scatter", ATTN_DP_D)


@dataclass
class ConflictRegistry:
    """Set of registered conflicting (P collective, D collective) pairs."""

    pairs: set[tuple[CollectiveKind, CollectiveKind]] = field(default_factory=set)

    def register(self, p: CollectiveKind, d: CollectiveKind) -> None:
        if p.phase is not Phase.PREFILL or d.phase is not Phase.DECODE:
            raise ConfigError(f"a conflicting pair is (P collective, D collective), got ({p.name}, {d.name})")
        self.pairs.add((p, d))

    def is_registered(self, kind: CollectiveKind) -> bool:
        """``kind`` is a member of some registered pair."""
        return any(kind == p or kind == d for p, d in self.pairs)

    def partners(self, kind: CollectiveKind) -> list[CollectiveKind]:
        return [d if kind == p else p for p, d in self.pairs if kind in (p, d)]

    def describe(self) -> list[str]:
        return sorted(f"{p.name} x {d.name}" for p, d in self.pairs)

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def register_same_group(self) -> None:
        """Register the same-group pair (P ATP all-reduce x D ATP reduce-scatter / all-gather): for
        a device on which they cannot both be resident (module docstring)."""
        self.register(P_ATP_ALL_REDUCE, D_ATP_REDUCE_SCATTER)
        self.register(P_ATP_ALL_REDUCE, D_ATP_ALL_GATHER)

    @classmethod
    def for_topology(cls, topology: Topology, *, same_group: bool = False, force: bool = False) -> ConflictRegistry:
        """The pairs of ``topology``: (P ATP all-reduce x D DP-attention all-gather /
        reduce-scatter) when the attention-TP and DP-attention groups cross (ATP > 1 and
        ADP > 1); with ``same_group`` also (P ATP all-reduce x D ATP reduce-scatter / all-gather)
        whenever ATP > 1 (the same ranks on two communicators, on a device where the two cannot be
        resident together). ``force`` registers every pair (exercises the selective route where
        nothing conflicts, e.g. one rank)."""
        reg = cls()
        if force or (topology.crossed and groups_cross(topology.all_tp_groups(), topology.all_dp_groups())):
            reg.register(P_ATP_ALL_REDUCE, D_ADP_ALL_GATHER)
            reg.register(P_ATP_ALL_REDUCE, D_ADP_REDUCE_SCATTER)
        if force or (same_group and topology.atp > 1):
            reg.register_same_group()
        return reg


def check_ordering(ordering: str) -> str:
    if ordering not in ORDERINGS:
        raise ConfigError(f"ordering={ordering!r}: expected one of {ORDERINGS}")
    return ordering


def collective_stream(ordering: str, kind: CollectiveKind, registry: ConflictRegistry) -> str:
    """Name of the stream a collective of ``kind`` is enqueued on under ``ordering`` (pure)."""
    check_ordering(ordering)
    if kind.phase is Phase.DECODE:
        return D_STREAM                      # D's collectives are inside its iteration (graph)
    if ordering == "global-implicit":
        return D_STREAM
    if ordering == "selective" and registry.is_registered(kind):
        return D_STREAM
    return P_STREAM
