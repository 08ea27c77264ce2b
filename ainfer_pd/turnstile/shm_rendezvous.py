"""The turnstile's same-host rendezvous on a shared-memory board (an mmap of a file in /dev/shm,
one block per rank; the wait polls inline, then on a waiter thread). Memory ordering relies on
x86-64 TSO. Overview: :mod:`ainfer_pd.turnstile.dist_rendezvous`."""
from __future__ import annotations

import asyncio
import datetime as _dt
import mmap
import os
import queue
import threading
import time
import uuid
from typing import Any

from ..errors import DistributedError, RendezvousTimeout
from .rendezvous_base import MAX_PAYLOAD, RendezvousBase, in_daemon_thread, resolve_threadsafe, scoped_name

__all__ = ["ShmRendezvous"]

_MAGIC = 0x41494E46_50445231       # "AINFPDR1"
_HDR_WORDS = 8                      # magic, version, world_size, max_payload, stride, 0, 0, 0
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class ShmRendezvous(RendezvousBase):
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
        side = self._side_store(store, name)
        self._map_board(side, nbytes, deadline)
        board = np.frombuffer(self._mm, dtype=np.int64)
        self._np = np
        self._attach(board, max_payload, deadline)
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()

    # ------------------------------------------------------------- setup
    def _side_store(self, store: Any, name: str | None) -> Any:
        """Set the board's name; the store through which rank 0 publishes the board (None without
        a store: every rank derives the file from ``name``)."""
        side = None
        if store is not None:
            import torch.distributed as dist
            self.name = scoped_name(name or "shm")
            side = dist.PrefixStore(f"ainfer_pd/rdzv/{self.name}", store)
        elif name is None:
            raise DistributedError("ShmRendezvous needs a store or an explicit board name shared by all ranks")
        if side is None:
            self.name = str(name)
        return side

    def _map_board(self, side: Any, nbytes: int, deadline: float) -> None:
        """Rank 0 creates the board file (and publishes its path); the others open it; every rank
        maps it (``self._mm``). A failure unlinks rank 0's file."""
        rank = self.rank
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
                fd = self._open_board(fname, nbytes, side, deadline)
            self._mm = mmap.mmap(fd, nbytes)
        except BaseException:
            if rank == 0 and self.path:
                _unlink_quiet(self.path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def _open_board(self, fname: str, nbytes: int, side: Any, deadline: float) -> int:
        """Rank > 0: wait until rank 0's board file (published in ``side``, else ``fname``) exists
        at its full size; its open descriptor (closed here on a failure)."""
        rank = self.rank
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
        fd = -1
        try:
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    if os.fstat(fd).st_size >= nbytes:
                        return fd
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
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def _attach(self, board: Any, max_payload: int, deadline: float) -> None:
        """Views of the mapped board; rank 0 writes the header, the others check it; every rank
        marks itself attached and rank 0 unlinks the file once all are. A failure releases the
        mapping (and unlinks rank 0's file)."""
        rank, world_size = self.rank, self.world_size
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
            resolve_threadsafe(loop, fut, ok)

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
                await in_daemon_thread(lambda: t.join(2.0), 3.0, "ainfer-pd-aux-shm-close")
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
