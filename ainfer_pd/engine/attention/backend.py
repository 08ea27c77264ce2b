"""The attention backend interface and its selection from config (policy apart from kernels)."""
from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import Tensor

from ...errors import BackendUnavailableError, ConfigError
from .batch import ForwardBatch

log = logging.getLogger("ainfer_pd.attention")

ATTENTION_BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    """Attends the rows of a flat batch over the paged KV cache (K/V of the batch already written).

    kc / vc: one layer's cache ``[S, Hk, hd]``; q ``[T, H, hd]``.
    """

    name: str

    def prefill(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, out: Tensor) -> None:
        """Every prefill sequence of ``fb`` (causal, lower-right aligned): rows into ``out``."""

    def decode(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch) -> Tensor:
        """The decode rows ``q [B, H, hd]`` -> ``[B, H, hd]``; fixed shapes (graph-capturable)."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: the Triton paged kernels on CUDA when Triton imports, else the torch reference."""
    from .reference import TorchAttention
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"device.attention_backend={name!r}: expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchAttention()
    if not triton_available():
        raise BackendUnavailableError("device.attention_backend='triton' needs the triton package (pip install triton)")
    from .triton_backend import TritonAttention
    return TritonAttention(device)
