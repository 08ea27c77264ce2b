"""Process launch helpers: one rank = one process.

* :func:`init_distributed` joins ``torch.distributed`` either from the ``torchrun`` environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or from explicit
  arguments (the spawn path). It creates the ``TCPStore`` itself and keeps it
  (:func:`get_store`): the rendezvous uses it as a side channel to name missing ranks.
* :func:`spawn` starts ``world_size`` real processes (``torch.multiprocessing``, spawn context;
  ``AINFER_PD_START_METHOD=forkserver``: forked from one pre-imported server)
  on 127.0.0.1 with a free port, collects each rank's return value or exception, kills
  stragglers when the deadline passes and reports which ranks did not finish. It never hangs.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import inspect
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

from .errors import DistributedError, RankFailedError
from .exception_transport import pack_exception as _pack_exception  # noqa: F401 - importable from here
from .exception_transport import unpack_exception as _unpack_exception  # noqa: F401 - importable from here
from .rank_results import collect_results, reap_ranks, spawn_failure

__all__ = ["DistContext", "init_distributed", "destroy_distributed", "get_store", "current",
           "find_free_port", "spawn", "is_torchrun"]

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    master_addr: str
    master_port: int
    store: Any
    """The raw store the default group was built on (not prefixed); None if torch made it."""
    torchrun: bool


_CTX: DistContext | None = None


def current() -> DistContext | None:
    """The context :func:`init_distributed` created in this process (None before)."""
    return _CTX


def get_store():
    """The store of this process's ``torch.distributed`` world (the TCPStore we created, or
    torch's default store when some other code initialised the default group)."""
    if _CTX is not None and _CTX.store is not None:
        return _CTX.store
    import torch.distributed as dist
    if not dist.is_initialized():
        raise DistributedError("torch.distributed is not initialised; call init_distributed first")
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as exc:  # pragma: no cover - private API moved
        raise DistributedError(f"cannot reach the default store: {exc}") from None


def is_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_USE_AGENT_STORE" in os.environ


def find_free_port(host: str = LOCALHOST) -> int:
    """A currently free TCP port on ``host`` (127.0.0.1 by default; never 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from None


def _resolve_ranks(rank: int | None, world_size: int | None,
                   local_rank: int | None) -> tuple[int, int, int, int]:
    """``(rank, world_size, local_rank, local_world_size)`` from the arguments, else the
    torchrun environment, else a single rank."""
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        rank, world_size = 0, 1
    if rank is None or world_size is None:
        raise DistributedError("init_distributed: give both rank and world_size (or set RANK and WORLD_SIZE)")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise DistributedError(f"init_distributed: rank={rank} outside [0, world_size={world_size})")
    if local_rank is None:
        local_rank = _env_int("LOCAL_RANK")
        if local_rank is None:
            local_rank = rank
    local_world = _env_int("LOCAL_WORLD_SIZE") or world_size
    return rank, world_size, local_rank, local_world


def _resolve_address(init_method: str | None, world_size: int) -> tuple[str | None, int | None]:
    """The store's ``(host, port)``; ``(None, None)`` for an init method torch resolves itself."""
    addr: str | None = None
    port: int | None = None
    if init_method is None or init_method == "env://":
        addr = os.environ.get("MASTER_ADDR")
        port = _env_int("MASTER_PORT")
        if addr is None or port is None:
            if init_method == "env://" or world_size > 1:
                raise DistributedError("init_distributed: MASTER_ADDR/MASTER_PORT are not set and no "
                                       "init_method was given (use torchrun or init_method='tcp://127.0.0.1:PORT')")
            addr, port = LOCALHOST, find_free_port()
    elif init_method.startswith("tcp://"):
        u = urlparse(init_method)
        addr, port = u.hostname, u.port
        if not addr or not port:
            raise DistributedError(f"init_distributed: malformed init_method {init_method!r}")
    return addr, port


