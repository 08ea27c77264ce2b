"""Paged attention over the KV cache, for prefill sequences and decode rows.

Shape legend: T = new tokens in the batch, H = query heads, Hk = KV heads,
hd = head dim, B = decode rows, L = padded key length, S = cache slots.

The KV cache of one layer is ``[2, S, Hk, hd]`` with S = num_blocks * block_size;
a token's KV lives in slot ``block * block_size + offset``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch import Tensor


@dataclass(slots=True)
class PrefillSeq:
    """One sequence's new tokens inside a flat batch."""

    q_start: int          # first row of this sequence in the flat batch
    q_len: int            # new tokens
    ctx_len: int          # keys after this step (cached + new)
    key_slots: Tensor     # [ctx_len] cache slot of every key, in position order


@dataclass(slots=True)
class DecodeMeta:
    """Decode rows (one new token each) at the end of the flat batch.

    Either ``key_slots`` is given, or ``block_table`` (``[B, NB]`` block ids, padded with any
    valid block) from which :meth:`resolve` derives ``key_slots`` on the device, inside a
    captured graph too: the host then ships NB ids per row instead of L slots.
    """

    key_slots: Tensor | None  # [B, L] cache slot of every key (padded)
    ctx_lens: Tensor          # [B] keys per row (including the new token)
    block_table: Tensor | None = None   # [B, NB] int64
    block_size: int = 0

    def resolve(self) -> None:
        """key_slots[b, j] = block_table[b, j // bs] * bs + j % bs (L = NB * bs); no host sync."""
        if self.block_table is None:
            return
        bs = self.block_size
        offs = torch.arange(bs, dtype=self.block_table.dtype, device=self.block_table.device)
        B, nb = self.block_table.shape
        self.key_slots = (self.block_table.unsqueeze(-1) * bs + offs).reshape(B, nb * bs)


@dataclass(slots=True)
class ForwardBatch:
    """A flat batch: prefill sequences first, then decode rows."""

    input_ids: Tensor                 # [T]
    positions: Tensor                 # [T]
    write_slots: Tensor               # [T] where each new token's KV is written
    prefill: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeMeta | None = None
    logits_rows: Tensor | None = None  # [R] rows whose logits are needed
    rope: tuple[Tensor, Tensor] | None = None   # cos/sin of ``positions`` (computed once per pass)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.q_len for s in self.prefill)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv          # [T, hd/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, h, hd] rotated by the (half-split) rotary embedding."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)                      # [T, 1, hd/2]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


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


_EAGER_DECODE_KERNEL = {"efficient": True}


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, groups: int) -> Tensor:
    """q [B, H, 1, hd] over k/v [B, Hk, L, hd] with keys ``mask`` [B, L] -> [B, H, 1, hd].

    Inside a CUDA-graph capture the SDPA dispatcher chooses (the graph fixes the shapes, so a
    cuDNN plan is built once, at capture). Eager decode on CUDA (mixed batches, rows longer
    than the graphs) has a new (B, L) almost every step: it calls the memory-efficient kernel
    directly with an additive bias, so no per-shape cuDNN plan is built inside the step. If
    that kernel refuses the inputs, the dispatcher is used from then on (logged once).
    """
    if (_flash_ok(q) and _EAGER_DECODE_KERNEL["efficient"] and not torch.cuda.is_current_stream_capturing()):
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        bias = bias[:, None, None, :].expand(-1, q.shape[1], 1, -1).contiguous()     # [B, H, 1, L]
        try:
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, _expand_kv(k, groups), _expand_kv(v, groups), bias, False)[0]
        except RuntimeError as exc:  # pragma: no cover - GPU host only
            _EAGER_DECODE_KERNEL["efficient"] = False
            logging.getLogger("ainfer_pd.attention").warning(
                "memory-efficient decode kernel refused (%s); eager decode uses the SDPA dispatcher", exc)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, fb: ForwardBatch) -> Tensor:
    """Write the new K/V into the cache, then attend.

    q [T, H, hd], k/v [T, Hk, hd], kv [2, S, Hk, hd] -> [T, H, hd]
    """
    kc, vc = kv[0], kv[1]
    kc.index_copy_(0, fb.write_slots, k)
    vc.index_copy_(0, fb.write_slots, v)
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for s in fb.prefill:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)        # [1, H, q, hd]
        ks = _expand_kv(kc.index_select(0, s.key_slots).transpose(0, 1), groups).unsqueeze(0)  # [1, H, ctx, hd]
        vs = _expand_kv(vc.index_select(0, s.key_slots).transpose(0, 1), groups).unsqueeze(0)
        out[s.q_start:s.q_start + s.q_len] = _causal_prefill(qs, ks, vs, s.ctx_len - s.q_len)[0].transpose(0, 1)
    if fb.decode is not None:
        n_p = fb.num_prefill_tokens
        d = fb.decode
        B, L = d.key_slots.shape
        qd = q[n_p:].unsqueeze(2)                                    # [B, H, 1, hd]
        flat = d.key_slots.reshape(-1)
        kd = kc.index_select(0, flat).view(B, L, *kc.shape[1:]).transpose(1, 2)   # [B, Hk, L, hd]
        vd = vc.index_select(0, flat).view(B, L, *vc.shape[1:]).transpose(1, 2)
        mask = (torch.arange(L, device=q.device).unsqueeze(0) < d.ctx_lens.unsqueeze(1))  # [B, L]
        out[n_p:] = _decode_attention(qd, kd, vd, mask, groups).squeeze(2)
    return out
