"""Paged attention over the KV cache, behind one backend interface.

``paged_attention`` writes the new tokens' K/V into their cache slots, then hands the prefill
rows (one varlen call for every sequence of the pass) and the decode rows to the backend:
``torch`` (the reference: gather + SDPA, CPU and oracle) or ``triton`` (paged kernels that
read K/V in place through the block tables). ``select_backend`` maps the config's
``device.attention_backend`` to one.
"""
from __future__ import annotations

from torch import Tensor

from ..model.rope import apply_rope, rope_cos_sin
from .backend import AttentionBackend, select_backend
from .batch import DecodeMeta, ForwardBatch, PrefillMeta, PrefillSeq, blocks_of_slots, lead_offsets, slots_of_blocks
from .kv_fp8 import is_fp8, store_kv
from .reference import TorchAttention

__all__ = ["AttentionBackend", "DecodeMeta", "ForwardBatch", "PrefillMeta", "PrefillSeq", "TorchAttention",
           "apply_rope", "attend", "blocks_of_slots", "keeps_own_kv", "lead_offsets", "paged_attention", "rope_cos_sin",
           "select_backend", "slots_of_blocks"]

_REFERENCE = TorchAttention()


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, fb: ForwardBatch,
                    backend: AttentionBackend | None = None, kv_scale: Tensor | None = None) -> Tensor:
    """Write the new K/V into the cache (quantized with ``kv_scale`` [2] into an FP8 pool), then attend.

    q [T, H, hd], k/v [T, Hk, hd], kv [2, S, Hk, hd] -> [T, H, hd]
    """
    store_kv(kv[0], fb.write_slots, k, None if kv_scale is None else kv_scale[0])
    store_kv(kv[1], fb.write_slots, v, None if kv_scale is None else kv_scale[1])
    return attend(q, kv, fb, backend, kv_scale)


def keeps_own_kv(backend, tokens: int, dtype, head_dim: int, kv: Tensor) -> bool:
    """Whether ``backend``'s prefill of ``tokens`` new tokens of ``dtype`` over the pool ``kv`` (its
    format) reads the pass's own roped K/V contiguous (``ForwardBatch.own_kv``: the TMA plan), so the
    QKV prologue keeps them (``keep_k``)."""
    return hasattr(backend, "reads_own_kv") and backend.reads_own_kv(tokens, dtype, head_dim, is_fp8(kv))


def attend(q: Tensor, kv: Tensor, fb: ForwardBatch, backend: AttentionBackend | None = None,
           kv_scale: Tensor | None = None) -> Tensor:
    """Attention of every row of ``fb`` over the cache (the batch's own K/V already written);
    ``kv_scale``: the layer's [2] (K, V) scales of an FP8 pool (:mod:`.kv_fp8`), else None.

    q [T, H, hd], kv [2, S, Hk, hd] -> [T, H, hd]
    """
    be = backend or _REFERENCE
    kc, vc = kv[0], kv[1]
    n_p = fb.num_prefill_tokens
    own_kv, fb.own_kv = fb.own_kv, None      # this layer's (the prologue's): not held past its attention
    if fb.decode is None:
        out = q.new_empty(q.shape)
        if fb.prefill:
            be.prefill(q, kc, vc, fb, out, kv_scale=kv_scale, own_kv=own_kv)
        return out
    od = be.decode(q[n_p:], kc, vc, fb, kv_scale=kv_scale)
    if not fb.prefill:
        return od
    out = q.new_empty(q.shape)
    be.prefill(q, kc, vc, fb, out, kv_scale=kv_scale, own_kv=own_kv)
    out[n_p:] = od
    return out
