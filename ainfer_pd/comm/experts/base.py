"""Expert dispatcher interface, phase-owned state stand-ins and the dispatch lifecycle.

Shape legend: T = tokens on this rank, k = top-k, D = hidden, E = routed experts,
L = local experts (E / ep_size), N = rows handed to the local experts.

One dispatcher instance per phase per rank. The phase is fixed at construction and
selected by the explicit :class:`~ainfer_pd.phase.PhaseContext` (``PhaseDispatchers``),
never by thread or stream. A dispatch runs in three steps so the background P task can
stop at the safe boundary after the notification (SPEC §3.2, §3.4)::

    notified = disp.notify(topk_idx, tokens=...)   # counts exchange starts (peers learn the shape)
    counts   = await notified.wait()               # receive counts (P progress)
    await permit                                   # turnstile permit
    d        = disp.dispatch(notified, x, topk_idx, topk_weights)   # routed data movement
    y        = disp.combine(d, expert_fn(d.x, d.counts))

Lifecycle of the buffer (at most one pending dispatch)::

    IDLE --notify--> NOTIFIED --dispatch--> DISPATCHED --combine--> IDLE
    NOTIFIED | DISPATCHED --cancel--> RETIRED --quiesce--> IDLE

A cancelled dispatch retires the buffer: after the notification, peers may still write
into it (device-initiated communication is irrevocable), so it is reused only after a
quiescent cleanup point (``quiesce``: every outstanding collective of the phase drained).

The dispatch handles are :mod:`.handles`; the CPU stream / event stand-ins :mod:`.stand_ins`
(both re-exported here).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from ...errors import (BufferRetiredError, ConfigError, DispatchCancelledError,
                       DispatchPendingError, DispatchStateError)
from ...phase import Phase, PhaseContext
from .handles import (BufferState, CombineResult, Dispatched, ExpertFn, LifetimeToken,  # noqa: F401
                      Notified, RecvCounts)
from .ownership import OwnedObject, OwnershipRegistry
from .stand_ins import DoubleBufferIndex, HostEvent, HostStream, make_event, make_stream  # noqa: F401


@runtime_checkable
class ExpertDispatcher(Protocol):
    phase: Phase

    def notify(self, topk_idx: Tensor, *, tokens: Sequence[LifetimeToken] = ()) -> Notified: ...
    def dispatch(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                 topk_weights: Tensor) -> Dispatched: ...
    def combine(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor: ...
    def owned_objects(self) -> list[OwnedObject]: ...


# ---- lifecycle -----------------------------------------------------------------------------
class BaseDispatcher:
    """Lifecycle, tracing and ownership bookkeeping shared by every backend.

    Backends implement ``_notify_impl``, ``_dispatch_impl``, ``_combine_impl``,
    ``_drain_impl`` and fill ``self._owned`` (one :class:`OwnershipRegistry`).
    """

    backend = "base"
    needs_host_counts = True
    """dispatch() needs the receive counts on the host (split sizes). False for the local
    and low-latency paths: they must not sync the host (CUDA-graph capture)."""

    def __init__(self, phase: Phase, *, num_experts: int, ep_rank: int, ep_size: int,
                 recorder: Any = None) -> None:
        if not isinstance(phase, Phase):
            raise ConfigError(f"phase must be a Phase, got {phase!r}")
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ConfigError(f"ep_rank={ep_rank} outside [0, ep_size={ep_size})")
        if num_experts < 1 or num_experts % ep_size:
            raise ConfigError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        self.phase = phase
        self.num_experts = num_experts
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.recorder = recorder
        self._state = BufferState.IDLE
        self._pending: Notified | None = None
        self._seq = 0
        self.stats = {"notify": 0, "dispatch": 0, "combine": 0, "cancel": 0, "quiesce": 0}
        self._owned = OwnershipRegistry()

    # ---- state ----
    @property
    def state(self) -> BufferState:
        return self._state

    @property
    def pending(self) -> Notified | None:
        return self._pending

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """Global ids ``[ep_rank * L, (ep_rank + 1) * L)`` of this rank's expert shard."""
        return (self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def _trace(self, ev: str, **attrs: Any) -> None:
        if self.recorder is not None:
            self.recorder.event(ev, phase=self.phase.value, backend=self.backend, **attrs)

    # ---- the three steps ----
    def notify(self, topk_idx: Tensor, *, tokens: Sequence[LifetimeToken] = ()) -> Notified:
        """Start the counts exchange for ``topk_idx [T, k]`` (collective on the phase group)."""
        if self._state is BufferState.RETIRED:
            raise BufferRetiredError(
                f"{self.phase.value} {self.backend} buffer is retired by a cancelled dispatch; "
                "call quiesce() at a quiescent cleanup point first")
        if self._state is not BufferState.IDLE:
            raise DispatchPendingError(
                f"{self.phase.value} {self.backend} buffer already holds pending dispatch "
                f"#{self._pending.seq if self._pending else '?'} (at most one per buffer)")
        if topk_idx.dim() != 2:
            raise ConfigError(f"topk_idx must be [T, k], got shape {tuple(topk_idx.shape)}")
        self._seq += 1
        notified = self._notify_impl(topk_idx, self._seq, tuple(tokens))
        self._pending = notified
        self._state = BufferState.NOTIFIED
        self.stats["notify"] += 1
        self._trace("expert.notify", seq=notified.seq, num_tokens=notified.num_tokens)
        return notified

    def dispatch(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                 topk_weights: Tensor) -> Dispatched:
        """Move the routed rows (blocks on the receive counts if the backend needs them on
        the host and they were not awaited yet)."""
        self._check_current(notified, BufferState.NOTIFIED, "dispatch")
        if x.shape[0] != topk_idx.shape[0] or topk_weights.shape != topk_idx.shape:
            raise ConfigError(f"x {tuple(x.shape)}, topk_idx {tuple(topk_idx.shape)} and "
                              f"topk_weights {tuple(topk_weights.shape)} disagree")
        if self.needs_host_counts:
            notified.wait_sync()
        self._trace("expert.dispatch", seq=notified.seq)
        d = self._dispatch_impl(notified, x, topk_idx, topk_weights)
        self._state = BufferState.DISPATCHED
        self.stats["dispatch"] += 1
        return d

    def combine(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:
        """Return rows to token order; weighted sum over top-k. [N, D] -> [T, D]"""
        notified = dispatched.notified
        self._check_current(notified, BufferState.DISPATCHED, "combine")
        out = self._combine_impl(dispatched, expert_out)
        notified.done = True
        self._pending = None
        self._state = BufferState.IDLE
        self.stats["combine"] += 1
        self._trace("expert.combine", seq=notified.seq)
        return out

    def combine_tagged(self, dispatched: Dispatched, expert_out: Tensor) -> CombineResult:
        """``combine`` with the result tagged by the ``(request_id, lifetime)`` tokens."""
        tokens = dispatched.tokens
        return CombineResult(self.combine(dispatched, expert_out), tokens)

    def run_moe(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, expert_fn: ExpertFn,
                *, tokens: Sequence[LifetimeToken] = ()) -> Tensor:
        """Synchronous notify -> dispatch -> experts -> combine (D path, tests)."""
        notified = self.notify(topk_idx, tokens=tokens)
        try:
            d = self.dispatch(notified, x, topk_idx, topk_weights)
            y = expert_fn(d.x, d.counts)
            return self.combine(d, y)
        except BaseException:
            if self._pending is notified and not notified.done:
                self.cancel(notified)
            raise

    # ---- cancellation ----
    def cancel(self, pending: Notified | Dispatched) -> bool:
        """Cancel a pending dispatch: its buffer retires until ``quiesce()``.

        Returns False when ``pending`` already finished (nothing to retire).
        NOTE: the cancel is a rank-aligned decision: every rank of the phase group cancels
        the same dispatch (an epoch abort), so no rank waits for a data collective.
        """
        notified = pending.notified if isinstance(pending, Dispatched) else pending
        if notified.owner is not self:
            raise DispatchStateError("cancel() got a dispatch of another dispatcher")
        if notified.done or notified.cancelled or self._pending is not notified:
            return False
        notified.cancelled = True
        self._state = BufferState.RETIRED
        self.stats["cancel"] += 1
        self._trace("expert.cancel", seq=notified.seq, state="retired")
        return True

    def quiesce(self) -> None:
        """Quiescent cleanup point: drain every outstanding collective, then reuse the buffer."""
        self._drain_impl()
        if self._state is BufferState.RETIRED:
            self._pending = None
            self._state = BufferState.IDLE
            self.stats["quiesce"] += 1
            self._trace("expert.quiesce")

    def _check_current(self, notified: Notified, want: BufferState, what: str) -> None:
        if notified.owner is not self:
            raise DispatchStateError(f"{what}: the dispatch belongs to another dispatcher "
                                     f"({notified.phase.value})")
        if notified.cancelled:
            raise DispatchCancelledError(
                f"{what}: {self.phase.value} dispatch #{notified.seq} was cancelled; "
                "its data must not be used")
        if self._pending is not notified or self._state is not want:
            raise DispatchStateError(f"{what}: dispatch #{notified.seq} is not the pending one "
                                     f"in state {want.value} (buffer is {self._state.value})")

    # ---- ownership ----
    def owned_objects(self) -> list[OwnedObject]:
        return list(self._owned.objects)

    # ---- backend hooks ----
    def _notify_impl(self, topk_idx: Tensor, seq: int,
                     tokens: tuple[LifetimeToken, ...]) -> Notified:  # pragma: no cover
        raise NotImplementedError

    def _dispatch_impl(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> Dispatched:  # pragma: no cover
        raise NotImplementedError

    def _combine_impl(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def _drain_impl(self) -> None:
        pass


class PhaseDispatchers:
    """The P and D dispatcher of one rank, chosen by the explicit phase identity."""

    def __init__(self, prefill: ExpertDispatcher, decode: ExpertDispatcher) -> None:
        if prefill.phase is not Phase.PREFILL or decode.phase is not Phase.DECODE:
            raise ConfigError("PhaseDispatchers(prefill=P dispatcher, decode=D dispatcher)")
        if prefill is decode:
            raise ConfigError("P and D need separate dispatchers (phase-owned state)")
        self._by_phase = {Phase.PREFILL: prefill, Phase.DECODE: decode}

    def get(self, ctx: PhaseContext | Phase) -> ExpertDispatcher:
        phase = ctx.phase if isinstance(ctx, PhaseContext) else ctx
        if not isinstance(phase, Phase):
            raise ConfigError(f"expected a PhaseContext or Phase, got {ctx!r}")
        return self._by_phase[phase]

    @property
    def prefill(self) -> ExpertDispatcher:
        return self._by_phase[Phase.PREFILL]

    @property
    def decode(self) -> ExpertDispatcher:
        return self._by_phase[Phase.DECODE]

    def registry(self, shared: Sequence[OwnedObject] = ()) -> OwnershipRegistry:
        """A registry with both phases' objects (and the caller's shared ones)."""
        reg = OwnershipRegistry()
        reg.add_dispatcher(self.prefill)
        reg.add_dispatcher(self.decode)
        reg.add(shared)
        return reg


# ---- routing helpers (no host sync) ----------------------------------------------------------
def expert_keys(topk_idx: Tensor, num_experts: int) -> Tensor:
    """[T, k] -> [T*k] sort keys: the expert id, ``num_experts`` for a ``-1`` (no selection)."""
    flat = topk_idx.reshape(-1)
    return torch.where(flat < 0, torch.full_like(flat, num_experts), flat)


def qp_slice(phase: Phase, s: int) -> tuple[int, int]:
    """QP index range of a phase: D ``[0, s)``, P ``[s, 2s)`` (SPEC §3.4)."""
    return (0, s) if phase is Phase.DECODE else (s, 2 * s)
