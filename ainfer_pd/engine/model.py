"""Decoder-only MoE transformer written as a sequence of layer segments.

A forward pass is ``embed`` -> for every layer ``attn_route`` (attention, then the
router: the *notification* point of the expert exchange) and ``experts`` (routed +
shared experts) -> ``head``. Prefill runs the segments one at a time so it can stop
at any safe boundary and resume; decode runs them back to back (or as one CUDA graph).

Shape legend: T = tokens, D = hidden, H/Hk = query/KV heads, hd = head dim,
E = routed experts, k = top-k, V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .attention import AttentionBackend, ForwardBatch, paged_attention
from .rope import apply_rope, rope_cos_sin
from .moe import Routing, experts_local, route, swiglu_dense

# An expert backend maps (x [T, D], routing, layer index) -> routed expert output [T, D].
ExpertFn = Callable[[Tensor, Routing, int], Tensor]


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class MoELayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        D, hd = c.hidden_size, c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.wqkv = nn.Parameter(torch.empty((c.num_heads + 2 * c.num_kv_heads) * hd, D))
        self.wo = nn.Parameter(torch.empty(D, c.num_heads * hd))
        self.ffn_norm = nn.Parameter(torch.ones(D))
        self.router = nn.Parameter(torch.empty(c.num_experts, D))
        self.w13 = nn.Parameter(torch.empty(c.num_experts, D, 2 * c.expert_intermediate))
        self.w2 = nn.Parameter(torch.empty(c.num_experts, c.expert_intermediate, D))
        if c.shared_expert_intermediate:
            self.shared_w13 = nn.Parameter(torch.empty(D, 2 * c.shared_expert_intermediate))
            self.shared_w2 = nn.Parameter(torch.empty(c.shared_expert_intermediate, D))
        else:
            self.shared_w13 = self.shared_w2 = None


@dataclass(slots=True)
class SegmentState:
    """What flows between segments of one forward pass."""

    h: Tensor                 # [T, D] residual stream
    xn: Tensor | None = None  # [T, D] normalised FFN input of the current layer
    routing: Routing | None = None


class MoETransformer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.cfg = c
        self.embed = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(MoELayer(c) for _ in range(c.num_layers))
        self.final_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.attn_backend: AttentionBackend | None = None   # None: the torch reference path
        self.expert_kernel: Callable[[Tensor, Routing, Tensor, Tensor], Tensor] = experts_local

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random init: same seed and device type -> same weights
        (one generator per parameter, on the parameter's device)."""
        for idx, (name, p) in enumerate(self.named_parameters()):
            g = torch.Generator(device=p.device).manual_seed(seed * 100003 + idx)
            if name.endswith("norm"):
                p.fill_(1.0)
                continue
            fan_in = p.shape[-2] if p.dim() == 3 else p.shape[-1]
            if name.endswith(("w13", "w2")) and p.dim() == 2:      # shared expert [in, out]
                fan_in = p.shape[0]
            std = fan_in ** -0.5
            if name == "embed":
                std = 1.0
            t = torch.randn(p.shape, generator=g, dtype=torch.float32, device=p.device)
            p.copy_(t.mul_(std))
            del t

    # ------------------------------------------------------------------ segments
    def embed_tokens(self, fb: ForwardBatch) -> SegmentState:
        c = self.cfg
        # NOTE: recomputed every pass (inside a captured graph too): static graph inputs change per replay
        fb.rope = rope_cos_sin(fb.positions, c.head_dim, c.rope_theta, self.embed.dtype)
        return SegmentState(h=F.embedding(fb.input_ids, self.embed))

    def attn_route(self, i: int, st: SegmentState, fb: ForwardBatch, kv: Tensor,
                   attn_reduce: Callable[[Tensor], Tensor] | None = None) -> SegmentState:
        """Attention of layer i (writes this layer's KV), then the router of its MoE.

        kv [2, S, Hk, hd] is layer i's cache. Returns the state with ``routing`` set:
        its ``counts`` are what an expert exchange notifies to peers.
        """
        c, lyr = self.cfg, self.layers[i]
        T = st.h.shape[0]
        x = rms_norm(st.h, lyr.attn_norm, c.rms_eps)
        qkv = F.linear(x, lyr.wqkv)                                        # [T, (H+2Hk)*hd]
        H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1)
        q, k, v = q.view(T, H, hd), k.view(T, Hk, hd), v.view(T, Hk, hd)
        if fb.rope is None:
            fb.rope = rope_cos_sin(fb.positions, hd, c.rope_theta, q.dtype)
        cos, sin = fb.rope                                                 # set by embed_tokens
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, kv, fb, self.attn_backend)                             # [T, H, hd]
        o = F.linear(o.reshape(T, H * hd), lyr.wo)                         # [T, D]
        if attn_reduce is not None:
            o = attn_reduce(o)
        h = st.h + o
        xn = rms_norm(h, lyr.ffn_norm, c.rms_eps)
        return SegmentState(h=h, xn=xn, routing=route(xn, lyr.router, c.top_k))

    def experts(self, i: int, st: SegmentState, expert_fn: ExpertFn | None = None) -> SegmentState:
        """Routed experts (local, or through an expert-parallel backend) plus the shared expert."""
        lyr = self.layers[i]
        assert st.xn is not None and st.routing is not None
        if expert_fn is None:
            y = self.expert_kernel(st.xn, st.routing, lyr.w13, lyr.w2)
        else:
            y = expert_fn(st.xn, st.routing, i)
        if lyr.shared_w13 is not None:
            y = y + swiglu_dense(st.xn, lyr.shared_w13, lyr.shared_w2)
        return SegmentState(h=st.h + y)

    def head(self, st: SegmentState, rows: Tensor | None) -> Tensor:
        """Logits [R, V] (float32) of the selected rows."""
        h = st.h if rows is None else st.h.index_select(0, rows)
        return F.linear(rms_norm(h, self.final_norm, self.cfg.rms_eps), self.lm_head).float()

    # ------------------------------------------------------------------ whole pass
    def forward_batch(self, fb: ForwardBatch, kv_cache: Tensor, expert_fn: ExpertFn | None = None,
                      attn_reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """All segments back to back: kv_cache [num_layers, 2, S, Hk, hd] -> logits [R, V]."""
        st = self.embed_tokens(fb)
        for i in range(self.cfg.num_layers):
            st = self.attn_route(i, st, fb, kv_cache[i], attn_reduce)
            st = self.experts(i, st, expert_fn)
        return self.head(st, fb.logits_rows)

    @property
    def num_boundaries(self) -> int:
        """Safe boundaries of one prefill pass: 0 (entry), then per layer the expert
        notification point and the layer end."""
        return 1 + 2 * self.cfg.num_layers


def build_model(c: ModelConfig, device: torch.device | str = "cpu") -> MoETransformer:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(c.torch_dtype)          # parameters are created in their final dtype
    try:
        with torch.device(device):
            model = MoETransformer(c)
    finally:
        torch.set_default_dtype(prev)
    model.requires_grad_(False)
    model.init_weights(c.seed)
    if c.weights_path:
        from .weights import load_safetensors
        load_safetensors(model, c.weights_path)
    return model
