"""Hopper's tensor memory accelerator for the Triton kernels that read through device-side tensor
descriptors (``tl.make_tensor_descriptor``): whether a device has it, and the scratch memory the
descriptors live in. Used by the long prefill passes' attention (:mod:`.attention.triton_prefill_tma`)
and the prefill expert GEMM (:mod:`.fused_moe.kernels_tma`)."""
from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """``device`` is a CUDA device of compute capability 9 or newer (Hopper: TMA and ``wgmma``)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def _scratch(device: torch.device):
    """Triton's scratch allocator for ``device``'s launches (the descriptors' global memory)."""
    def alloc(size: int, alignment: int, stream) -> Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)
    return alloc


def use_tma_scratch(device: torch.device) -> None:
    """Triton's scratch for device-side tensor descriptors, from torch's allocator on ``device``.
    Triton's allocator is a ContextVar: set per thread (and context), so one set at start would not
    reach the stream threads the engine launches from. Call it before every such launch. Inside a
    CUDA graph capture the scratch comes from the graph's pool; each replay rebuilds the descriptors
    there, in stream order."""
    import triton                      # here only: CPU runs ask has_tma without Triton
    triton.set_allocator(_scratch(device))
