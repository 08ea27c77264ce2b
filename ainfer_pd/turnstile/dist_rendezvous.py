"""All-rank CPU rendezvous for the turnstile (SPEC 3.2), awaited from the event loop.

Every implementation follows the :class:`Rendezvous` protocol: ``await rdv.arrive(tag, payload,
epoch=, boundary=)`` returns every rank's payload (index = rank) once all ranks have arrived
at the same rendezvous. The caller checks agreement (:func:`require_agreement`). Ranks must
arrive at the same sequence of tags; a different tag at the same round raises
:class:`RendezvousMismatch`. A rendezvous that does not complete within ``timeout_s`` raises
:class:`RendezvousTimeout` naming the missing ranks, the epoch and the boundary; after a
timeout or transport failure the object is broken (further ``arrive`` raises
:class:`DistributedError`).

* :class:`GlooRendezvous`: every rank's fixed-size int64 row exchanged over a dedicated gloo group
  (a plain ``all_gather``, or optionally a SUM all-reduce of a zeroed (world, row) board).
  The blocking collective runs on a dedicated daemon thread (``mode="thread"``, default) or is
  issued with ``async_op=True`` and polled from the loop (``mode="poll"``). Each rank bumps its
  arrival counter in the ``torch.distributed`` store before entering the collective, so a
  timeout can name who never arrived.
* :class:`ShmRendezvous`: same-host fast path. A shared-memory board (an mmap of a file in
  /dev/shm) with one block per rank: arrival sequence number plus two payload rows (indexed by
  sequence parity, so a fast rank writing round k+1 never overwrites a row a slow rank still
  reads for round k). Arrive = write own row, publish own sequence number, wait until every
  rank's sequence number is >= ours, read. The wait polls inline for at most a few tens of
  microseconds, then hands off to a waiter thread (spin with ``sched_yield``, then short sleeps
  with backoff) that resolves a future via ``call_soon_threadsafe``. The board file is unlinked by rank 0 as soon as every rank has
  mapped it, so no segment leaks even if a process is killed later.
* :func:`make_rendezvous` picks shm when ``fast_rendezvous`` and all ranks share a host,
  otherwise gloo; a single rank gets :class:`SingleRankRendezvous`.

Memory ordering of the board relies on x86-64 TSO (aligned 8-byte stores are atomic, stores
are not reordered with stores nor loads with loads); it is not meant for weakly ordered CPUs.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import mmap
import os
import queue
import socket
import threading
import time
import uuid
import zlib
from typing import Any, Protocol, runtime_checkable

from ..errors import DistributedError, RendezvousMismatch, RendezvousTimeout

__all__ = ["Rendezvous", "GlooRendezvous", "ShmRendezvous", "SingleRankRendezvous", "make_rendezvous",
           "require_agreement", "detect_same_host", "MAX_PAYLOAD"]

MAX_PAYLOAD = 8
"""Default number of int64 payload entries one rank may send per rendezvous."""
_NONE = -(2 ** 63)                   # encodes epoch/boundary None
_I64_MIN, _I64_MAX = -(2 ** 63) + 1, 2 ** 63 - 1
_HDR = 5                             # row: seq, tag crc, epoch, boundary, n, payload...
_name_uses: dict[str, int] = {}


def _scoped(base: str) -> str:
    """``base#n``: the n-th rendezvous of this process under ``base``. Store keys are scoped by
    it, so re-using a name (or the default per-kind name) never reads an earlier instance's
    keys. Ranks must create their rendezvous objects of one name in the same order."""
    n = _name_uses.get(base, 0)
    _name_uses[base] = n + 1
    return f"{base}#{n}"


@runtime_checkable
class Rendezvous(Protocol):
    """The interface the turnstile awaits (same signature as ``turnstile/rendezvous.py``)."""

    rank: int
    world_size: int

    async def arrive(self, tag: str, payload: tuple[int, ...], *, epoch: int | None = None,
                     boundary: int | None = None) -> list[tuple[int, ...]]: ...

    async def close(self) -> None: ...


def require_agreement(results: list[tuple[int, ...]], *, what: str = "payload", tag: str = "",
                      epoch: int | None = None, boundary: int | None = None) -> tuple[int, ...]:
    """Return the common payload or raise :class:`RendezvousMismatch` naming who disagrees."""
    if not results:
        raise RendezvousMismatch(f"rendezvous {tag!r}: no payloads")
    first = results[0]
    bad = [r for r, p in enumerate(results) if p != first]
    if bad:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, p in enumerate(results):
            groups.setdefault(tuple(p), []).append(r)
        desc = "; ".join(f"ranks {rs}: {p}" for p, rs in groups.items())
        raise RendezvousMismatch(f"ranks disagree on the {what} at rendezvous {tag!r} "
                                 f"(epoch={epoch}, boundary={boundary}): {desc}")
    return tuple(first)


def _tag_crc(tag: str) -> int:
    return zlib.crc32(tag.encode())


def _opt(v: int | None) -> int:
    return _NONE if v is None else int(v)


def detect_same_host(store: Any, rank: int, world_size: int, *, key: str = "ainfer_pd/host",
                     timeout_s: float = 30.0) -> bool:
    """True when every rank reports the same host identity (hostname + boot id).

    Collective over the store: every rank must call it with the same ``key``.
    """
    ident = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            ident += "/" + f.read().strip()
    except OSError:
        pass
    store.set(f"{key}/{rank}", ident)
    keys = [f"{key}/{r}" for r in range(world_size)]
    store.wait(keys, _dt.timedelta(seconds=timeout_s))
    return all(store.get(k).decode() == ident for k in keys)


# ====================================================================== common
class _Base:
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


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any = None,
                        exc: BaseException | None = None) -> None:
    try:
        if exc is None:
            loop.call_soon_threadsafe(_set_result, fut, value)
        else:
            loop.call_soon_threadsafe(_set_exception, fut, exc)
    except RuntimeError:  # loop closed: nobody waits any more
        pass


async def _in_daemon_thread(fn, timeout_s: float, name: str):
    """Run a blocking call on a fresh daemon thread; await it with a bound (never joins)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            v = fn()
        except BaseException as e:  # noqa: BLE001
            _resolve_threadsafe(loop, fut, exc=e)
        else:
            _resolve_threadsafe(loop, fut, v)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wait_for(fut, timeout_s)


