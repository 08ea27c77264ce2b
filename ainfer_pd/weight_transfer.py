"""Weight sync without host staging: buckets of tensor handles from the trainer's process.

On a GPU host the trainer shares its (bf16) parameters with the rollout process through CUDA
IPC: :func:`share_bucket` turns a bucket of ``(name, tensor)`` pairs into picklable handles
(``torch.multiprocessing``'s reductions: CUDA IPC for device tensors, shared memory for host
tensors), the handles cross any pipe (Ray, ZeroMQ, a multiprocessing queue), and
:func:`open_buckets` maps them in the rollout process as tensors over the trainer's own memory,
ready for ``await worker.update_weights(open_buckets(buckets))``: the one sync is still checked
all-or-nothing, and the only copy is device-to-device into the parameters.

The sender must keep every shared tensor alive until the receiver's ``update_weights`` returned
(the receiver holds views into its memory until then). CPU tensors take the same path through
shared memory (the CPU stand-in, used by the tests); the host-staged path stays
``update_weights(named_parameters())`` with host tensors.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from .errors import WeightUpdateError

Bucket = list[tuple[str, Any]]


def share_bucket(named: Iterable[tuple[str, Tensor]]) -> Bucket:
    """Trainer side: ``(name, handle)`` for each tensor (no copy; keep the tensors alive)."""
    from torch.multiprocessing.reductions import reduce_tensor
    out: Bucket = []
    for name, t in named:
        if not isinstance(t, Tensor):
            raise WeightUpdateError(f"weight {name!r} is not a tensor ({type(t).__name__})")
        out.append((name, reduce_tensor(t.detach())))
    return out


def open_buckets(buckets: Iterable[Bucket]) -> Iterator[tuple[str, Tensor]]:
    """Rollout side: the tensors of every bucket, mapped over the sender's memory, lazily (a
    generator: ``update_weights`` consumes it in its copy thread, off the event loop)."""
    for bucket in buckets:
        for name, handle in bucket:
            try:
                rebuild, args = handle
                t = rebuild(*args)
            except Exception as exc:                # a stale or foreign handle: typed, nothing written
                raise WeightUpdateError(f"cannot open the shared tensor {name!r}: {exc!r}") from exc
            yield name, t
