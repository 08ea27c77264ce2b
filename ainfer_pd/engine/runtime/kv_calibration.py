"""Calibrated FP8 KV scales: an amax pass over prompts, then ``scale = amax * margin / 448``.

The prompts' prefill runs through the model's own forward (the configured attention, MoE and FP8
kernels) over a *temporary* KV cache in the model dtype, one prompt at a time in chunks of at most
``max_tokens``: no block of the pool is taken, and what each layer stores there is exactly what
an FP8 pool would quantize (post-norm, post-RoPE K, and V). Per layer the largest ``|K|`` and
``|V|`` over every stored element is the amax (:func:`measure_kv_amax`); the scales follow from it
(:func:`scales_from_amax`, a pure function) and are written into ``model.kv_scales`` in place, so
captured CUDA graphs read them from their next replay (:func:`calibrate_kv_scales`).

The caller owns the ordering: nothing else may run the model meanwhile (the worker parks every
stream: :meth:`~ainfer_pd.worker_calibration.KvCalibration.calibrate_kv_scales`), and KV already
in the pool was stored under the old scales (the worker drops the cached KV and refuses while a
turn is in flight). One rank holding the whole model only: the passes use no collective.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention.batch import ForwardBatch, PrefillSeq
from ..attention.kv_fp8 import FP8_MAX
from ...errors import UnsupportedOptionError

MIN_KV_SCALE = 2.0 ** -24
"""The floor of a calibrated scale (a layer whose K or V were all zero on the prompts)."""


def scales_from_amax(amax: Tensor, margin: float) -> Tensor:
    """``[L, 2]`` amax -> float32 scales ``amax * margin / 448``, at least :data:`MIN_KV_SCALE`:
    the largest value seen lands at ``448 / margin`` in e4m3, below saturation for ``margin > 1``."""
    return (amax.float() * (margin / FP8_MAX)).clamp_min(MIN_KV_SCALE)


@torch.no_grad()
def measure_kv_amax(model: nn.Module, prompts: list[list[int]], *, max_tokens: int, block_size: int) -> Tensor:
    """Per layer the largest ``|K|`` and ``|V|`` (post-RoPE K, as stored) over the prompts'
    prefill: ``[L, 2]`` float32 on the model's device. ``model`` holds every expert and every
    attention head (one rank)."""
    c = model.cfg
    dev = model.embed.device
    dt = model.embed.dtype
    L, Hk, hd, bs = c.num_layers, c.num_kv_heads, c.head_dim, block_size
    amax = torch.zeros(L, 2, dtype=torch.float32, device=dev)
    for ids in prompts:
        n = len(ids)
        nb = -(-n // bs)
        cache = torch.zeros(L, 2, nb * bs, Hk, hd, dtype=dt, device=dev)     # [L, 2, S, Hk, hd], model dtype
        blocks = torch.arange(nb, dtype=torch.int64)
        for start in range(0, n, max_tokens):
            m = min(max_tokens, n - start)
            pos = torch.arange(start, start + m, dtype=torch.int64, device=dev)
            fb = ForwardBatch(input_ids=torch.tensor(ids[start:start + m], dtype=torch.int64, device=dev),
                              positions=pos, write_slots=pos,        # slot = position: the cache is this prompt's
                              prefill=[PrefillSeq(0, m, start + m, block_ids=blocks[:-(-(start + m) // bs)])],
                              logits_rows=torch.tensor([m - 1], dtype=torch.int64, device=dev), block_size=bs)
            model.forward_batch(fb, cache)
        amax = torch.maximum(amax, cache[:, :, :n].abs().amax(dim=(2, 3, 4)).float())
        del cache
    return amax


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, prompts: list[list[int]], margin: float, *, max_tokens: int,
                        block_size: int) -> Tensor:
    """Measure the prompts' K / V amax, set ``model.kv_scales`` (in place) to
    :func:`scales_from_amax`, and return them (``[L, 2]`` float32 on the host; an MTP draft
    layer, not run by the passes, takes each column's largest). The routing
    record (``cache.routed_experts``) is off during the passes (their slots are not the pool's)."""
    if model.kv_scales is None:
        raise UnsupportedOptionError("calibrating KV scales needs an FP8 KV pool (cache.kv_dtype: fp8_e4m3): a pool in "
                                     "the model dtype has no scales", key="cache.kv_dtype")
    sink, model.routing_sink = model.routing_sink, None
    try:
        amax = measure_kv_amax(model, prompts, max_tokens=max_tokens, block_size=block_size)
    finally:
        model.routing_sink = sink
    scales = scales_from_amax(amax, margin)
    from ...hf.kv_scales import with_draft_rows
    model.kv_scales.copy_(with_draft_rows(scales.cpu(), None, len(model.layers) - scales.shape[0]))
    return scales.cpu()
