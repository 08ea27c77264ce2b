"""A multi-rank verl replica: one ainfer-pd rank per GPU of the replica's slice.

The server's process (the Ray actor verl placed on the replica's node) is rank 0: it serves every
request. Ranks 1..g-1 are child processes it starts (``multiprocessing`` spawn context, as vLLM's
engine cores inside verl's actors): each joins ``torch.distributed`` (gloo control world on
127.0.0.1; the engine builds its own data groups, NCCL on CUDA), runs its own
:class:`RolloutWorker` with the lockstep engine (its experts, its attention replica) and follows
rank 0 in lockstep: it takes no requests of its own, joins every P epoch and D iteration through
the engine's step rendezvous, and executes rank 0's control calls (sleep, wake_up, weight sync,
profiling, metrics) sent over a pipe.

Failure: every wait is bounded (``rank_timeout_s``) and names the rank. A follower that dies is
noticed at once (its process sentinel): :class:`RankFailedError` naming it goes to every turn in
flight and every later call; a follower that stops answering a control call within the timeout
raises the same error; the engine's own step rendezvous times out naming the missing rank.

``join_ranks`` is the one place this integration joins the multi-rank world
(:func:`ainfer_pd.launch.init_distributed`); the lockstep engine itself is chosen by the worker.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection as mpc
import os
import time
from typing import Any, Callable, Optional

from ...errors import AInferPDError, RankFailedError

logger = logging.getLogger(__name__)

#: Control calls a follower executes (``op`` -> what it does to its worker).
FOLLOWER_OPS = ("sleep", "wake_up", "update_weights", "metrics", "start_profile", "stop_profile")


def join_ranks(rank: int, world_size: int, port: int, timeout_s: float):
    """Join the replica's ``torch.distributed`` world (blocking; rank 0 hosts the store)."""
    from ...launch import init_distributed
    return init_distributed(rank, world_size, backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                            timeout_s=timeout_s, local_rank=rank)


def leave_ranks() -> None:
    """Leave the replica's world (after the worker closed), so this process can start another."""
    from ...launch import destroy_distributed
    destroy_distributed()


def _free_port() -> int:
    from ...launch import find_free_port
    return find_free_port()


def _pack(exc: BaseException) -> dict:
    from ...launch import _pack_exception
    return _pack_exception(exc)


def _unpack(rank: int, packed: dict) -> BaseException:
    from ...launch import _unpack_exception
    return _unpack_exception(rank, packed)


# ====================================================================== follower side
def follower_main(rank: int, world_size: int, port: int, cfg: dict, conn, timeout_s: float, env: dict) -> None:
    """Entry of a follower process (module level: picklable for the spawn context)."""
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(rank)
    code = 0
    try:
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        join_ranks(rank, world_size, port, timeout_s)
        asyncio.run(_follow(rank, cfg, conn))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to rank 0
        code = 1
        try:
            conn.send(("err", _pack(exc)))
        except Exception:
            pass
    finally:
        os._exit(code)   # a collective blocked on a dead peer must not keep the process alive


async def _follow(rank: int, cfg: dict, conn) -> None:
    from ... import RolloutWorker
    from ...config import WorkerConfig
    from .profiling import TorchProfile

    loop = asyncio.get_running_loop()
    profile: Optional[TorchProfile] = None
    async with RolloutWorker(WorkerConfig.from_dict(cfg)) as w:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                op, args, kw = await loop.run_in_executor(None, conn.recv)
            except (EOFError, OSError):
                # leave at once (the exception skips the wait for every rank to close together)
                raise RankFailedError(f"replica rank {rank}: rank 0 went away", failures={0: "gone"}) from None
            if op == "close":
                break
            try:
                if op == "update_weights":
                    from ...weight_transfer import open_buckets
                    result = await w.update_weights(open_buckets(args[0]), **kw)
                elif op == "metrics":
                    result = ({k: v for k, v in w.metrics().items() if not isinstance(v, (list, dict))},
                              len(w.engine.book.waiting), len(w.engine.book.decoding))
                elif op == "start_profile":
                    profile = TorchProfile(args[0], rank=rank, tag=args[1])
                    result = await profile.start()
                elif op == "stop_profile":
                    result = await profile.stop() if profile is not None else None
                    profile = None
                elif op in ("sleep", "wake_up"):
                    result = await getattr(w, op)(*args, **kw)
                else:
                    raise AInferPDError(f"replica rank {rank}: unknown control call {op!r}")
                conn.send(("ok", result))
            except AInferPDError as exc:
                conn.send(("err", _pack(exc)))
    conn.send(("closed", None))


