"""Helpers for tests that run real ranks (one process each, gloo on 127.0.0.1).

    from tests._dist_util import run_ranks
    results = run_ranks(_my_rank_fn, 4, arg1, timeout_s=60)

``_my_rank_fn(rank, world_size, *args)`` must be a module-level function (it is pickled into
fresh ``spawn`` processes); it may be ``async``. ``torch.distributed`` is initialised before it
runs (``init=False`` to do it yourself). A rank that raises fails the test with its remote
traceback; ``return_exceptions=True`` puts the exception in its place instead. Stragglers
are killed at the deadline and reported by rank: the test fails, CI never hangs.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from ainfer_pd.launch import find_free_port, spawn

__all__ = ["run_ranks", "find_free_port", "shm_entries", "rendezvous_threads"]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 60.0,
              init: bool = True, backend: str = "gloo", return_exceptions: bool = False,
              env: dict[str, str] | None = None, fail_grace_s: float = 10.0) -> list:
    """``ainfer_pd.launch.spawn`` with test-friendly defaults; results in rank order."""
    return spawn(fn, world_size, args, timeout_s, backend=backend, init=init, env=env,
                 return_exceptions=return_exceptions, fail_grace_s=fail_grace_s)


def shm_entries(prefix: str = "ainfer_pd") -> set[str]:
    """Names under /dev/shm starting with ``prefix`` (leak checks)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def rendezvous_threads() -> list[str]:
    """Live threads created by the rendezvous implementations (leak checks)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("ainfer-pd-rdzv")]
