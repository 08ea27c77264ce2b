"""CUDA streams as process resources: a device or runner leases its streams here and gives them
back when it closes, so the process's next one runs on the same streams.

Why: torch keeps one cuBLAS workspace (32 MiB on sm_90) for each (thread's cuBLAS handle, stream)
a GEMM has run on, for the life of the process. Only ``torch._C._cuda_clearCublasWorkspaces``
frees them, and it frees every owner's, including workspaces that another owner's CUDA graphs
were captured with, so the library never calls it. ``torch.cuda.Stream()`` hands out its pool's
streams round robin (32 a priority), so every new worker's streams were new keys: each closed
worker left 32 MiB a stream allocated (``benchmarks/memory_residual.py`` on the H100: 2 streams,
64 MiB a worker), up to ~1 GiB, and the next worker's KV pool was sized on that much less memory
(gate at b6cf56b: 7,874 / 7,476 / 7,429 blocks for three policies in turn). On leased streams a
later worker's GEMMs find the workspaces the earlier one left and reuse them.

Workers alive at once never share a stream: a lease is exclusive until it is given back.
Mechanism only; :func:`take` makes a stream with the caller's factory when none is free.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

_lock = threading.Lock()
_free: dict[Hashable, list[Any]] = {}


def take(key: Hashable, make: Callable[[], Any]) -> Any:
    """A stream of kind ``key`` (e.g. ``("cuda", device index, priority)``) no live owner holds:
    the one given back last, else ``make()`` (called outside the lock)."""
    with _lock:
        free = _free.get(key)
        if free:
            return free.pop()
    return make()


def give_back(key: Hashable, stream: Any) -> None:
    """``stream`` (leased as ``key``) is free for the process's next owner. Its owner has stopped
    launching on it; work still queued on it runs before anything the next owner enqueues."""
    with _lock:
        free = _free.setdefault(key, [])
        if not any(s is stream for s in free):
            free.append(stream)


def num_free(key: Hashable) -> int:
    with _lock:
        return len(_free.get(key, ()))


def cuda_stream_key(index: int, priority: int) -> tuple:
    """The lease key of a plain CUDA stream of device ``index`` at ``priority``."""
    return ("cuda", index, priority)


def green_stream_key(index: int, sms: int) -> tuple:
    """The lease key of a green-context stream of ``sms`` SMs on device ``index`` (its context is
    leased with it: (context, stream))."""
    return ("green", index, sms)
