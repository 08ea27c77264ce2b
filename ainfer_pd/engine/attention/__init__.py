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
from .batch import DecodeMeta, ForwardBatch, PrefillMeta, PrefillSeq, blocks_of_slots, slots_of_blocks
from .reference import TorchAttention

__all__ = ["AttentionBackend", "DecodeMeta", "ForwardBatch", "PrefillMeta", "PrefillSeq", "TorchAttention",
           "apply_rope", "attend", "blocks_of_slots", "paged_attention", "rope_cos_sin", "select_backend",
           "slots_of_blocks"]

_REFERENCE = TorchAttention()


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv: Tensor, fb: ForwardBatch,
                    backend: AttentionBackend | None = None) -> Tensor:
    """Write the new K/V into the cache, then attend.

    q [T, H, hd], k/v [T, Hk, hd], kv [2, S, Hk, hd] -> [T, H, hd]
    """
    kv[0].index_copy_(0, fb.write_slots, k)
    kv[1].index_copy_(0, fb.write_slots, v)
    return attend(q, kv, fb, backend)


def attend(q: Tensor, kv: Tensor, fb: ForwardBatch, backend: AttentionBackend | None = None) -> Tensor:
    """Attention of every row of ``fb`` over the cache (the batch's own K/V already written).

    q [T, H, hd], kv [2, S, Hk, hd] -> [T, H, hd]
    """
    be = backend or _REFERENCE
    kc, vc = kv[0], kv[1]
    n_p = fb.num_prefill_tokens
    if fb.decode is None:
        out = q.new_empty(q.shape)
        if fb.prefill:
            be.prefill(q, kc, vc, fb, out)
        return out
    od = be.decode(q[n_p:], kc, vc, fb)
    if not fb.prefill:
        return od
    out = q.new_empty(q.shape)
    be.prefill(q, kc, vc, fb, out)
    out[n_p:] = od
    return out
