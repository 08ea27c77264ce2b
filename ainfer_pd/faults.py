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
* ``seed``                - seed of the random skew.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import AInferPDError, ConfigError

KEYS = ("d_skew_ms", "d_skew_random_ms", "p_delay_ms", "slow_counts_ms", "p_error_epoch", "p_error_layer",
        "phase_skew_ms", "phase_skew_by", "drop_rendezvous", "duplicate_rendezvous", "stale_rendezvous", "seed")


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
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

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
                   if k not in ("seed", "p_error_layer", "phase_skew_by"))

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
