"""Data backend of the phase collectives, chosen from the device.

One rule for the lockstep engine: CUDA ranks use **NCCL** for their data
collectives (attention all-reduce / all-gather / reduce-scatter, expert all-to-all), CPU ranks
use **gloo**; the control group (rendezvous, store side channel) is always gloo
(``comm.topology.build_process_groups``). Importable without CUDA: nothing here touches the
GPU until :func:`require_cuda` is called.
"""
from __future__ import annotations

import os

from ..errors import BackendUnavailableError, ConfigError

__all__ = [
    "abort_nccl",
    "warm_up_nccl",
    "BACKENDS",
    "DEVICES",
    "check_backend",
    "data_backend_for",
    "device_for_backend",
    "group_backend",
    "local_cuda_index",
    "require_cuda",
]

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda", "auto")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def data_backend_for(device: str) -> str:
    """``cuda`` -> ``nccl``, ``cpu`` -> ``gloo``; ``auto`` -> cuda when available."""
    if device not in DEVICES:
        raise ConfigError(f"device={device!r}: expected one of {DEVICES}")
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    return "nccl" if device == "cuda" else "gloo"


def device_for_backend(backend: str) -> str:
    """The device a data backend runs on: nccl -> cuda, gloo -> cpu."""
    check_backend(backend, need_runtime=False)
    return "cuda" if backend == "nccl" else "cpu"


def check_backend(backend: str, *, need_runtime: bool = True) -> str:
    """Validate a data backend name (:class:`ConfigError`); with ``need_runtime`` also that this
    host can run it (:class:`BackendUnavailableError` for nccl without CUDA / NCCL)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: expected one of {BACKENDS} (gloo on CPU, nccl on CUDA)")
    if backend == "nccl" and need_runtime:
        require_cuda("the nccl backend")
    return backend


def require_cuda(what: str = "this code path") -> None:
    """Raise :class:`BackendUnavailableError` unless CUDA and NCCL are usable here."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"{what} needs CUDA, but torch {torch.__version__} sees no CUDA device "
                                      f"on this host (use backend gloo / device cpu)")
    if not dist.is_nccl_available():
        raise BackendUnavailableError(f"{what} needs NCCL, but this torch build ({torch.__version__}) has no NCCL")


def local_cuda_index() -> int:
    """This rank's GPU: ``LOCAL_RANK`` (torchrun and ``ainfer_pd.launch.spawn`` set it), checked
    against the visible devices."""
    import torch

    require_cuda("a CUDA rank")
    raw = os.environ.get("LOCAL_RANK", "0") or "0"
    try:
        idx = int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_RANK={raw!r} is not an integer") from None
    n = torch.cuda.device_count()
    if not 0 <= idx < n:
        raise BackendUnavailableError(f"local rank {idx} needs cuda:{idx} but only {n} CUDA device(s) are visible "
                                      f"(one process per GPU: torchrun --nproc-per-node <= {n})")
    return idx


def group_backend(group) -> str:
    """Backend name of a ``torch.distributed`` group ("gloo", "nccl", ...)."""
    import torch.distributed as dist
    return str(dist.get_backend(group))


def warm_up_nccl(groups: dict, index: int) -> list[str]:
    """One tiny all-reduce on every NCCL group (sorted by name: the same order on every rank),
    then synchronize: every communicator exists before out-of-phase traffic starts (lazy creation
    inside racing stream threads could itself deadlock). Returns the names warmed up."""
    import torch
    import torch.distributed as dist

    todo = sorted(n for n, pg in groups.items() if n != "world" and group_backend(pg) == "nccl")
    if not todo:
        return []
    torch.cuda.set_device(index)
    t = torch.zeros(1, device=torch.device("cuda", index))
    for name in todo:
        dist.all_reduce(t, group=groups[name])
    torch.cuda.synchronize(index)
    return todo


def abort_nccl(groups: dict, timeout_s: float = 10.0) -> bool:
    """Abort the NCCL communicators among ``groups`` (``ProcessGroup.abort``: ncclCommAbort, kernels
    spinning on a dead or stalled peer exit) on a daemon thread; True if that finished within
    ``timeout_s``. Best effort: after a stall the process exits either way."""
    import threading
    pgs: list = []
    for pg in groups.values():
        try:
            nccl = group_backend(pg) == "nccl"
        except (RuntimeError, ValueError):        # destroyed already: nothing to abort
            continue
        if nccl and all(pg is not q for q in pgs):
            pgs.append(pg)
    if not pgs:
        return True

    def work() -> None:
        for pg in pgs:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort
                pass

    th = threading.Thread(target=work, name="ainfer-pd-nccl-abort", daemon=True)
    th.start()
    th.join(timeout_s)
    return not th.is_alive()
