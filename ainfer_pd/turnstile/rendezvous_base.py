"""What every rendezvous of the turnstile shares (SPEC 3.2): the fixed-size int64 row one rank
sends per round (sequence number, tag CRC, epoch, boundary, payload length, payload), its checks
(payload size and range, every rank at the same round and tag), the typed timeout naming the
missing ranks, per-name store scoping, and the helpers that resolve an asyncio future from a
daemon thread. The protocol itself is :class:`~ainfer_pd.turnstile.rendezvous.Rendezvous`.
"""
from __future__ import annotations

import asyncio
import threading
import time
import zlib
from typing import Any

from ..errors import DistributedError, RendezvousMismatch, RendezvousTimeout

__all__ = ["MAX_PAYLOAD", "RendezvousBase", "in_daemon_thread", "resolve_threadsafe", "scoped_name"]

MAX_PAYLOAD = 16
"""Default number of int64 payload entries one rank may send per rendezvous (a step's
:class:`~ainfer_pd.sched.step.StepInputs` takes 13)."""
_NONE = -(2 ** 63)                   # encodes epoch/boundary None
_I64_MIN, _I64_MAX = -(2 ** 63) + 1, 2 ** 63 - 1
_HDR = 5                             # row: seq, tag crc, epoch, boundary, n, payload...
_name_uses: dict[str, int] = {}


def scoped_name(base: str) -> str:
    """``base#n``: the n-th rendezvous of this process under ``base``. Store keys are scoped by
    it, so re-using a name (or the default per-kind name) never reads an earlier instance's
    keys. Ranks must create their rendezvous objects of one name in the same order."""
    n = _name_uses.get(base, 0)
    _name_uses[base] = n + 1
    return f"{base}#{n}"


def _tag_crc(tag: str) -> int:
    return zlib.crc32(tag.encode())


def _opt(v: int | None) -> int:
    return _NONE if v is None else int(v)


class RendezvousBase:
    kind = "base"

    def __init__(self, rank: int, world_size: int, timeout_s: float, max_payload: int) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise DistributedError(f"rendezvous: rank {rank} outside [0, {world_size})")
        if timeout_s <= 0:
            raise DistributedError("rendezvous: timeout_s must be > 0")
        if max_payload < 0:
            raise DistributedError("rendezvous: max_payload must be >= 0")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.max_payload = max_payload
        self._row = _HDR + max_payload
        self._seq = 0
        self._broken: str | None = None
        self._closed = False
        self._inflight = False
        self.rounds = 0
        self.total_wait_s = 0.0

    # ------------------------------------------------------------- helpers
    def stats(self) -> dict:
        """Completed rounds and mean cost per rendezvous (ms) as seen by this rank."""
        return {"kind": self.kind, "rounds": self.rounds,
                "mean_ms": (1e3 * self.total_wait_s / self.rounds) if self.rounds else 0.0}

    def _check_usable(self) -> None:
        if self._closed:
            raise DistributedError(f"{self.kind} rendezvous is closed")
        if self._broken is not None:
            raise DistributedError(f"{self.kind} rendezvous is unusable after an earlier failure: {self._broken}")
        if self._inflight:
            raise DistributedError(f"{self.kind} rendezvous: arrive() called while another arrive() of this "
                                   f"rank is in flight (one rendezvous at a time per object)")

    def _next_round(self, tag: str, payload: tuple[int, ...], epoch: int | None,
                    boundary: int | None) -> tuple[int, list[int], float]:
        """Start one round: check the object is usable, number the round, encode this rank's row."""
        self._check_usable()
        seq = self._seq + 1
        row = self._encode(seq, tag, payload, epoch, boundary)
        self._seq = seq
        return seq, row, time.perf_counter()

    def _encode(self, seq: int, tag: str, payload: tuple[int, ...], epoch: int | None,
                boundary: int | None) -> list[int]:
        p = tuple(payload)
        if len(p) > self.max_payload:
            raise DistributedError(f"rendezvous payload of {len(p)} ints exceeds max_payload={self.max_payload}")
        for v in p:
            if isinstance(v, bool) or not isinstance(v, int) or not _I64_MIN <= v <= _I64_MAX:
                raise DistributedError(f"rendezvous payload entries must be int64 integers, got {v!r}")
        row = [seq, _tag_crc(tag), _opt(epoch), _opt(boundary), len(p), *p]
        row.extend([0] * (self._row - len(row)))
        return row

    def _decode(self, rows: list[list[int]], seq: int, tag: str, epoch: int | None,
                boundary: int | None) -> list[tuple[int, ...]]:
        crc = _tag_crc(tag)
        bad_seq = [r for r, row in enumerate(rows) if row[0] != seq]
        if bad_seq:
            self._broken = "sequence mismatch"
            raise RendezvousMismatch(
                f"rendezvous {tag!r} (epoch={epoch}, boundary={boundary}): ranks {bad_seq} are at "
                f"round {[rows[r][0] for r in bad_seq]}, rank {self.rank} at round {seq}")
        bad_tag = [r for r, row in enumerate(rows) if row[1] != crc]
        if bad_tag:
            self._broken = "tag mismatch"
            raise RendezvousMismatch(
                f"rendezvous round {seq}: rank {self.rank} arrived at {tag!r} (epoch={epoch}, "
                f"boundary={boundary}) but ranks {bad_tag} arrived at a different tag")
        return [tuple(row[_HDR:_HDR + row[4]]) for row in rows]

    def _timeout(self, tag: str, seq: int, missing: list[int], epoch: int | None, boundary: int | None,
                 waited: float, extra: str = "", failed: bool = False) -> RendezvousTimeout:
        self._broken = f"{'failure' if failed else 'timeout'} at {tag!r} round {seq}"
        what = "failed" if failed else "timed out"
        msg = (f"{self.kind} rendezvous {tag!r} round {seq} {what} after {waited:.2f} s "
               f"(timeout {self.timeout_s:g} s) on rank {self.rank}: missing ranks {missing} "
               f"at epoch={epoch}, boundary={boundary}")
        if extra:
            msg += f"; {extra}"
        return RendezvousTimeout(msg, missing_ranks=tuple(missing), epoch=epoch, boundary=boundary)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def resolve_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any = None,
                        exc: BaseException | None = None) -> None:
    try:
        if exc is None:
            loop.call_soon_threadsafe(_set_result, fut, value)
        else:
            loop.call_soon_threadsafe(_set_exception, fut, exc)
    except RuntimeError:  # loop closed: nobody waits any more
        pass


async def in_daemon_thread(fn, timeout_s: float, name: str):
    """Run a blocking call on a fresh daemon thread; await it with a bound (never joins)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            v = fn()
        except BaseException as e:  # noqa: BLE001
            resolve_threadsafe(loop, fut, exc=e)
        else:
            resolve_threadsafe(loop, fut, v)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wait_for(fut, timeout_s)
