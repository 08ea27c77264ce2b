"""The attention backend interface and its selection from config (policy apart from kernels)."""
from __future__ import annotations

import logging
import os
from typing import Protocol

import torch
from torch import Tensor

from ...errors import BackendUnavailableError, ConfigError
from .batch import ForwardBatch

log = logging.getLogger("ainfer_pd.attention")

from ...config import KERNEL_BACKENDS as ATTENTION_BACKENDS


class AttentionBackend(Protocol):
    """Attends the rows of a flat batch over the paged KV cache (K/V of the batch already written).

    kc / vc: one layer's cache ``[S, Hk, hd]``; q ``[T, H, hd]``. ``kv_scale``: the layer's
    ``[2]`` float32 (K, V) scales when the pool is FP8 (``cache.kv_dtype: fp8_e4m3``, :mod:`.kv_fp8`):
    stores quantize with them, reads dequantize; None for a pool in the model dtype.
    """

    name: str

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """x [T, D] -> rms_norm(x) * w."""

    def add_rms_norm(self, x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``h = residual + x`` and ``rms_norm(h) * w`` (the residual add fused into the norm)."""

    def prologue(self, q: Tensor, k: Tensor, v: Tensor, q_w: Tensor | None, k_w: Tensor | None, eps: float,
                 rope: tuple[Tensor, Tensor], kv: Tensor, slots: Tensor, kv_scale: Tensor | None = None,
                 keep_k: bool = False) -> Tensor:
        """Optional QK-norm (weights ``q_w`` / ``k_w`` [hd]), RoPE of q and k (half-split over the
        first ``2 * cos.shape[-1]`` dims), K/V written into ``kv`` [2, S, Hk, hd] at ``slots``; returns q.
        ``keep_k``: the roped keys are also stored back into ``k`` in place (unquantized)."""

    def prefill(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, out: Tensor,
                kv_scale: Tensor | None = None, own_kv: tuple[Tensor, Tensor] | None = None) -> None:
        """Every prefill sequence of ``fb`` (causal, lower-right aligned): rows into ``out``. ``own_kv``:
        the pass's roped K and V [T, Hk, hd] (``ForwardBatch.own_kv``), which a backend may read in
        place of the pool's copy of them (the triton one's long passes, through TMA), or ignore."""

    def decode(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, kv_scale: Tensor | None = None) -> Tensor:
        """The decode rows ``q [B, H, hd]`` -> ``[B, H, hd]``; fixed shapes (graph-capturable)."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_kernel_backend(key: str, name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA when Triton imports, else ``torch``; ``triton`` is refused
    where it cannot run (no package; CPU tensors outside the interpreter)."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"device.{key}={name!r}: expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise BackendUnavailableError(f"device.{key}='triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            raise ConfigError(f"device.{key}='triton' on {device.type} runs only under TRITON_INTERPRET=1 "
                              "(the Triton interpreter: for checking kernels, not for speed)")
    return name


def select_backend(name: str, device: torch.device, head_dim: int | None = None) -> AttentionBackend:
    """The attention backend named by ``device.attention_backend`` (see :func:`resolve_kernel_backend`).
    ``auto`` keeps the reference path for head dims the paged kernels do not take."""
    from .reference import TorchAttention
    chosen = resolve_kernel_backend("attention_backend", name, device)
    if chosen == "triton" and head_dim is not None:
        from .triton_backend import TritonAttention
        try:
            TritonAttention.check_head_dim(head_dim)
        except ConfigError:
            if name != "auto":
                raise
            log.warning("head_dim %d: the paged kernels need a power of two >= 16; using the torch path", head_dim)
            chosen = "torch"
    if chosen == "torch":
        return TorchAttention()
    from .triton_backend import TritonAttention
    return TritonAttention(device)
