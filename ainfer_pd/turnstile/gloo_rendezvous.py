"""The turnstile's rendezvous over a gloo process group (works across hosts): every rank's row
exchanged by a plain ``all_gather`` (or a SUM all-reduce of a zeroed (world, row) board), on a
dedicated daemon thread (``mode="thread"``) or issued ``async_op`` and polled from the loop
(``mode="poll"``); each rank bumps its arrival counter in the store first, so a timeout names
who never arrived. Overview: :mod:`ainfer_pd.turnstile.dist_rendezvous`."""
from __future__ import annotations

import asyncio
import datetime as _dt
import queue
import threading
import time
from typing import Any

from ..errors import DistributedError
from .rendezvous_base import MAX_PAYLOAD, RendezvousBase, in_daemon_thread, resolve_threadsafe, scoped_name

__all__ = ["GlooRendezvous"]


class GlooRendezvous(RendezvousBase):
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
        self.name = scoped_name(name or "gloo")
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
                resolve_threadsafe(loop, fut, exc=e)
            else:
                resolve_threadsafe(loop, fut, rows)

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
                missing = await in_daemon_thread(lambda: self._missing(seq), max(budget_s, 0.5),
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
                    await in_daemon_thread(lambda: t.join(2.0), 3.0, f"ainfer-pd-aux-{self.name}-close")
                except asyncio.TimeoutError:
                    pass