# ====================================================================== single rank
class SingleRankRendezvous(_Base):
    """World size 1: every rendezvous completes at once (keeps the same checks)."""

    kind = "single"

    def __init__(self, timeout_s: float = 30.0, *, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__(0, 1, timeout_s, max_payload)

    async def arrive(self, tag: str, payload: tuple[int, ...], *, epoch: int | None = None,
                     boundary: int | None = None) -> list[tuple[int, ...]]:
        self._check_usable()
        self._seq += 1
        row = self._encode(self._seq, tag, payload, epoch, boundary)
        self.rounds += 1
        return self._decode([row], self._seq, tag, epoch, boundary)

    async def close(self) -> None:
        self._closed = True


# ====================================================================== gloo
class GlooRendezvous(_Base):
    """Rendezvous over a gloo process group (works across hosts).

    ``group``: a gloo group over the participating ranks (``build_process_groups(...)["control"]``);
    ``None`` creates a new gloo group over the whole world (a collective call). ``store``: the
    side channel (default: the store of :func:`ainfer_pd.launch.init_distributed`). All ranks
    must create their rendezvous objects in the same order (the store keys are derived from a
    per-kind counter, or from ``name`` plus a per-name counter). Give the group a gloo timeout close
    to ``timeout_s`` so a collective stuck on a dead peer also unblocks its thread.
    """

    kind = "gloo"

    def __init__(self, group: Any = None, timeout_s: float = 30.0, *, store: Any = None,
                 name: str | None = None, max_payload: int = MAX_PAYLOAD, mode: str = "thread",
                 collective: str = "all_gather") -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DistributedError("GlooRendezvous needs torch.distributed initialised (ainfer_pd.launch.init_distributed)")
        if mode not in ("thread", "poll"):
            raise DistributedError(f"GlooRendezvous mode must be 'thread' or 'poll', got {mode!r}")
        if group is None:
            group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
        rank, ws = dist.get_rank(group), dist.get_world_size(group)
        super().__init__(rank, ws, timeout_s, max_payload)
        self._torch, self._dist = torch, dist
        self._group = group
        self._global = [dist.get_global_rank(group, i) if group is not dist.group.WORLD else i for i in range(ws)]
        self.mode = mode
        if store is None:
            from ..launch import get_store
            store = get_store()
        self.name = _scoped(name or "gloo")
        self._side = dist.PrefixStore(f"ainfer_pd/rdzv/{self.name}", store)
        if collective not in ("all_reduce", "all_gather"):
            raise DistributedError(f"GlooRendezvous collective must be all_reduce or all_gather, got {collective!r}")
        self.collective = collective
        self._send = torch.zeros(self._row, dtype=torch.int64)
        self._recv = [torch.zeros(self._row, dtype=torch.int64) for _ in range(ws)]
        self._board = torch.zeros(ws, self._row, dtype=torch.int64)
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if mode == "thread":
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._worker, name=f"ainfer-pd-rdzv-{self.name}-r{rank}",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------- blocking part
    def _collective(self, row: list[int]) -> list[list[int]]:
        work, result = self._issue(row, self._send, self._recv, self._board)
        # side channel (my arrival count = seq), written while the collective is in flight:
        # it is only read on a timeout, seconds later
        self._side.add(f"arrived/{self.rank}", 1)
        work.wait()
        return result()

    def _issue(self, row: list[int], send, recv, board):
        """Start the exchange (async work) and return (work, reader of the gathered rows).

        ``all_gather`` (default): the plain gather of the rows. ``all_reduce``: every rank writes
        its row into a zeroed (world, row) board and the board is SUM-reduced (an all-gather in
        effect; kept as an option because gloo's tiny all-reduce can beat its all-gather -- the
        benchmark compares both)."""
        torch, dist = self._torch, self._dist
        if self.collective == "all_reduce":
            board.zero_()
            board[self.rank] = torch.tensor(row, dtype=torch.int64)
            work = dist.all_reduce(board, group=self._group, async_op=True)
            return work, board.tolist
        send.copy_(torch.tensor(row, dtype=torch.int64))
        work = dist.all_gather(recv, send, group=self._group, async_op=True)
        return work, lambda: torch.stack(recv).tolist()

    def _worker(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fut, row = job
            try:
                rows = self._collective(row)
            except BaseException as e:  # noqa: BLE001
                _resolve_threadsafe(loop, fut, exc=e)
            else:
                _resolve_threadsafe(loop, fut, rows)

    def _missing(self, seq: int) -> list[int]:
        """Global ranks whose arrival count is below ``seq`` (blocking store reads)."""
        return [self._global[r] for r in range(self.world_size)
                if self._side.add(f"arrived/{r}", 0) < seq]

    async def _diagnose(self, seq: int, budget_s: float, settle_s: float = 0.0) -> tuple[list[int], str]:
        """Read the side channel off the loop (bounded); keep re-reading for up to ``settle_s``
        so that live ranks arriving a little late (after a fast transport error) are not blamed."""
        try:
            settle_end = time.perf_counter() + settle_s
            while True:
                missing = await _in_daemon_thread(lambda: self._missing(seq), max(budget_s, 0.5),
                                                  f"ainfer-pd-aux-{self.name}-diag")
                if not missing or time.perf_counter() >= settle_end:
                    return missing, ""
                await asyncio.sleep(0.05)
        except Exception as exc:  # store unreachable: it lives in global rank 0's process
            return [self._global[0]] if self.rank != 0 else [], \
                f"store side channel unreachable ({type(exc).__name__}: {exc}); rank 0 hosts it"

    # ------------------------------------------------------------- protocol
    async def arrive(self, tag: str, payload: tuple[int, ...], *, epoch: int | None = None,
                     boundary: int | None = None) -> list[tuple[int, ...]]:
        seq, row, t0 = self._next_round(tag, payload, epoch, boundary)
        deadline = t0 + self.timeout_s
        self._inflight = True
        try:
            rows = await self._exchange(row, deadline, seq, tag, epoch, boundary, t0)
        finally:
            self._inflight = False
        out = self._decode(rows, seq, tag, epoch, boundary)
        self.rounds += 1
        self.total_wait_s += time.perf_counter() - t0
        return out

    async def _exchange(self, row: list[int], deadline: float, seq: int, tag: str, epoch: int | None,
                        boundary: int | None, t0: float) -> list[list[int]]:
        try:
            if self.mode == "thread":
                return await self._arrive_thread(row, deadline)
            return await self._arrive_poll(row, deadline)
        except asyncio.TimeoutError:
            missing, extra = await self._diagnose(seq, 2.0)
            raise self._timeout(tag, seq, missing, epoch, boundary, time.perf_counter() - t0, extra) from None
        except (DistributedError, asyncio.CancelledError):
            raise
        except Exception as exc:  # gloo transport error: peer closed, gloo-level timeout
            remaining = deadline - time.perf_counter()
            missing, extra = await self._diagnose(seq, 2.0, settle_s=max(0.0, min(0.5, remaining)))
            cause = f"collective failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not missing:
                self._broken = cause
                raise DistributedError(f"gloo rendezvous {tag!r} round {seq} on rank {self.rank} "
                                       f"(epoch={epoch}, boundary={boundary}): {cause}") from exc
            err = self._timeout(tag, seq, missing, epoch, boundary, time.perf_counter() - t0,
                                cause + (f"; {extra}" if extra else ""), failed=True)
            raise err from exc

    async def _arrive_thread(self, row: list[int], deadline: float) -> list[list[int]]:
        assert self._jobs is not None
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, row))
        return await asyncio.wait_for(fut, max(0.0, deadline - time.perf_counter()))

    async def _arrive_poll(self, row: list[int], deadline: float) -> list[list[int]]:
        torch = self._torch
        send = torch.empty(self._row, dtype=torch.int64)      # fresh buffers: a cancelled arrive's
        recv = [torch.empty_like(send) for _ in range(self.world_size)]   # work may still run
        work, result = self._issue(row, send, recv, torch.empty(self.world_size, self._row, dtype=torch.int64))
        self._side.add(f"arrived/{self.rank}", 1)
        spins = 0
        while not work.is_completed():
            if time.perf_counter() > deadline:
                raise asyncio.TimeoutError
            spins += 1
            await asyncio.sleep(0 if spins < 2000 else 0.0005)
        work.wait()
        return result()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._jobs is not None:
            self._jobs.put(None)
            t = self._thread
            if t is not None and t.is_alive() and self._broken is None:
                # healthy: the worker is idle or finishing a collective; a broken one may be
                # stuck until the gloo timeout (daemon thread, never joined then)
                try:
                    await _in_daemon_thread(lambda: t.join(2.0), 3.0, f"ainfer-pd-aux-{self.name}-close")
                except asyncio.TimeoutError:
                    pass


