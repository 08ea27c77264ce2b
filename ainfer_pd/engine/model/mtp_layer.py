"""The multi-token-prediction (MTP) layer: the draft head of ``spec.method: mtp`` (glm4_moe's
``num_nextn_predict_layers``, DeepSeek-V3's MTP module; only the first is used).

The layer is one more decoder layer, ``model.layers[L]`` (L = ``num_layers``: the checkpoint's
``model.layers.L.*`` attention, norms and MoE, built by :class:`~.model.DecoderLayer`, so its
formats, FP8 projections and weight names are the main layers'), which the forward pass never
walks, plus :class:`~.mtp_head.MtpHead` (``model.mtp``): ``enorm`` / ``hnorm`` [D] (RMSNorm weights),
``eh_proj`` [D, 2D] (Linear 2D -> D, no bias, (out, in)), ``head_norm`` [D] (``shared_head.norm``)
and, when the checkpoint holds them, its own ``head`` [V, D] (``shared_head.head``) and ``embed``
[V, D] (``embed_tokens``); without them the main model's ``lm_head`` and embedding serve.

Its forward (:func:`mtp_forward`) at position i, for the target's last-layer output h_i (before the
final norm) and the token t_{i+1} after position i (as vLLM's ``glm4_moe_mtp`` / SGLang's
``glm4_moe_nextn`` order the concat)::

    x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])          # [T, 2D] -> [T, D]
    y = decoder layer L at position i (RoPE i, its KV written at position i's slot)
    logits = head(head_norm(y))                                 # predicts t_{i+2}

Its KV is layer L of the paged pool (the runner sizes the pool by ``len(model.layers)``): the same
blocks and slots as the target's, so a turn's reservation, rollback and release cover it.
Shape legend: T = rows, D = hidden, V = vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import ForwardBatch
from .model import SegmentState


def mtp_forward(model: nn.Module, fb: ForwardBatch, hidden: Tensor, kv: Tensor, hooks=None) -> Tensor:
    """The MTP layer over the rows of ``fb`` (``input_ids``: t_{i+1}; ``positions``: i; its KV
    written at ``write_slots`` of ``kv`` = layer L's cache [2, S, Hk, hd]) with the hidden states
    ``hidden`` [T, D] (h_i, or the MTP layer's own output when chaining) -> its output [T, D]
    (before ``head_norm``: the hidden state the next chained step takes). ``hooks``: the phase's
    :class:`~ainfer_pd.engine.runtime.tensor_parallel.PhaseHooks` on several ranks (its experts
    through the phase's dispatcher, D's DP-attention gather around them), None on one rank."""
    pre, o = mtp_attention(model, fb, hidden, kv)
    reduce = hooks.attn_reduce if hooks is not None else None
    return mtp_rest(model, fb, pre, o if reduce is None else reduce(o), hooks)


def mtp_attention(model: nn.Module, fb: ForwardBatch, hidden: Tensor, kv: Tensor) -> tuple[SegmentState, Tensor]:
    """:func:`mtp_forward` up to its attention: the layer's input (``eh_proj`` of the two normed
    halves) and the attention output over this rank's heads [T, D] (a partial sum under attention
    TP, to be reduced before :func:`mtp_rest`; a P walk routes that reduce by the ordering)."""
    c, m, kn = model.cfg, model.mtp, model.kernels
    e = F.embedding(fb.input_ids, m.embed if m.embed is not None else model.embed)        # [T, D]
    x = torch.cat([kn.rms_norm(e, m.enorm, c.rms_eps), kn.rms_norm(hidden, m.hnorm, c.rms_eps)], dim=-1)
    pre = SegmentState(h=F.linear(x, m.eh_proj))
    return pre, model.attention(c.num_layers, pre, fb, kv)


def mtp_rest(model: nn.Module, fb: ForwardBatch, pre: SegmentState, o: Tensor, hooks=None) -> Tensor:
    """:func:`mtp_forward` after its attention ``o`` (reduced): the residual, the router and the
    MoE (through the phase's dispatcher, D's DP-attention gather around it) -> the output [T, D]."""
    L = model.cfg.num_layers
    experts, gather = (hooks.experts, hooks.gather) if hooks is not None else (None, None)
    st = model.experts(L, model.after_attention(L, pre, o, fb), experts)
    return st.h if gather is None else gather(st.h)


def mtp_logits(model: nn.Module, h: Tensor) -> Tensor:
    """Logits [T, V] (float32) of the MTP layer's outputs ``h`` [T, D]."""
    m = model.mtp
    head = m.head if m.head is not None else model.lm_head
    return F.linear(model.kernels.rms_norm(h, m.head_norm, model.cfg.rms_eps), head).float()


def mtp_weight_bytes(mc, expert_parallel: int) -> int:
    """Bytes of the MTP layer on one rank (KV pool sizing): one more MoE layer in the model's
    formats, ``eh_proj`` and the norms, and (an upper bound) its own head and embedding."""
    from dataclasses import replace
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[mc.dtype]
    layer = replace(mc, num_layers=mc.num_layers + 1).rank_weight_bytes(expert_parallel) \
        - mc.rank_weight_bytes(expert_parallel)
    D = mc.hidden_size
    return layer + (2 * D * D + 3 * D + 2 * mc.vocab_size * D) * nbytes
