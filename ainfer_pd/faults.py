"""Fault injection for tests and the reliability suite (never on in production).

Switched on by ``WorkerConfig.faults`` (a mapping) or the environment variable
``AINFER_PD_FAULTS`` (JSON with the same keys; the config wins):

* ``d_skew_ms`` / ``d_skew_random_ms`` - delay before every D launch (fixed / uniform random);
* ``p_delay_ms``          - delayed P completion: every P segment sleeps this long on its stream;
* ``slow_counts_ms``      - the receive counts arrive this much later;
* ``p_error_epoch``       - raise inside a P segment of this epoch (``p_error_layer``, default 0);
* ``phase_skew_ms``       - multi-rank, ranks out of phase on the device: on ranks with an even
  ``dp_rank + tp_rank`` every D iteration (where the groups cross: D's first DP-attention collective
  of each iteration, the crossed pair's D side), on the others every P attention collective, waits
  this long on its stream before taking the device (neighbours in every group reach their P and D
  collectives in opposite orders: the adversarial schedule of SPEC 2, Figure 2's four-rank cycle);
* ``phase_skew_by``       - ``"rank"`` (default: the parity of ``dp_rank + tp_rank`` above) or
  ``"replica"``: the parity of ``dp_rank`` alone, so the TP peers of one replica share their delays
  (one scheduler, the same batch and kernels) and only the replicas are out of phase;
* ``drop_rendezvous`` / ``duplicate_rendezvous`` / ``stale_rendezvous`` - the n-th control
  message of this rank is dropped (never sent: peers time out), sent twice, or sent with an
  old sequence number (peers see a mismatch);
* ``hang_d_iteration``    - the CPU stand-in for a device hang: the n-th D iteration's stream item
  (1-based) never completes (its launcher thread blocks, so everything queued behind it on the D
  stream waits too) until the engine shuts down, when it fails with :class:`InjectedFault`
  instead of running; the single-rank device watchdog must report it
  (:class:`~ainfer_pd.errors.DeviceStallError`);
* ``hang_outlives_shutdown`` - with ``hang_d_iteration``: the shutdown does not end the hang (a
  wedged GPU, whose kernel never finishes): the stalled device's shutdown must not wait for the
  stuck thread; it ends at :data:`HANG_CAP_S` or :meth:`Faults.end_hangs`;
* ``seed``                - seed of the random skew.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import AInferPDError, ConfigError

HANG_CAP_S = 600.0
"""An injected hang ends after this long even without a shutdown (a test that forgot to close)."""

KEYS = ("d_skew_ms", "d_skew_random_ms", "p_delay_ms", "slow_counts_ms", "p_error_epoch", "p_error_layer",
        "phase_skew_ms", "phase_skew_by", "drop_rendezvous", "duplicate_rendezvous", "stale_rendezvous", "hang_d_iteration",
        "hang_outlives_shutdown", "seed")


class InjectedFault(AInferPDError):
    """An error raised on purpose by fault injection."""


@dataclass(slots=True)
class Faults:
    d_skew_ms: float = 0.0
    d_skew_random_ms: float = 0.0
    p_delay_ms: float = 0.0
    slow_counts_ms: float = 0.0
    p_error_epoch: int | None = None
    p_error_layer: int = 0
    phase_skew_ms: float = 0.0
    phase_skew_by: str = "rank"
    drop_rendezvous: int | None = None
    duplicate_rendezvous: int | None = None
    stale_rendezvous: int | None = None
    hang_d_iteration: int | None = None
    hang_outlives_shutdown: bool = False
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _d_items: int = field(default=0, repr=False)
    _unhang: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def load(cls, cfg_faults: Mapping[str, Any] | None) -> "Faults":
        data: dict[str, Any] = {}
        env = os.environ.get("AINFER_PD_FAULTS")
        if env:
            try:
                data.update(json.loads(env))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"AINFER_PD_FAULTS is not valid JSON: {exc}") from None
        data.update(cfg_faults or {})
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ConfigError(f"unknown fault key(s) {unknown}; known: {KEYS}")
        f = cls(**data)
        if f.phase_skew_by not in ("rank", "replica"):
            raise ConfigError(f"faults.phase_skew_by={f.phase_skew_by!r}: expected 'rank' or 'replica'")
        f._rng = random.Random(f.seed)
        return f

    @property
    def active(self) -> bool:
        return any(getattr(self, k) not in (0, 0.0, None) for k in KEYS
                   if k not in ("seed", "p_error_layer", "phase_skew_by", "hang_outlives_shutdown"))

    # ------------------------------------------------------------ injection points
    def d_skew_s(self) -> float:
        s = self.d_skew_ms
        if self.d_skew_random_ms:
            s += self._rng.uniform(0.0, self.d_skew_random_ms)
        return s / 1e3

    def phase_skew_s(self, dp_rank: int, tp_rank: int) -> tuple[float, float]:
        """(D delay, P collective delay) of this rank, seconds (``phase_skew_ms``; the D delay goes
        before the iteration, or before its first crossed collective where the groups cross)."""
        s = self.phase_skew_ms / 1e3
        parity = dp_rank if self.phase_skew_by == "replica" else dp_rank + tp_rank
        return (s, 0.0) if parity % 2 == 0 else (0.0, s)

    def d_item(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The function of the next D iteration's stream item: ``fn``, or (``hang_d_iteration``)
        one that blocks its stream until :meth:`release_hangs`, then fails."""
        self._d_items += 1
        if self.hang_d_iteration != self._d_items:
            return fn
        n, unhang = self._d_items, self._unhang

        def hung_d_iteration(*args: Any) -> Any:
            unhang.wait(HANG_CAP_S)
            raise InjectedFault(f"injected device hang: D iteration {n} never completed (released at shutdown)")
        return hung_d_iteration

    def release_hangs(self) -> None:
        """End every injected hang (the engine's shutdown: its stream threads must be joinable),
        unless it outlives the shutdown (``hang_outlives_shutdown``)."""
        if not self.hang_outlives_shutdown:
            self._unhang.set()

    def end_hangs(self) -> None:
        """End every injected hang, one that outlives the shutdown too (a test's cleanup)."""
        self._unhang.set()

    def on_p_segment(self, epoch: int, layer: int) -> None:
        """Runs on the P stream inside a segment."""
        if self.p_delay_ms:
            time.sleep(self.p_delay_ms / 1e3)
        if self.p_error_epoch is not None and epoch == self.p_error_epoch and layer == self.p_error_layer:
            raise InjectedFault(f"injected error inside P segment (epoch {epoch}, layer {layer})")


class FaultyRendezvous:
    """Wraps a rendezvous and corrupts the n-th control message of this rank."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.n = 0

    async def arrive(self, tag: str, payload: tuple[int, ...], *, epoch=None, boundary=None):
        import asyncio
        self.n += 1
        f = self.faults
        if f.drop_rendezvous == self.n:
            await asyncio.sleep(3600)          # this rank never arrives: its peers must time out
        if f.stale_rendezvous == self.n:
            payload = tuple(-1 for _ in payload)
        out = await self.inner.arrive(tag, payload, epoch=epoch, boundary=boundary)
        if f.duplicate_rendezvous == self.n:
            out = await self.inner.arrive(tag, payload, epoch=epoch, boundary=boundary)
        return out

    async def close(self) -> None:
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