# ====================================================================== shared memory
_MAGIC = 0x41494E46_50445231       # "AINFPDR1"
_HDR_WORDS = 8                      # magic, version, world_size, max_payload, stride, 0, 0, 0
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class ShmRendezvous(_Base):
    """Same-host rendezvous on a shared-memory board (one block per rank).

    Rank 0 creates the board file (``/dev/shm/ainfer_pd_rdzv_<id>``) and publishes its name
    through ``store`` (or, without a store, every rank passes the same ``name``, e.g. derived
    from a run id). Construction is collective and blocking (bounded by ``timeout_s``): every
    rank maps the board, then rank 0 unlinks the file.

    Waiting, in order: ``inline_spin_s`` (default 50 us) of synchronous polling on the loop
    thread (bounded, like any short callback: when ranks are in step the round completes here,
    ~5-10 us); then ``loop_spin_s`` (default 0) of ``await asyncio.sleep(0)`` polling (other
    tasks run); then the wait is handed to this rank's waiter thread, which spins with
    ``sched_yield`` for ``thread_spin_s`` (default 500 us), then sleeps with backoff
    (50 us .. 1 ms) until the deadline, and resolves an asyncio future with
    ``call_soon_threadsafe``. The loop is free during the thread phase.
    """

    kind = "shm"

    def __init__(self, rank: int, world_size: int, timeout_s: float = 30.0, *, store: Any = None,
                 name: str | None = None, max_payload: int = MAX_PAYLOAD, inline_spin_s: float = 50e-6,
                 loop_spin_s: float = 0.0, thread_spin_s: float = 500e-6) -> None:
        import numpy as np

        super().__init__(rank, world_size, timeout_s, max_payload)
        if _SHM_DIR is None:  # pragma: no cover - non-Linux
            raise DistributedError("ShmRendezvous needs /dev/shm")
        self.inline_spin_s = inline_spin_s
        self.loop_spin_s = loop_spin_s
        self.thread_spin_s = thread_spin_s
        self._stride = -(-(2 + 2 * self._row) // 8) * 8      # block words, cache-line multiple
        nwords = _HDR_WORDS + world_size * self._stride
        nbytes = nwords * 8
        deadline = time.monotonic() + self.timeout_s
        side = None
        if store is not None:
            import torch.distributed as dist
            self.name = _scoped(name or "shm")
            side = dist.PrefixStore(f"ainfer_pd/rdzv/{self.name}", store)
        elif name is None:
            raise DistributedError("ShmRendezvous needs a store or an explicit board name shared by all ranks")
        if side is None:
            self.name = str(name)
        fname = "ainfer_pd_rdzv_" + (self.name if side is None else uuid.uuid4().hex[:16])
        self.path = ""
        fd = -1
        try:
            if rank == 0:
                self.path = os.path.join(_SHM_DIR, fname)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, nbytes)
                if side is not None:
                    side.set("board", self.path)
            else:
                if side is not None:
                    try:
                        side.wait(["board"], _dt.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                    except Exception as exc:
                        raise RendezvousTimeout(
                            f"shm rendezvous setup on rank {rank}: rank 0 did not publish the board "
                            f"within {self.timeout_s:g} s ({exc})", missing_ranks=(0,)) from None
                    self.path = side.get("board").decode()
                else:
                    self.path = os.path.join(_SHM_DIR, fname)
                while True:
                    try:
                        fd = os.open(self.path, os.O_RDWR)
                        if os.fstat(fd).st_size >= nbytes:
                            break
                        os.close(fd)
                        fd = -1
                    except FileNotFoundError:
                        if side is not None:
                            raise DistributedError(
                                f"shm rendezvous on rank {rank}: board {self.path} published by rank 0 is not "
                                f"visible here (ranks are not on one host / do not share /dev/shm); use gloo") from None
                    if time.monotonic() > deadline:
                        raise RendezvousTimeout(f"shm rendezvous setup on rank {rank}: board {self.path} "
                                                f"not created by rank 0 within {self.timeout_s:g} s",
                                                missing_ranks=(0,))
                    time.sleep(0.001)
            self._mm = mmap.mmap(fd, nbytes)
        except BaseException:
            if rank == 0 and self.path:
                _unlink_quiet(self.path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

        board = np.frombuffer(self._mm, dtype=np.int64)
        self._np = np
        self._board = board
        self._blocks = board[_HDR_WORDS:].reshape(world_size, self._stride)
        self._seqs = self._blocks[:, 0]              # strided view: every rank's arrival seq
        self._attached = self._blocks[:, 1]
        self._me = self._blocks[rank]
        try:
            if rank == 0:
                board[1:5] = (1, world_size, max_payload, self._stride)
                board[0] = _MAGIC                     # header complete
            else:
                while board[0] != _MAGIC:
                    if time.monotonic() > deadline:
                        raise RendezvousTimeout(f"shm rendezvous setup on rank {rank}: board header not "
                                                f"initialised by rank 0", missing_ranks=(0,))
                    time.sleep(0.0005)
                if tuple(board[2:5]) != (world_size, max_payload, self._stride):
                    raise DistributedError(f"shm rendezvous board {self.path} has layout {tuple(board[2:5])}, "
                                           f"expected {(world_size, max_payload, self._stride)}")
            self._me[1] = 1                           # attached
            if rank == 0:
                while not bool((self._attached == 1).all()):
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world_size) if self._attached[r] != 1]
                        raise RendezvousTimeout(f"shm rendezvous setup: ranks {missing} did not map the board "
                                                f"within {self.timeout_s:g} s", missing_ranks=tuple(missing))
                    time.sleep(0.0005)
                _unlink_quiet(self.path)              # every rank has it mapped: nothing can leak
        except BaseException:
            if rank == 0:
                _unlink_quiet(self.path)
            self._release()
            raise
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()

    # ------------------------------------------------------------- board access
    def _ready(self, seq: int) -> bool:
        return int(self._seqs.min()) >= seq

    def _read(self, seq: int) -> list[list[int]]:
        off = 2 + (seq & 1) * self._row
        return self._blocks[:, off:off + self._row].tolist()

    def _missing(self, seq: int) -> list[int]:
        return [r for r in range(self.world_size) if int(self._seqs[r]) < seq]

    # ------------------------------------------------------------- waiter thread
    def _waiter(self) -> None:
        assert self._jobs is not None
        sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fut, seq, deadline = job
            spin_end = time.perf_counter() + self.thread_spin_s
            sleep = 50e-6
            ok = False
            while True:
                if self._ready(seq):
                    ok = True
                    break
                if fut.done() or self._closed:            # cancelled by the awaiting task
                    break
                now = time.perf_counter()
                if now >= deadline:
                    break
                if now < spin_end:
                    sched_yield()
                else:
                    time.sleep(min(sleep, max(0.0, deadline - now)))
                    sleep = min(sleep * 2, 1e-3)
            _resolve_threadsafe(loop, fut, ok)

    def _ensure_waiter(self) -> queue.SimpleQueue:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._waiter, name=f"ainfer-pd-rdzv-shm-r{self.rank}",
                                            daemon=True)
            self._thread.start()
        return self._jobs

    # ------------------------------------------------------------- protocol
    async def arrive(self, tag: str, payload: tuple[int, ...], *, epoch: int | None = None,
                     boundary: int | None = None) -> list[tuple[int, ...]]:
        seq, row, t0 = self._next_round(tag, payload, epoch, boundary)
        off = 2 + (seq & 1) * self._row
        me = self._me
        me[off + 1:off + self._row] = row[1:]
        me[off] = seq                                   # row stamp after the row
        me[0] = seq                                     # publish arrival last
        if not self._ready(seq):
            end = t0 + self.inline_spin_s                # bounded inline spin (a few us)
            while time.perf_counter() < end:
                if self._ready(seq):
                    break
            else:
                self._inflight = True
                try:
                    await self._wait(seq, t0, tag, epoch, boundary)
                finally:
                    self._inflight = False
        out = self._decode(self._read(seq), seq, tag, epoch, boundary)
        self.rounds += 1
        self.total_wait_s += time.perf_counter() - t0
        return out

    async def _wait(self, seq: int, t0: float, tag: str, epoch: int | None, boundary: int | None) -> None:
        deadline = t0 + self.timeout_s
        spin_end = t0 + self.loop_spin_s
        while time.perf_counter() < spin_end:           # short spin on the loop: others still run
            await asyncio.sleep(0)
            if self._ready(seq):
                return
            if self._closed:
                raise DistributedError("shm rendezvous closed while waiting")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._ensure_waiter().put((loop, fut, seq, deadline))
        try:
            ok = await asyncio.wait_for(fut, self.timeout_s + 5.0)   # the thread owns the deadline
        except asyncio.TimeoutError:
            ok = False
        if ok:
            return
        if self._closed:
            raise DistributedError("shm rendezvous closed while waiting")
        if self._ready(seq):
            return
        raise self._timeout(tag, seq, self._missing(seq), epoch, boundary, time.perf_counter() - t0)

    def _release(self) -> None:
        self._seqs = self._attached = self._me = self._blocks = self._board = None  # type: ignore[assignment]
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view still alive somewhere: the mapping goes with the process
                pass
            self._mm = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t = self._thread
        if self._jobs is not None:
            self._jobs.put(None)
        if t is not None and t.is_alive():
            try:
                await _in_daemon_thread(lambda: t.join(2.0), 3.0, "ainfer-pd-aux-shm-close")
            except asyncio.TimeoutError:
                pass
        if self.rank == 0 and self.path:
            _unlink_quiet(self.path)                    # normally already gone
        if t is None or not t.is_alive():
            self._release()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ====================================================================== factory
def make_rendezvous(parallel_cfg: Any, topology: Any, *, same_host: bool, group: Any = None,
                    store: Any = None, name: str | None = None, **kwargs: Any) -> Rendezvous:
    """The rendezvous for this rank: shm when ``parallel_cfg.fast_rendezvous`` and
    ``same_host``, otherwise gloo over ``group`` (default: a new gloo group over the world;
    pass ``build_process_groups(...)["control"]``). Collective: every rank calls it in the same
    order. ``kwargs`` go to the implementation (``mode=``, ``loop_spin_s=``, ``max_payload=``)."""
    timeout = parallel_cfg.rendezvous_timeout_s
    if topology.world_size == 1:
        return SingleRankRendezvous(timeout, **{k: v for k, v in kwargs.items() if k == "max_payload"})
    if parallel_cfg.fast_rendezvous and same_host:
        if store is None:
            from ..launch import get_store
            store = get_store()
        return ShmRendezvous(topology.rank, topology.world_size, timeout, store=store, name=name, **kwargs)
    return GlooRendezvous(group, timeout, store=store, name=name, **kwargs)
