"""Decoder-only MoE transformer written as a sequence of layer segments.

A forward pass is ``embed`` -> for every layer ``attn_route`` (attention, then the
router: the *notification* point of the expert exchange) and ``experts`` (routed +
shared experts) -> ``head``: the model's :attr:`~MoETransformer.segments`, plain data built
once per model. Both walks iterate that one sequence: :meth:`MoETransformer.forward_batch`
runs the segments back to back (decode, mixed batches, or as one CUDA graph) and a P epoch
(:mod:`.p_walk`) enqueues them one at a time so it can stop at every safe boundary.

Shape legend: T = tokens, D = hidden, H/Hk = query/KV heads, hd = head dim, E = experts, k = top-k, V = vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import ModelConfig
from ..attention import AttentionBackend, ForwardBatch, TorchAttention, attend, keeps_own_kv
from .rope import rope_cos_sin
from .linear import (SCALE_SUFFIX, Fp8Kernels, add_projection, base_leaf, layer_projections, mlp, project, routed,
                     store)
from .moe import Routing, experts_local
from .routing import RouterSpec, route

# An expert backend maps (x [T, D], routing, layer index) -> routed expert output [T, D].
ExpertFn = Callable[[Tensor, Routing, int], Tensor]

_REFERENCE = TorchAttention()


class DecoderLayer(nn.Module):
    """The parameters of one decoder layer; which exist is set by the config's features.

    Attention: ``attn_norm`` [D], ``wqkv`` [(H + 2Hk) hd, D] (+ ``bqkv``), ``q_norm`` / ``k_norm``
    [hd] (QK-norm), ``wo`` [D, H hd] (+ ``bo``). FFN: ``ffn_norm`` [D], then either the MoE
    (``router`` [E, D], ``router_bias`` [E] float32 for the sigmoid router, ``w13`` [El, D, 2I]
    with the gate columns first, ``w2`` [El, I, D], an optional shared expert ``shared_w13``
    [D, 2Is] / ``shared_w2`` [Is, D] / ``shared_gate`` [1, D]) or, for a dense layer, ``dense_w13``
    [D, 2Id] / ``dense_w2`` [Id, D]. El = the experts this rank holds (all without EP).

    ``model.quantization: fp8``: the routed experts' ``w13`` / ``w2`` and, with ``model.fp8_dense``,
    the dense projections (``wqkv``, ``wo``, ``shared_w13``, ``shared_w2``, ``dense_w13``,
    ``dense_w2``) are None, each projection ``P`` held as ``P_fp8`` float8_e4m3fn in (out, in)
    layout plus ``P_scale_inv`` float32 block scales (:mod:`.linear`): ``w13_fp8`` [El, 2I, D]
    (gate rows, then up rows, each half its own grid: scale [El, 2 nb(I), nb(D)]), ``w2_fp8``
    [El, D, I] (scale [El, nb(D), nb(I)]), ``wqkv_fp8`` [(H + 2Hk) hd, D] with the q, k and v rows
    each on its own block grid, ``wo_fp8`` [D, H hd], ``*_w13_fp8`` [2I, D] and ``*_w2_fp8`` [D, I]
    likewise; nb(n) = ceil(n / 128). The router,
    ``shared_gate``, norms and biases stay in the model dtype (:mod:`.linear` says why).
    ``projections``: each projection's shapes, parts and format (``Projection.fp8``).
    """

    def __init__(self, c: ModelConfig, i: int, experts: tuple[int, int]) -> None:
        super().__init__()
        D, hd = c.hidden_size, c.head_dim
        nqkv = (c.num_heads + 2 * c.num_kv_heads) * hd
        self.is_moe = c.is_moe_layer(i)
        self.model_dtype = c.torch_dtype
        pr = self.projections = layer_projections(c, i, experts[1] - experts[0])
        self.attn_norm = nn.Parameter(torch.ones(D))
        add_projection(self, pr["wqkv"])
        self.bqkv = nn.Parameter(torch.zeros(nqkv)) if c.qkv_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd)) if c.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if c.qk_norm else None
        add_projection(self, pr["wo"])
        self.bo = nn.Parameter(torch.zeros(D)) if c.o_bias else None
        self.ffn_norm = nn.Parameter(torch.ones(D))
        self.router = self.router_bias = self.w13 = self.w2 = None
        self.shared_w13 = self.shared_w2 = self.shared_gate = None
        self.dense_w13 = self.dense_w2 = None
        if not self.is_moe:
            add_projection(self, pr["dense_w13"])
            add_projection(self, pr["dense_w2"])
            return
        self.router = nn.Parameter(torch.empty(c.num_experts, D))
        if c.router == "sigmoid":      # e_score_correction_bias: float32 in every checkpoint and model dtype
            self.router_bias = nn.Parameter(torch.zeros(c.num_experts, dtype=torch.float32))
        add_projection(self, pr["w13"])
        add_projection(self, pr["w2"])
        if c.shared_expert_intermediate:
            add_projection(self, pr["shared_w13"])
            add_projection(self, pr["shared_w2"])
            if c.shared_expert_gate:
                self.shared_gate = nn.Parameter(torch.empty(1, D))


EMBED, ATTENTION, EXPERTS, HEAD = "embed", "attention", "experts", "head"
"""The kinds of segment."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One segment of a forward pass. ``boundary``: the safe boundary a walk passes right before
    it (None: none between it and the segment before). Numbering (:attr:`MoETransformer.num_boundaries`):
    0 the entry (before ``embed``), per layer l ``2l + 1`` the expert notification point (after
    its attention and router, before its ``experts``) and ``2l + 2`` the layer end (before the next
    layer's attention; the last, ``2L``, before ``head``)."""

    kind: str                 # EMBED | ATTENTION | EXPERTS | HEAD
    layer: int                # the decoder layer (-1 for embed and head)
    boundary: int | None
    label: str                # "embed", "attn<l>", "experts<l>", "head" (a stream item's name)


def layer_segments(num_layers: int) -> tuple[Segment, ...]:
    """The segments of a forward pass through ``num_layers`` layers, with their boundaries."""
    segs = [Segment(EMBED, -1, 0, "embed")]
    for i in range(num_layers):
        segs.append(Segment(ATTENTION, i, 2 * i if i else None, f"attn{i}"))
        segs.append(Segment(EXPERTS, i, 2 * i + 1, f"experts{i}"))
    segs.append(Segment(HEAD, -1, 2 * num_layers, "head"))
    return tuple(segs)


@dataclass(slots=True)
class SegmentState:
    """What flows between segments of one forward pass."""

    h: Tensor                 # [T, D] residual stream
    xn: Tensor | None = None  # [T, D] normalised FFN input of the current layer
    routing: Routing | None = None


class MoETransformer(nn.Module):
    def __init__(self, c: ModelConfig, experts: tuple[int, int] | None = None, mtp: bool = False) -> None:
        super().__init__()
        self.cfg = c
        self.expert_range = experts or (0, c.num_experts)
        """Global ids [lo, hi) of the routed experts this model holds (expert parallelism: its shard)."""
        lo, hi = self.expert_range
        if not 0 <= lo < hi <= c.num_experts:
            raise ValueError(f"expert range {self.expert_range} outside [0, {c.num_experts}]")
        self.router_spec = RouterSpec.of(c)
        self.embed = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(c, i, self.expert_range) for i in range(c.num_layers))
        self.tp_shard: tuple[int, int] = (0, 1)
        """(TP rank, ATP) of the attention heads this model holds (:func:`.tensor_parallel.shard_attention_`)."""
        self.segments: tuple[Segment, ...] = layer_segments(c.num_layers)
        """Every forward pass walks these (built once: a walk allocates nothing per segment)."""
        self.final_norm = nn.Parameter(torch.ones(c.hidden_size))
        # tied: the same Parameter under both names (named_parameters() lists it once, as "embed")
        self.lm_head = self.embed if c.tie_word_embeddings else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.attn_backend: AttentionBackend | None = None   # None: the torch reference path
        self.expert_kernel: Callable[[Tensor, Routing, Tensor, Tensor], Tensor] = experts_local
        self.fp8_kernels = Fp8Kernels()
        """What the FP8 projections run (``model.quantization: fp8``): the torch references unless the
        runner selects the Triton MoE backend (:mod:`.linear`)."""
        self.route_kernel: Callable[..., Routing] | None = None
        """A fused softmax router (``fused_moe.fused_softmax_route``, set with the Triton MoE
        backend); None: ``engine.routing.route``."""
        self.pad_slot: int | None = None
        """The KV slot padding rows write (the runner's scratch slot): the fused router routes
        them nowhere (:meth:`route_rows`); None: every row is routed."""
        self.kv_scales: Tensor | None = None
        """[num_layers, 2] float32 (K, V) scales of an FP8 KV pool (``cache.kv_dtype: fp8_e4m3``, set
        by the runner with the pool; :mod:`..attention.kv_fp8`); None: the pool is in the model dtype."""
        self.routing_sink = None
        """:class:`~ainfer_pd.engine.model.routed_experts.RoutedExpertsCache` recording every fed token's
        top-k expert ids (routing replay, ``cache.routed_experts``); None: nothing recorded."""
        self.load_report = None
        """What building the model read (:class:`ainfer_pd.hf.checkpoint.LoadReport`), if it loaded a checkpoint."""
        self.mtp = None
        """``mtp``: the MTP draft layer is ``layers[num_layers]`` (never walked by :attr:`segments`; added
        last, so the main parameters keep their init order) plus this :class:`.mtp_head.MtpHead`."""
        if mtp:
            from .mtp_head import MtpHead
            self.layers.append(DecoderLayer(c, c.num_layers, self.expert_range))
            self.mtp = MtpHead(c)

    @property
    def kernels(self) -> AttentionBackend:
        """The backend whose kernels run this model's attention, norms and QKV prologue."""
        return self.attn_backend or _REFERENCE

    def kv_scale(self, i: int) -> Tensor | None:
        """Layer i's [2] (K, V) scales of an FP8 KV pool; None for a pool in the model dtype."""
        return None if self.kv_scales is None else self.kv_scales[i]

    @property
    def holds_all_experts(self) -> bool:
        return self.expert_range == (0, self.cfg.num_experts)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random init: same seed and device type -> same weights (one generator
        per parameter, and per expert for routed-expert tensors, so an expert-parallel shard
        holds exactly its slice of the whole model's init). Norms 1, biases 0. An FP8 model draws
        the same values, casts them to the model dtype and quantizes them: its weights are the
        quantized weights of the model-dtype model of the same seed."""
        lo, dev = self.expert_range[0], self.embed.device
        for idx, (name, p, lyr, pr) in enumerate(self._logical_parameters()):
            base = seed * 100003 + idx
            leaf = name.rsplit(".", 1)[-1]
            if leaf.endswith("norm"):
                p.fill_(1.0)
                continue
            if leaf in ("bqkv", "bo", "router_bias"):
                p.zero_()
                continue
            shape = pr.model_shape if pr is not None else tuple(p.shape)
            if pr is not None and pr.routed:                 # routed experts [El, in, out]
                std = shape[-2] ** -0.5
                for j in range(shape[0]):
                    g = torch.Generator(device=dev).manual_seed(base * 1_000_003 + lo + j)
                    store(lyr, pr, torch.randn(shape[1:], generator=g, dtype=torch.float32, device=dev).mul_(std), (j,))
                continue
            g = torch.Generator(device=dev).manual_seed(base)
            fan_in = shape[0] if leaf.endswith(("w13", "w2")) else shape[-1]   # dense/shared [in, out]
            std = 1.0 if name == "embed" else fan_in ** -0.5
            t = torch.randn(shape, generator=g, dtype=torch.float32, device=dev).mul_(std)
            if pr is None:
                p.copy_(t)
            else:
                store(lyr, pr, t)
            del t

    def _logical_parameters(self):
        """(name, parameter, layer, projection) in the model-dtype model's parameter order: an FP8
        projection once, under its model-dtype name (its scales are written with its values)."""
        for name, p in self.named_parameters():
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layers":
                yield name, p, None, None
                continue
            if parts[2].endswith(SCALE_SUFFIX):
                continue
            lyr = self.layers[int(parts[1])]
            pr = lyr.projections.get(base_leaf(parts[2]))
            yield (f"layers.{parts[1]}.{pr.leaf}" if pr is not None else name), p, lyr, pr

    # ------------------------------------------------------------------ segments
    def embed_tokens(self, fb: ForwardBatch) -> SegmentState:
        c = self.cfg
        # NOTE: recomputed every pass (inside a captured graph too): static graph inputs change per replay
        fb.rope = rope_cos_sin(fb.positions, c.rotary_dim, c.rope_theta, self.embed.dtype)
        return SegmentState(h=F.embedding(fb.input_ids, self.embed))

    def attention(self, i: int, st: SegmentState, fb: ForwardBatch, kv: Tensor) -> Tensor:
        """Attention of layer i over this model's heads (writes this layer's KV): the output
        projection [T, D]. Under attention tensor parallelism (:mod:`.tensor_parallel`) the model
        holds a shard of the heads and this is a partial sum, reduced over the TP group before
        :meth:`after_attention`. kv [2, S, Hk, hd] is layer i's cache (Hk: this model's KV heads)."""
        o = attend(self.attention_prologue(i, st, fb, kv), kv, fb, self.attn_backend, self.kv_scale(i))  # [T, H, hd]
        return self.attention_out(i, o.flatten(1))             # [T, H * hd] (T may be 0: an empty batch)

    def attention_prologue(self, i: int, st: SegmentState, fb: ForwardBatch, kv: Tensor,
                           keep: bool | None = None) -> Tensor:
        """Layer i's attention up to the attention itself: norm, QKV projection, QK-norm (when the
        architecture has it), RoPE, this batch's K/V into the cache (and, roped, into ``fb.own_kv`` when
        the backend's prefill reads them contiguous: TMA) -> q [T, H, hd]. ``keep``: whether to keep them
        (a P graph's capture, whose batch is padding; default: whether the backend reads them)."""
        c, lyr, kn = self.cfg, self.layers[i], self.kernels
        x = kn.rms_norm(st.h, lyr.attn_norm, c.rms_eps)
        qkv = project(lyr, "wqkv", x, lyr.bqkv, self.fp8_kernels)          # [T, (H+2Hk)*hd]
        H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = (t.unflatten(-1, (-1, hd)) for t in qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1))
        if fb.rope is None:
            fb.rope = rope_cos_sin(fb.positions, c.rotary_dim, c.rope_theta, q.dtype)
        keep = bool(fb.prefill) and keeps_own_kv(kn, fb.num_prefill_tokens, q.dtype, hd, kv) if keep is None else keep
        fb.own_kv = (k, v) if keep else None                   # k: roped in place by the prologue (keep_k)
        return kn.prologue(q, k, v, lyr.q_norm, lyr.k_norm, c.rms_eps, fb.rope, kv, fb.write_slots,
                           kv_scale=self.kv_scale(i), keep_k=keep)

    def attention_out(self, i: int, o: Tensor) -> Tensor:
        """The output projection of layer i's attention o [T, H hd] -> [T, D]."""
        lyr = self.layers[i]
        return project(lyr, "wo", o, lyr.bo, self.fp8_kernels)

    def after_attention(self, i: int, st: SegmentState, o: Tensor, fb: ForwardBatch) -> SegmentState:
        """Residual add of the (reduced) attention output, FFN norm, then the router of layer i's
        MoE (None for a dense layer): its ``counts`` are what an expert exchange notifies to peers.
        With a ``routing_sink`` (routing replay) the router's choice of each row is recorded at its
        KV slot (``fb.write_slots`` [T]); a batch that may hold padding rows (``fb.padded``) routes
        them nowhere (:meth:`route_rows`). When the reduce was a reduce-scatter (``o`` has
        fewer rows than the pass: attention TP in D, :mod:`.tensor_parallel`), the rest of the layer
        runs on this TP rank's share of the rows, ``[r n, (r + 1) n)`` for ``n`` rows of ``o``."""
        c, lyr = self.cfg, self.layers[i]
        h, write_slots = st.h, fb.write_slots
        if o.shape[0] != h.shape[0]:
            n = o.shape[0]
            lo = self.tp_shard[0] * n
            h, write_slots = h[lo:lo + n], write_slots[lo:lo + n]
        h, xn = self.kernels.add_rms_norm(o, h, lyr.ffn_norm, c.rms_eps)
        routing = self.route_rows(i, xn, write_slots if fb.padded else None) if lyr.is_moe else None
        if routing is not None and self.routing_sink is not None and i < c.num_layers:    # not the MTP layer
            self.routing_sink.record(i, write_slots, routing.topk_idx)
        return SegmentState(h=h, xn=xn, routing=routing)

    def route_rows(self, i: int, xn: Tensor, write_slots: Tensor | None = None) -> Routing:
        """The router of layer i's MoE over any rows xn [N, D] (e.g. every replica's, gathered).
        With the rows' KV ``write_slots`` (a batch that may hold padding rows), the fused router
        leaves the padding rows (those writing :attr:`pad_slot`: a graph bucket's, a replica's) out
        of the experts, when this model runs them all (an expert exchange routes every row)."""
        lyr = self.layers[i]
        spec = self.router_spec
        if self.route_kernel is not None and spec.kind == "softmax" and spec.scaling == 1.0:
            pad = None
            if write_slots is not None and self.pad_slot is not None and self.holds_all_experts:
                pad = (write_slots, self.pad_slot)
            return self.route_kernel(xn, lyr.router, spec.top_k, spec.norm_topk_prob, pad)
        return route(xn, lyr.router, spec, lyr.router_bias)

    def attn_route(self, i: int, st: SegmentState, fb: ForwardBatch, kv: Tensor,
                   attn_reduce: Callable[[Tensor], Tensor] | None = None) -> SegmentState:
        """:meth:`attention` (reduced by ``attn_reduce`` under TP), then :meth:`after_attention`."""
        o = self.attention(i, st, fb, kv)
        if attn_reduce is not None:
            o = attn_reduce(o)
        return self.after_attention(i, st, o, fb)

    def experts(self, i: int, st: SegmentState, expert_fn: ExpertFn | None = None) -> SegmentState:
        """Routed experts (local, or through an expert-parallel backend) plus the shared expert;
        a dense layer runs its MLP here (locally: no expert exchange)."""
        lyr = self.layers[i]
        assert st.xn is not None
        if not lyr.is_moe:
            return SegmentState(h=st.h + mlp(lyr, "dense", st.xn, self.fp8_kernels))
        assert st.routing is not None
        res = st.h if expert_fn is None and "shared_w13" not in lyr.projections else None    # joins the k-slot sum
        if expert_fn is None:
            if not self.holds_all_experts:
                raise RuntimeError(f"this model holds experts {self.expert_range} only: the routed experts "
                                   "need the expert-parallel backend")
            y = routed(self, lyr, st.xn, st.routing, res)
        else:
            y = expert_fn(st.xn, st.routing, i)
        if "shared_w13" in lyr.projections:
            s = mlp(lyr, "shared", st.xn, self.fp8_kernels)
            if lyr.shared_gate is not None:                                # qwen2_moe: sigmoid-gated
                s = torch.sigmoid(F.linear(st.xn, lyr.shared_gate)) * s
            y = y + s
        return SegmentState(h=y if res is not None else st.h + y)

    def head(self, st: SegmentState, rows: Tensor | None) -> Tensor:
        """Logits [R, V] (float32) of the selected rows."""
        h = st.h if rows is None else st.h.index_select(0, rows)
        return F.linear(self.kernels.rms_norm(h, self.final_norm, self.cfg.rms_eps), self.lm_head).float()

    # ------------------------------------------------------------------ whole pass
    def forward_batch(self, fb: ForwardBatch, kv_cache: Tensor, expert_fn: ExpertFn | None = None,
                      attn_reduce: Callable[[Tensor], Tensor] | None = None,
                      gather: Callable[[Tensor], Tensor] | None = None,
                      on_hidden: Callable[[Tensor], None] | None = None) -> Tensor:
        """All :attr:`segments` back to back: kv_cache [num_layers, 2, S, Hk, hd] -> logits [R, V].
        ``gather``: after each layer, the rows of every TP rank from this rank's share (when
        ``attn_reduce`` is a reduce-scatter). ``on_hidden``: given the last layer's output [T, D]
        (every row, before the final norm) after the head (the MTP drafter's input)."""
        st = None
        for seg in self.segments:
            kind, i = seg.kind, seg.layer
            if kind == ATTENTION:
                st = self.attn_route(i, st, fb, kv_cache[i], attn_reduce)
            elif kind == EXPERTS:
                st = self.experts(i, st, expert_fn)
                if gather is not None:
                    st.h = gather(st.h)
            elif kind == EMBED:
                st = self.embed_tokens(fb)
            else:
                logits = self.head(st, fb.logits_rows)
                if on_hidden is not None:
                    on_hidden(st.h)
                return logits
        raise AssertionError("the segments end with the head")

    @property
    def num_boundaries(self) -> int:
        """Safe boundaries of one prefill pass: 0 (entry), then per layer the expert
        notification point and the layer end (the :attr:`Segment.boundary` numbering)."""
        return 1 + 2 * self.cfg.num_layers


def build_model(c: ModelConfig, device: torch.device | str = "cpu",
                experts: tuple[int, int] | None = None, mtp: bool = False) -> MoETransformer:
    """The model of ``c`` on ``device``, holding routed experts ``experts`` = [lo, hi) (default
    all) and, with ``mtp``, the MTP draft layer. Weights: a Hugging Face checkpoint at ``c.path``
    (this rank's experts only), else the seeded random init (``c.path`` without weight files says
    so in the log), then ``c.weights_path`` (this engine's own names) over it."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(c.torch_dtype)          # parameters are created in their final dtype
    try:
        with torch.device(device):
            model = MoETransformer(c, experts, mtp)
    finally:
        torch.set_default_dtype(prev)
    model.requires_grad_(False)
    if c.path:
        from ...hf.checkpoint import load_pretrained
        load_pretrained(model, c.path)           # random init (logged) when the directory has no weights
    else:
        model.init_weights(c.seed)
    if c.weights_path:
        from .weights import load_safetensors
        load_safetensors(model, c.weights_path)
    return model