def _make_store(dist: Any, addr: str, port: int, rank: int, world_size: int, timeout: _dt.timedelta):
    """The ``TCPStore`` of the world: rank 0 hosts it (unless torchrun's agent does)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = rank == 0 and not agent_store
    try:
        return dist.TCPStore(addr, int(port), world_size, is_master, timeout=timeout,
                             wait_for_workers=False)
    except Exception as exc:
        raise DistributedError(f"rank {rank}: cannot {'host' if is_master else 'reach'} the store at "
                               f"{addr}:{port}: {exc}") from None


def init_distributed(rank: int | None = None, world_size: int | None = None, *,
                     backend: str = "gloo", init_method: str | None = None,
                     timeout_s: float = 300.0, local_rank: int | None = None,
                     device_id: Any = None) -> DistContext:
    """Initialise the default ``torch.distributed`` group and return this rank's context.

    Rank and world size come from the arguments, else from ``RANK`` / ``WORLD_SIZE``
    (torchrun), else a single rank. The address comes from ``init_method`` ("tcp://host:port"
    or "env://"), else ``MASTER_ADDR`` / ``MASTER_PORT``, else (world size 1 only) a free port
    on 127.0.0.1. ``backend`` is "gloo" (CPU), "nccl" (CUDA) or a torch backend string such as
    "cpu:gloo,cuda:nccl". Idempotent for the same rank / world size.
    """
    global _CTX
    import torch.distributed as dist

    rank, world_size, local_rank, local_world = _resolve_ranks(rank, world_size, local_rank)
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise DistributedError(f"torch.distributed already initialised as rank {dist.get_rank()} of "
                                   f"{dist.get_world_size()}, not {rank} of {world_size}")
        if _CTX is None:
            _CTX = DistContext(rank, world_size, local_rank, local_world, str(dist.get_backend()), "", 0,
                               None, is_torchrun())
        return _CTX

    addr, port = _resolve_address(init_method, world_size)
    timeout = _dt.timedelta(seconds=float(timeout_s))
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size, "timeout": timeout}
    if device_id is not None:
        kwargs["device_id"] = device_id

    store = None
    if addr is not None:
        store = _make_store(dist, addr, port, rank, world_size, timeout)
        dist.init_process_group(store=store, **kwargs)
    else:  # some other init method (file://...): let torch build the store
        dist.init_process_group(init_method=init_method, **kwargs)
    _CTX = DistContext(rank, world_size, local_rank, local_world, backend, addr or "", int(port or 0),
                       store, is_torchrun())
    return _CTX


def destroy_distributed() -> None:
    global _CTX
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    _CTX = None


# ====================================================================== spawn
def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, conn: Any,
                 backend: str, init: bool, env: dict, linger_s: float) -> None:
    os.environ.clear()                 # the parent's environment at spawn time (forkserver: not the server's)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": LOCALHOST,
                       "MASTER_PORT": str(port)})
    code = 0
    ctx = None
    try:
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        if init:
            ctx = init_distributed(rank, world_size, backend=backend,
                                   init_method=f"tcp://{LOCALHOST}:{port}")
        if inspect.iscoroutinefunction(fn):
            result = asyncio.run(fn(rank, world_size, *args))
        else:
            result = fn(rank, world_size, *args)
            if inspect.iscoroutine(result):
                result = asyncio.run(result)
        try:
            conn.send(("ok", result))
        except Exception as exc:  # unpicklable result
            conn.send(("err", _pack_exception(
                RankFailedError(f"rank {rank}: return value cannot be sent back: {exc}"))))
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        code = 1
        try:
            conn.send(("err", _pack_exception(exc)))
        except Exception:
            pass
    # The store lives in rank 0's process: rank 0 stays until every rank has finished (bounded).
    if ctx is not None and ctx.store is not None:
        try:
            done = ctx.store.add("ainfer_pd/spawn/done", 1)
            if rank == 0:
                end = time.monotonic() + linger_s
                while done < world_size and time.monotonic() < end:
                    time.sleep(0.01)
                    done = ctx.store.add("ainfer_pd/spawn/done", 0)
        except Exception:
            pass
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # Skip interpreter teardown: a collective still blocked on a dead peer must not
        # keep the process alive (no atexit join of a worker thread).
        os._exit(code)


START_METHOD_ENV = "AINFER_PD_START_METHOD"
"""How :func:`spawn` starts rank processes: ``spawn`` (the default: each rank a fresh interpreter)
or ``forkserver`` (each rank forked from one server process that imported torch and ainfer_pd
once: a 4-rank world of the CPU test suite starts in ~0.1 s instead of ~8 s on the 2-core VM).
The server never touches CUDA, so its ranks may use it. Each rank gets the parent's environment
as it is at the call (as under spawn), but a preloaded module read its import-time settings when the
server started. The test suite sets ``forkserver``."""
START_METHODS = ("spawn", "forkserver")
_PRELOAD = ["torch", "torch.distributed", "ainfer_pd.launch", "ainfer_pd.worker"]


def _process_context(tmp):
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        raise DistributedError(f"{START_METHOD_ENV}={method!r}: expected one of {START_METHODS}")
    ctx = tmp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _start_ranks(ctx: Any, fn: Callable, world_size: int, args: tuple, port: int, backend: str,
                 init: bool, child_env: dict, linger_s: float) -> tuple[list, list]:
    """Start one process per rank; its result comes back on the (receiving) connection."""
    procs, conns = [], []
    for r in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_spawn_entry, name=f"ainfer-pd-rank{r}",
                        args=(r, world_size, port, fn, tuple(args), send, backend, init, child_env,
                              linger_s),
                        daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    return procs, conns


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 60.0, *,
          backend: str = "gloo", init: bool = True, env: dict[str, str] | None = None,
          return_exceptions: bool = False, fail_grace_s: float = 10.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results
    in rank order.

    ``fn`` must be picklable (a module-level function); it may be ``async``. With ``init``
    each process first calls :func:`init_distributed` (gloo by default) on a free 127.0.0.1
    port. A rank that raises sends its exception back (re-created in the parent with its
    attributes, remote traceback attached as a note); a rank that dies gets a
    :class:`RankFailedError` in its place. When a rank fails the others get ``fail_grace_s``
    more to finish. At the deadline stragglers are killed. Raises :class:`RankFailedError`
    (``.failures``, ``.unfinished``, ``.results``) when a rank did not finish, or when a rank
    failed and ``return_exceptions`` is false.
    """
    import torch.multiprocessing as tmp

    if world_size <= 0:
        raise DistributedError(f"spawn: world_size must be positive, got {world_size}")
    ctx = _process_context(tmp)
    port = find_free_port()
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs, conns = _start_ranks(ctx, fn, world_size, args, port, backend, init, child_env,
                                min(fail_grace_s, timeout_s))

    results: list = [None] * world_size
    failures: dict[int, str] = {}
    pending = set(range(world_size))
    start = time.monotonic()
    try:
        collect_results(procs, conns, results, failures, pending, start + timeout_s, fail_grace_s)
    finally:
        unfinished = sorted(pending)
        for r in unfinished:
            failures[r] = f"did not finish within {time.monotonic() - start:.1f} s (killed)"
            results[r] = RankFailedError(f"rank {r} did not finish in time and was killed")
        # Every result is in (or the deadline passed): nothing a rank still does matters (rank 0
        # may be lingering for a dead peer's "done"); give a short grace to exit, then kill.
        reap_ranks(procs, conns, 0.0 if unfinished else 0.5)

    if unfinished or (failures and not return_exceptions):
        raise spawn_failure(world_size, results, failures, unfinished)
    return results
