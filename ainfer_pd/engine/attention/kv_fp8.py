"""The KV pool's element format: the model dtype (``cache.kv_dtype: auto``), or FP8 e4m3
(``cache.kv_dtype: fp8_e4m3``) with per-layer scales.

FP8 KV: the pool is ``float8_e4m3fn`` (1 byte an element: twice the blocks of a bf16 pool in
the same memory) and each layer has two float32 scales, one for K and one for V, in the model's
``kv_scales [num_layers, 2]`` (a small device tensor: the kernels read it at run time, so a
captured CUDA graph stays valid whatever is written into it). A key or value ``x`` is stored as
``e4m3(clamp(x / scale, +-448))`` (round to nearest even) and read back as ``stored * scale``.

With scale 1.0 (``cache.kv_scales: unit``, vLLM's default without calibration) e4m3 holds
magnitudes 2^-9 .. 448 with 3 mantissa bits (relative error <= 2^-4, normal range 2^-6 .. 448),
which covers post-norm / post-RoPE keys and values of the supported architectures; a value past
448 saturates. Other scales are written into ``kv_scales`` in place: a checkpoint's ``k_scale`` /
``v_scale`` when the pool is made (``cache.kv_scales: auto | checkpoint``, :mod:`ainfer_pd.hf.kv_scales`),
a weight sync carrying them, or a calibration (an amax pass over prompts, ``scale = amax * margin /
448``: :mod:`ainfer_pd.engine.runtime.kv_calibration`, ``RolloutWorker.calibrate_kv_scales``). KV
already stored under other scales would be misread, so the worker drops the cached KV when they
change (a turn in flight during a weight sync reads its earlier KV under the new scales, as it
reads the new weights).

The torch helpers here are the reference path's and the oracle of the Triton kernels, which
quantize in their QKV prologue and dequantize on load (``triton_kernels``). The pool is indexed
through a uint8 view: CPU ``index_copy_`` / ``index_select`` have no float8 kernels, and a byte
copy is what an FP8 store or gather is.
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

KV_FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(KV_FP8).max)          # 448


def kv_torch_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for ``cache.kv_dtype``."""
    return KV_FP8 if kv_dtype == "fp8_e4m3" else model_dtype


def kv_element_bytes(kv_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes of one K or V element in the pool (what the KV sizing counts)."""
    return 1 if kv_dtype == "fp8_e4m3" else torch.finfo(model_dtype).bits // 8


def new_kv_pool(shape: tuple[int, ...], kv_dtype: str, model_dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A zeroed pool of ``shape`` in ``cache.kv_dtype`` (FP8: zero bytes, +0.0 in e4m3, written
    through a uint8 view: no float8 fill kernel is needed). On the CPU the pool is anonymous
    memory, zero until a page is first written: a pool is mostly never touched, and filling it
    (268 MB for the tiny CPU config) cost ~90 ms of every worker start on the 2-core VM."""
    dt = kv_torch_dtype(kv_dtype, model_dtype)
    if torch.device(device).type == "cpu":
        return _zero_pages(math.prod(shape) * dt.itemsize).view(dt).view(shape)
    if dt == KV_FP8:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(KV_FP8)
    return torch.zeros(shape, dtype=dt, device=device)


def _zero_pages(nbytes: int) -> Tensor:
    """``nbytes`` zero bytes of anonymous, page-aligned memory (the tensor holds the mapping)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=nbytes)


def new_kv_scales(num_layers: int, device: torch.device | str) -> Tensor:
    """The per-layer scales of an FP8 pool: ``[num_layers, 2]`` float32 (K, V), all 1.0. Rows are
    16 bytes apart (a view of ``[num_layers, 4]``): every layer's ``[2]`` starts 16-byte aligned, so
    the kernels compile one variant for all layers (Triton specializes pointers on alignment)."""
    return torch.ones(num_layers, 4, dtype=torch.float32, device=device)[:, :2]


def is_fp8(cache: Tensor) -> bool:
    return cache.dtype == KV_FP8


def quantize_kv(x: Tensor, scale: Tensor) -> Tensor:
    """x (any float dtype) -> float8_e4m3fn ``clamp(x / scale, +-448)`` (``scale``: a 0-d float32 tensor)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(KV_FP8)


def dequantize_kv(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """float8 x -> ``x * scale`` in ``dtype`` (one rounding, from float32)."""
    return (x.float() * scale).to(dtype)


def store_kv(cache: Tensor, slots: Tensor, x: Tensor, scale: Tensor | None) -> None:
    """``cache[slots] = x`` (cache ``[S, Hk, hd]``, x ``[T, Hk, hd]``), quantized for an FP8 pool."""
    if not is_fp8(cache):
        cache.index_copy_(0, slots, x)
        return
    if scale is None:
        raise ValueError("an FP8 KV pool needs its layer's scale (model.kv_scales)")
    cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))


def gather_kv(cache: Tensor, slots: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``cache[slots]`` in ``dtype`` (dequantized from an FP8 pool)."""
    if not is_fp8(cache):
        return cache.index_select(0, slots)
    if scale is None:
        raise ValueError("an FP8 KV pool needs its layer's scale (model.kv_scales)")
    return dequantize_kv(cache.view(torch.uint8).index_select(0, slots).view(KV_FP8), scale, dtype)
