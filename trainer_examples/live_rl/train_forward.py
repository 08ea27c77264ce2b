"""Differentiable full-sequence forward of the ainfer-pd MoE policy (training side).

The rollout worker's ``MoETransformer.forward_batch`` writes a paged KV cache and is not meant
for autograd. Training needs the same function of the same parameters over whole padded
sequences, so this module re-states the forward with the model's own pieces (``rms_norm``,
``rope_cos_sin`` / ``apply_rope``, ``route``, ``swiglu_dense``) and:

- plain causal SDPA over a right-padded batch (right padding never changes earlier rows);
- the routed experts as a per-expert loop (``torch._grouped_mm`` has no CPU fp32 backward in
  torch 2.13: "Invalid strides/sizes"), with the router weights kept in the graph.

Shape legend: B = sequences, L = padded length, D = hidden, H/Hk = query/KV heads, hd = head
dim, E = routed experts, k = top-k, V = vocabulary, N = B * L.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from ainfer_pd.engine.attention import apply_rope, rope_cos_sin
from ainfer_pd.engine.model import MoETransformer, rms_norm
from ainfer_pd.engine.moe import route, swiglu_dense


def make_trainable(model: MoETransformer) -> MoETransformer:
    """A trainable copy of the policy (the worker's model keeps requires_grad False)."""
    train = copy.deepcopy(model)
    train.requires_grad_(True)
    return train


def _experts_loop(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Routed SwiGLU experts, differentiable: x [N, D], topk_idx/topk_w [N, k] -> [N, D]."""
    N, D = x.shape
    k = topk_idx.shape[1]
    flat_idx = topk_idx.reshape(-1)                          # [N*k]
    flat_w = topk_w.reshape(-1)                              # [N*k]
    out = x.new_zeros(N, D)
    for e in range(w13.shape[0]):
        rows = (flat_idx == e).nonzero(as_tuple=True)[0]     # (token, slot) rows routed to e
        if rows.numel() == 0:
            continue
        tok = torch.div(rows, k, rounding_mode="floor")
        g, u = (x.index_select(0, tok) @ w13[e]).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ w2[e]                          # [n_e, D]
        out = out.index_add(0, tok, y * flat_w.index_select(0, rows).unsqueeze(-1))
    return out


def forward_logits(model: MoETransformer, tokens: Tensor) -> Tensor:
    """tokens [B, L] int64 (right padded) -> logits [B, L, V] float32; row t predicts token t+1."""
    c = model.cfg
    B, L = tokens.shape
    H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    pos = torch.arange(L, device=tokens.device).repeat(B)                  # [N]
    cos, sin = rope_cos_sin(pos, hd, c.rope_theta, model.embed.dtype)      # [N, hd/2]
    h = F.embedding(tokens.reshape(-1), model.embed)                       # [N, D]
    for lyr in model.layers:
        x = rms_norm(h, lyr.attn_norm, c.rms_eps)
        q, k, v = F.linear(x, lyr.wqkv).split([H * hd, Hk * hd, Hk * hd], dim=-1)
        q = apply_rope(q.view(B * L, H, hd), cos, sin)
        k = apply_rope(k.view(B * L, Hk, hd), cos, sin)
        v = v.view(B * L, Hk, hd)
        q, k, v = (t.view(B, L, -1, hd).transpose(1, 2) for t in (q, k, v))   # [B, h, L, hd]
        if H != Hk:
            k = k.repeat_interleave(H // Hk, dim=1)
            v = v.repeat_interleave(H // Hk, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # [B, H, L, hd]
        h = h + F.linear(o.transpose(1, 2).reshape(B * L, H * hd), lyr.wo)
        xn = rms_norm(h, lyr.ffn_norm, c.rms_eps)
        r = route(xn, lyr.router, c.top_k)
        y = _experts_loop(xn, r.topk_idx, r.topk_weights, lyr.w13, lyr.w2)
        if lyr.shared_w13 is not None:
            y = y + swiglu_dense(xn, lyr.shared_w13, lyr.shared_w2)
        h = h + y
    logits = F.linear(rms_norm(h, model.final_norm, c.rms_eps), model.lm_head).float()
    return logits.view(B, L, -1)


def token_logprobs(model: MoETransformer, tokens: Tensor) -> Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1: [B, L-1] float32 (differentiable)."""
    logits = forward_logits(model, tokens)[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def inference_logits(model: MoETransformer, ids: list[int]) -> Tensor:
    """Reference: the rollout engine's ``forward_batch`` over a fresh paged KV cache, one
    prefill sequence of ``ids`` -> logits [T, V] (used by the test to check ``forward_logits``)."""
    from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
    c = model.cfg
    T = len(ids)
    slots = torch.arange(T)
    fb = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(T), write_slots=slots,
                      prefill=[PrefillSeq(q_start=0, q_len=T, ctx_len=T, key_slots=slots)],
                      logits_rows=torch.arange(T))
    kv = torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim, dtype=model.embed.dtype)
    return model.forward_batch(fb, kv)
