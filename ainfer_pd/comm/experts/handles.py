"""The handles of one dispatch's lifecycle (see :mod:`.base`): the buffer state, the receive
counts, :class:`Notified` (after the notification), :class:`Dispatched` (routed rows) and
:class:`CombineResult` (the combined output tagged with the requests it serves).
"""
from __future__ import annotations

import asyncio
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Protocol

from torch import Tensor

from ...errors import DispatchCancelledError
from ...phase import Phase

LifetimeToken = tuple[Hashable, int]
"""``(request_id, lifetime)`` of one request a dispatch serves."""

ExpertFn = Callable[[Tensor, Tensor], Tensor]
"""``expert_fn(grouped_x [N, D], counts [L] int64) -> [N, D]``: rows sorted by local
expert, ``counts[l]`` rows for local expert ``l``; rows past ``counts.sum()`` are padding
(present only on the graph-capturable local path)."""


class BufferState(enum.Enum):
    IDLE = "idle"
    NOTIFIED = "notified"
    DISPATCHED = "dispatched"
    RETIRED = "retired"


@dataclass(frozen=True, slots=True)
class RecvCounts:
    """Receive counts on the host: what this rank's experts get, known before data moves."""

    per_expert: tuple[int, ...]
    """Rows per local expert (L entries)."""
    per_source: tuple[int, ...]
    """Rows from each source rank (ep_size entries)."""
    exact: bool = True
    """False when only an upper bound is known (DeepEP low-latency: counts travel with data)."""

    @property
    def total(self) -> int:
        return sum(self.per_expert)


class DispatchOwner(Protocol):
    """What a dispatch needs of the dispatcher that issued it (:class:`.base.BaseDispatcher`):
    its phase and its trace hook. A protocol, so that this module does not import ``base``
    (which imports this one)."""

    phase: Phase

    def _trace(self, ev: str, **attrs: Any) -> None: ...


class Notified:
    """A dispatch after its notification: the counts exchange is in flight or done."""

    def __init__(self, owner: DispatchOwner, seq: int, tokens: tuple[LifetimeToken, ...],
                 num_tokens: int, *, ready: Callable[[], bool],
                 wait: Callable[[], RecvCounts]) -> None:
        self.owner = owner
        self.phase = owner.phase
        self.seq = seq
        self.tokens = tokens
        self.num_tokens = num_tokens
        self.cancelled = False
        self.done = False
        self.impl: dict[str, Any] = {}
        """Backend state of this dispatch (layout, splits, handles)."""
        self._ready = ready
        self._wait = wait
        self._counts: RecvCounts | None = None
        self._lock = threading.Lock()

    def counts_ready(self) -> bool:
        """Non-blocking: are the receive counts here?"""
        return self._counts is not None or self._ready()

    def wait_sync(self) -> RecvCounts:
        """Block until the receive counts are here (call off the event loop)."""
        if self.cancelled:
            raise DispatchCancelledError(f"{self.phase.value} dispatch #{self.seq} was cancelled")
        with self._lock:
            if self._counts is None:
                self._counts = self._wait()
                self.owner._trace("expert.counts", seq=self.seq, total=self._counts.total)
        return self._counts

    async def wait(self, timeout: float | None = None) -> RecvCounts:
        """Await the receive counts without blocking the loop; TimeoutError after ``timeout``."""
        if self._counts is not None:
            return self.wait_sync()
        async with asyncio.timeout(timeout):
            # NOTE: the counts wait blocks on a collective (or a host-mapped counter),
            # so it runs in a worker thread; the event loop keeps serving D.
            return await asyncio.to_thread(self.wait_sync)

    @property
    def counts(self) -> RecvCounts | None:
        return self._counts

    def __repr__(self) -> str:
        return f"Notified(phase={self.phase.value}, seq={self.seq}, ready={self.counts_ready()})"


@dataclass(slots=True)
class Dispatched:
    """Routed rows on this rank, grouped by local expert."""

    notified: Notified
    x: Tensor
    """[N, D] rows sorted by local expert (a view of phase-owned buffers where possible:
    valid until the next dispatch on the same buffer set)."""
    counts: Tensor
    """[L] int64 rows per local expert (device tensor; no host sync needed)."""
    layout: str = "grouped"
    """grouped (contiguous per expert) | masked (DeepEP low-latency: [L, capacity, D])."""
    impl: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> tuple[LifetimeToken, ...]:
        return self.notified.tokens


class CombineResult(NamedTuple):
    """A combined output tagged with the ``(request_id, lifetime)`` tokens it serves."""

    out: Tensor
    tokens: tuple[LifetimeToken, ...]

    def stale(self, current_lifetime: Callable[[Hashable], int | None]) -> list[LifetimeToken]:
        """Tokens whose request no longer has that lifetime (drop their rows; never promote)."""
        return [(rid, lt) for rid, lt in self.tokens if current_lifetime(rid) != lt]
