"""The torch reference attention backend: gathers the paged KV into dense copies and calls SDPA.

It runs everywhere (the CPU path of CI) and is the oracle the paged kernels are checked
against. Shape legend: T = new tokens, H = query heads, Hk = KV heads, hd = head dim,
B = decode rows, L = padded key length, S = cache slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from ..model.norm import rms_norm
from ..model.rope import apply_rope
from .batch import ForwardBatch, slots_of_blocks
from .kv_fp8 import gather_kv, store_kv


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    """[.., Hk, L, hd] -> [.., H, L, hd] (explicit GQA expansion keeps SDPA on its fused kernels)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def _flash_ok(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0


def _causal_prefill(q: Tensor, k: Tensor, v: Tensor, cached: int) -> Tensor:
    """[1, H, q, hd] queries at positions cached..cached+q over [1, H, cached+q, hd] keys,
    causal aligned to the end of the keys (lower right).

    On CUDA (bf16/fp16) this calls the flash kernel directly: the SDPA dispatcher may pick the
    cuDNN backend, which builds an execution plan for every new (q, k) length (0.5-1 s stalls
    inside P epochs, measured on the H200), and prefill lengths change every epoch. Flash's
    ``is_causal`` is lower-right aligned. Decode keeps the dispatcher: its graph shapes are fixed.
    """
    if _flash_ok(q):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True,
                                                                  return_debug_mask=False)[0]
    if cached == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))


def _decode_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, groups: int) -> Tensor:
    """q [B, H, 1, hd] over k/v [B, Hk, L, hd] with keys ``mask`` [B, L] -> [B, H, 1, hd].

    On CUDA (bf16/fp16) this always calls the memory-efficient kernel with an additive bias,
    eagerly and inside graph capture alike: the SDPA dispatcher would pick cuDNN, whose
    per-shape plans stall eager steps and whose first use inside a capture invalidates it
    (CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED, SPEC section 9).
    """
    if _flash_ok(q):
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = bias[:, None, None, :].expand(-1, q.shape[1], 1, -1).contiguous()     # [B, H, 1, L]
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), bias, False)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)


class TorchAttention:
    """Reference backend: per-sequence gather + SDPA for prefill, gather + masked SDPA for decode."""

    name = "torch"

    # ---------------------------------------------------------------- layer prologue / norms
    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """``h = residual + x`` and ``rms_norm(h)``."""
        h = residual + x
        return h, rms_norm(h, w, eps)

    def prologue(self, q: Tensor, k: Tensor, v: Tensor, q_w: Tensor | None, k_w: Tensor | None, eps: float,
                 rope: tuple[Tensor, Tensor], kv: Tensor, slots: Tensor, kv_scale: Tensor | None = None,
                 keep_k: bool = False) -> Tensor:
        """Optional QK-norm, RoPE of q and k, K/V written into the cache at ``slots`` (quantized
        with ``kv_scale`` [2] into an FP8 pool); returns q. ``keep_k``: the roped keys into ``k`` too."""
        k_in = k
        if q_w is not None:
            q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if keep_k:
            k_in.copy_(k)
        store_kv(kv[0], slots, k, None if kv_scale is None else kv_scale[0])
        store_kv(kv[1], slots, v, None if kv_scale is None else kv_scale[1])
        return q

    # ---------------------------------------------------------------- attention

    def prefill(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, out: Tensor,
                kv_scale: Tensor | None = None, own_kv: tuple[Tensor, Tensor] | None = None) -> None:
        """Rows of every prefill sequence of ``fb``: q [T, H, hd] -> out [T, H, hd] (in place).
        An FP8 pool is dequantized with ``kv_scale`` [2] (K, V) as it is gathered. ``own_kv`` is
        ignored: every key is gathered from the pool."""
        groups = q.shape[1] // kc.shape[1]
        k_s, v_s = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        for s in fb.prefill:
            slots = s.key_slots
            if slots is None:
                slots = slots_of_blocks(s.block_ids, fb.block_size, s.ctx_len).to(q.device)
            qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)        # [1, H, q, hd]
            kd = _expand_kv(gather_kv(kc, slots, k_s, q.dtype).transpose(0, 1), groups).unsqueeze(0)  # [1, H, ctx, hd]
            vd = _expand_kv(gather_kv(vc, slots, v_s, q.dtype).transpose(0, 1), groups).unsqueeze(0)
            out[s.q_start:s.q_start + s.q_len] = _causal_prefill(qs, kd, vd, s.ctx_len - s.q_len)[0].transpose(0, 1)

    def decode(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, kv_scale: Tensor | None = None) -> Tensor:
        """Decode rows: q [B, H, hd] -> [B, H, hd] (an FP8 pool dequantized with ``kv_scale`` [2])."""
        d = fb.decode
        d.resolve()
        groups = q.shape[1] // kc.shape[1]
        B, L = d.key_slots.shape
        flat = d.key_slots.reshape(-1)
        k_s, v_s = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        kd = gather_kv(kc, flat, k_s, q.dtype).view(B, L, *kc.shape[1:]).transpose(1, 2)   # [B, Hk, L, hd]
        vd = gather_kv(vc, flat, v_s, q.dtype).view(B, L, *vc.shape[1:]).transpose(1, 2)
        mask = (torch.arange(L, device=q.device).unsqueeze(0) < d.ctx_lens.unsqueeze(1))  # [B, L]
        return _decode_sdpa(q.unsqueeze(2), kd, vd, mask, groups).squeeze(2)
