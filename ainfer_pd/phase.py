"""Phase identity: an explicit object passed down to collectives and expert backends.

Nothing in the library infers the phase from the current thread or stream; every
function that behaves differently for prefill (P) and decode (D) takes a
:class:`PhaseContext` (or a :class:`Phase`) argument.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    PREFILL = "P"
    DECODE = "D"

    @property
    def other(self) -> "Phase":
        return Phase.DECODE if self is Phase.PREFILL else Phase.PREFILL


@dataclass(slots=True)
class PhaseComm:
    """One phase's communication state on one rank (:attr:`PhaseContext.comm`).

    ``collectives``: the phase's attention collectives (``comm.collectives.PhaseCollectives``;
    None at one rank), ``dispatcher``: its expert dispatcher (None without expert parallelism),
    ``hooks``: what its whole forward pass calls between segments
    (``engine.runtime.tensor_parallel.PhaseHooks``; None: nothing, the pass is local). Empty at one
    rank; filled once by :meth:`install` (the multi-rank parts, before any graph is captured: the
    graphs bind the hooks)."""

    collectives: Any = None
    dispatcher: Any = None
    hooks: Any = None

    def install(self, collectives: Any, dispatcher: Any, hooks: Any) -> None:
        if self.hooks is not None:
            raise RuntimeError("a phase's communication state is installed once")
        self.collectives, self.dispatcher, self.hooks = collectives, dispatcher, hooks


@dataclass(frozen=True, slots=True)
class PhaseContext:
    """What one phase owns on one rank.

    ``stream`` is the phase's execution stream (a CUDA stream wrapper or the CPU
    stand-in), ``comm`` its phase-owned communication state (:class:`PhaseComm`: attention
    collectives, expert dispatcher, the pass's hooks). The same context object is handed to
    every layer of a forward pass of that phase.
    """

    phase: Phase
    stream: Any
    comm: PhaseComm = field(default_factory=PhaseComm, compare=False, hash=False)
    extras: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_prefill(self) -> bool:
        return self.phase is Phase.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.phase is Phase.DECODE
