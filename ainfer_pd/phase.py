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


@dataclass(frozen=True, slots=True)
class PhaseContext:
    """What one phase owns on one rank.

    ``stream`` is the phase's execution stream (a CUDA stream wrapper or the CPU
    stand-in), ``comm`` its phase-owned communication state (attention process
    groups, expert dispatcher). The same context object is handed to every layer
    of a forward pass of that phase.
    """

    phase: Phase
    stream: Any
    comm: Any = None
    extras: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_prefill(self) -> bool:
        return self.phase is Phase.PREFILL

    @property
    def is_decode(self) -> bool:
        return self.phase is Phase.DECODE