# ====================================================================== rank 0 side
class ReplicaRanks:
    """Rank 0's handle on the follower processes of one replica."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.failure: Optional[RankFailedError] = None
        self._locks: dict[int, asyncio.Lock] = {}
        self._on_failure: list[Callable[[RankFailedError], None]] = []
        self._closing = False
        self.started_s = 0.0

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def on_failure(self, fn: Callable[[RankFailedError], None]) -> None:
        self._on_failure.append(fn)

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ start
    @classmethod
    async def start(cls, cfg, make_worker: Callable[[], Any], *, timeout_s: float = 300.0,
                    env: Optional[dict] = None) -> tuple["ReplicaRanks", Any]:
        """Start ranks 1..g-1, join the world as rank 0, build and enter rank 0's worker (made by
        ``make_worker`` in a thread: the engine's process groups are collective) and wait until
        every follower is ready. Returns ``(ranks, worker)``; on any failure everything started
        is stopped and a typed error naming the rank is raised."""
        import torch.multiprocessing as tmp
        g = cfg.parallel.world_size
        self = cls(g, timeout_s)
        t0 = time.monotonic()
        ctx = tmp.get_context("spawn")
        port = _free_port()
        child_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        for r in range(1, g):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=follower_main, name=f"ainfer-pd-replica-rank{r}", daemon=True,
                            args=(r, g, port, cfg.to_dict(), child, self.timeout_s, child_env))
            p.start()
            child.close()
            self.procs[r], self.conns[r] = p, parent
            self._locks[r] = asyncio.Lock()
        self._watch()
        os.environ["LOCAL_RANK"] = "0"
        worker = None
        try:
            await self._race(asyncio.to_thread(join_ranks, 0, g, port, self.timeout_s), "joining the world")
            worker = await self._race(asyncio.to_thread(make_worker), "building the engine")
            await self._race(worker.__aenter__(), "starting the engine")
            for r in self.procs:
                kind, val = await self._race(asyncio.to_thread(self._recv, r, self.timeout_s, "start"), "starting")
                if kind != "ready":
                    raise self._remote_error(r, kind, val, "start")
        except BaseException:
            await self.close(worker)
            raise
        self.started_s = time.monotonic() - t0
        return self, worker

    async def _race(self, aw, what: str):
        """``aw``, unless a follower dies first (then its typed error, at once)."""
        task = asyncio.ensure_future(aw)
        while not task.done():
            await asyncio.wait([task], timeout=0.05)
            if self.failure is not None and not task.done():
                task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved later or never
                raise RankFailedError(f"{self.failure} (while {what})", failures=self.failure.failures)
        return task.result()

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        for r, p in self.procs.items():
            loop.add_reader(p.sentinel, self._died, r)

    def _died(self, r: int) -> None:
        loop = asyncio.get_running_loop()
        p = self.procs[r]
        loop.remove_reader(p.sentinel)
        if self._closing:
            return
        p.join(0.1)
        code = p.exitcode
        why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        err = RankFailedError(f"replica rank {r} of {self.world_size} died ({why})", failures={r: f"died ({why})"})
        logger.error("ainfer_pd: %s", err)
        if self.failure is None:
            self.failure = err
            for fn in self._on_failure:
                fn(err)

    # ------------------------------------------------------------------ control calls
    def _remote_error(self, r: int, kind: str, val: Any, op: str) -> BaseException:
        if kind == "err":
            return _unpack(r, val)
        return RankFailedError(f"replica rank {r}: unexpected reply {kind!r} to {op!r}", failures={r: kind})

    def _recv(self, r: int, timeout_s: float, op: str) -> tuple[str, Any]:
        conn, p = self.conns[r], self.procs[r]
        ready = mpc.wait([conn, p.sentinel], timeout_s)
        if conn in ready or conn.poll():
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        if p.sentinel in ready or not p.is_alive():
            p.join(0.1)
            raise RankFailedError(f"replica rank {r} died (exit code {p.exitcode}) during {op!r}",
                                  failures={r: f"died (exit code {p.exitcode})"})
        raise RankFailedError(f"replica rank {r} did not answer {op!r} within {timeout_s:.0f} s",
                              failures={r: f"no answer to {op!r}"}, unfinished=(r,))

    def _rpc(self, r: int, op: str, args: tuple, kw: dict, timeout_s: float) -> Any:
        try:
            self.conns[r].send((op, args, kw))
        except (BrokenPipeError, OSError) as exc:
            raise RankFailedError(f"replica rank {r} is gone ({exc!r}) at {op!r}", failures={r: "gone"}) from None
        kind, val = self._recv(r, timeout_s, op)
        if kind != "ok":
            raise self._remote_error(r, kind, val, op)
        return val

    async def call(self, op: str, *args: Any, timeout_s: Optional[float] = None, **kw: Any) -> list:
        """``op`` on every follower (concurrently); their results in rank order. The first typed
        error (a follower's own, or :class:`RankFailedError` naming a dead / silent rank) is raised
        after every follower answered or timed out."""
        if op not in FOLLOWER_OPS:
            raise AInferPDError(f"unknown follower call {op!r}; known: {FOLLOWER_OPS}")
        self.check()
        t = self.timeout_s if timeout_s is None else timeout_s

        async def one(r: int):
            async with self._locks[r]:
                fut = asyncio.ensure_future(asyncio.to_thread(self._rpc, r, op, args, kw, t))
                try:
                    return await asyncio.shield(fut)
                except asyncio.CancelledError:
                    await asyncio.wait([fut])      # the reply must be read before the pipe is reused
                    raise
        results = await asyncio.gather(*(one(r) for r in sorted(self.procs)), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return results

    # ------------------------------------------------------------------ stop
    async def close(self, worker: Any = None) -> None:
        """Ask every follower to close, leave rank 0's worker (lockstep ranks leave together),
        then wait for the processes (killed after the timeout). Never hangs."""
        self._closing = True
        for r, c in self.conns.items():
            try:
                c.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass
        error: Optional[BaseException] = None
        if worker is not None:
            try:
                if self.failure is not None:      # no closing handshake with a dead rank
                    await worker.__aexit__(type(self.failure), self.failure, None)
                else:
                    await worker.__aexit__(None, None, None)
            except AInferPDError as exc:
                error = exc
        deadline = time.monotonic() + (5.0 if error is None and self.failure is None else 0.5)
        for r, p in self.procs.items():
            await asyncio.to_thread(p.join, max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("ainfer_pd: replica rank %d did not exit; killing it", r)
                p.kill()
                await asyncio.to_thread(p.join, 2.0)
            try:
                asyncio.get_running_loop().remove_reader(p.sentinel)
            except (ValueError, OSError):
                pass
        for c in self.conns.values():
            c.close()
        if self.failure is None:
            try:
                await asyncio.to_thread(leave_ranks)
            except Exception as exc:  # noqa: BLE001 - leaving must not mask the close
                logger.warning("ainfer_pd: leaving the replica's process group failed: %r", exc)
        if error is not None and self.failure is None:
            raise error
