"""Differentiable full-sequence forward of the ainfer-pd MoE policy (training side).

The rollout worker's ``MoETransformer.forward_batch`` writes a paged KV cache and is not meant
for autograd. Training needs the same function of the same parameters over whole padded
sequences, so this module re-states the forward with the model's own pieces (``rms_norm``,
``rope_cos_sin`` / ``apply_rope``, ``route``, ``swiglu_dense``) and:

- plain causal SDPA over a right-padded batch (right padding never changes earlier rows);
- the routed experts as a per-expert loop over the expert-sorted rows (``torch._grouped_mm`` has
  no CPU fp32 backward in torch 2.13: "Invalid strides/sizes"; one host sync per layer for the
  per-expert counts), combined as the engine does, with the router weights kept in the graph;
- an optional ``compute_dtype``: float32 master weights cast (differentiably) to e.g. bfloat16,
  so the trainer computes with exactly the weights a bf16 worker holds.

Shape legend: B = sequences, L = padded length, D = hidden, H/Hk = query/KV heads, hd = head
dim, E = routed experts, k = top-k, V = vocabulary, N = B * L.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from ainfer_pd.engine.rope import apply_rope, rope_cos_sin
from ainfer_pd.engine.model import MoETransformer, rms_norm
from ainfer_pd.engine.moe import route, swiglu_dense


def make_trainable(model: MoETransformer, *, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> MoETransformer:
    """A trainable copy of the policy (the worker's model keeps requires_grad False): float32
    master weights by default, on ``device`` (default: the model's)."""
    train = copy.deepcopy(model).to(device=device or model.embed.device, dtype=dtype)
    train.requires_grad_(True)
    return train


def _experts_loop(x: Tensor, topk_idx: Tensor, topk_w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Routed SwiGLU experts, differentiable: x [N, D], topk_idx/topk_w [N, k] -> [N, D].

    Rows (token, slot) are sorted by expert (as ``experts_local`` does), each expert's run goes
    through its own matmuls, and the k slots of a token are summed in a fixed order."""
    N, D = x.shape
    k = topk_idx.shape[1]
    flat_idx = topk_idx.reshape(-1)                                    # [N*k]
    order = torch.sort(flat_idx, stable=True).indices                   # [N*k] rows grouped by expert
    counts = torch.bincount(flat_idx, minlength=w13.shape[0]).tolist()  # the layer's one host sync
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [N*k, D]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            g, u = (xs[start:start + n] @ w13[e]).chunk(2, dim=-1)
            ys.append((F.silu(g) * u) @ w2[e])                         # [n_e, D]
        start += n
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    rows = torch.cat(ys).index_select(0, inv)                           # [N*k, D] in (token, slot) order
    return (rows.view(N, k, D) * topk_w.unsqueeze(-1)).sum(dim=1)


def forward_logits(model: MoETransformer, tokens: Tensor, compute_dtype: torch.dtype | None = None) -> Tensor:
    """tokens [B, L] int64 (right padded) -> logits [B, L, V] float32; row t predicts token t+1.

    ``compute_dtype`` (default: the parameters' dtype) is the dtype the weights are cast to and
    the activations run in; gradients flow back to the parameters through the cast."""
    c = model.cfg
    dt = compute_dtype or model.embed.dtype
    W = (lambda p: p) if dt == model.embed.dtype else (lambda p: p.to(dt))
    B, L = tokens.shape
    H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    pos = torch.arange(L, device=tokens.device).repeat(B)                  # [N]
    cos, sin = rope_cos_sin(pos, hd, c.rope_theta, dt)                     # [N, hd/2]
    h = F.embedding(tokens.reshape(-1), W(model.embed))                    # [N, D]
    for lyr in model.layers:
        x = rms_norm(h, W(lyr.attn_norm), c.rms_eps)
        q, k, v = F.linear(x, W(lyr.wqkv)).split([H * hd, Hk * hd, Hk * hd], dim=-1)
        q = apply_rope(q.view(B * L, H, hd), cos, sin)
        k = apply_rope(k.view(B * L, Hk, hd), cos, sin)
        v = v.view(B * L, Hk, hd)
        q, k, v = (t.view(B, L, -1, hd).transpose(1, 2) for t in (q, k, v))   # [B, h, L, hd]
        if H != Hk:
            k = k.repeat_interleave(H // Hk, dim=1)
            v = v.repeat_interleave(H // Hk, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # [B, H, L, hd]
        h = h + F.linear(o.transpose(1, 2).reshape(B * L, H * hd), W(lyr.wo))
        xn = rms_norm(h, W(lyr.ffn_norm), c.rms_eps)
        r = route(xn, W(lyr.router), c.top_k)
        y = _experts_loop(xn, r.topk_idx, r.topk_weights, W(lyr.w13), W(lyr.w2))
        if lyr.shared_w13 is not None:
            y = y + swiglu_dense(xn, W(lyr.shared_w13), W(lyr.shared_w2))
        h = h + y
    logits = F.linear(rms_norm(h, W(model.final_norm), c.rms_eps), W(model.lm_head)).float()
    return logits.view(B, L, -1)


def token_logprobs(model: MoETransformer, tokens: Tensor, compute_dtype: torch.dtype | None = None) -> Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1: [B, L-1] float32 (differentiable)."""
    logits = forward_logits(model, tokens, compute_dtype)[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def inference_logits(model: MoETransformer, ids: list[int]) -> Tensor:
    """Reference: the rollout engine's ``forward_batch`` over a fresh paged KV cache, one
    prefill sequence of ``ids`` -> logits [T, V] (used by the test to check ``forward_logits``)."""
    from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
    c, d = model.cfg, model.embed.device
    T = len(ids)
    slots = torch.arange(T, device=d)
    fb = ForwardBatch(input_ids=torch.tensor(ids, device=d), positions=slots, write_slots=slots,
                      prefill=[PrefillSeq(q_start=0, q_len=T, ctx_len=T, key_slots=slots)],
                      logits_rows=slots)
    kv = torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim, dtype=model.embed.dtype, device=d)
    return model.forward_batch(fb, kv)
