"""The weight formats of the decoder's projections, in one place: the model dtype (the layouts
:class:`~.model.DecoderLayer` documents) or blockwise FP8 (``model.quantization: fp8``).

A *projection* is a weight matrix the attention or the FFN multiplies by: ``wqkv``, ``wo``, the
routed experts' ``w13`` / ``w2``, the shared expert's ``shared_w13`` / ``shared_w2`` and a dense
layer's ``dense_w13`` / ``dense_w2`` (:class:`Projection`: their shapes, parts and format). Each
has its own format (``Projection.fp8``): under ``model.quantization: fp8`` the routed experts are
FP8, the *dense* projections (all the others: every token runs them) only with
``model.fp8_dense`` (:meth:`~ainfer_pd.config.ModelConfig.fp8_projection`; the field says what
was measured). In FP8 a projection ``P`` is two parameters:

* ``P_fp8`` [..., N, K] float8_e4m3fn, always (out, in): Hugging Face's layout, so an FP8
  checkpoint's tensors copy in unchanged (the model-dtype MLP weights are (in, out));
* ``P_scale_inv`` [..., nb, ceil(K / 128)] float32, one scale per 128 x 128 block
  (:mod:`ainfer_pd.engine.quant.fp8`).

A fused projection stacks *parts* along N (``wqkv``: q, k, v; ``*w13``: gate, up), each with its
own block grid, the parts' scale rows stacked the same way: a part quantizes, loads and syncs on
its own (a gate arriving without its up quantizes into its own half), and a checkpoint's per-part
``weight_scale_inv`` copies in unchanged. When every part but the last is a whole number of
blocks (real models: 128-wide heads and intermediates) the stacked grids are the grid of the
whole matrix and one GEMM runs; otherwise one per part.

What stays in the model dtype in any case, and why: the router (``[E, D]``: small, and its
top-k choice is what routing replay records: an FP8 router would change which experts run, not
just their values), the shared expert's gate (``[1, D]``: one row, below any block), the embedding (a
lookup, no GEMM) and the head (the logits whose log-softmax the trainer's importance ratios
read), the norms and the biases.

The forward dispatches on the layer's format here and nowhere else (:func:`project`,
:func:`mlp`, :func:`routed`, :func:`grouped`): model dtype -> the torch ops the model always ran;
FP8 -> the model's :class:`Fp8Kernels` (the torch references by default; the Triton kernels
when the runner selects the Triton MoE backend).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quant.fp8 import BLOCK, FP8, blocks, experts_fp8_reference, fp8_linear_reference, quantize_blockwise
from .moe import Routing, routing_of, swiglu_dense, swiglu_grouped

FP8_SUFFIX, SCALE_SUFFIX = "_fp8", "_scale_inv"
"""An FP8 projection ``P``'s parameters: ``P_fp8`` (e4m3 values) and ``P_scale_inv`` (block scales)."""
FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n))
"""Every float8 dtype of the installed torch: none of them is ever cast into or out of (scales would be lost)."""


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection of a layer: its parts along N and its layouts."""

    leaf: str                        # the model-dtype parameter's name in the layer: wqkv, w13, dense_w2, ...
    lead: tuple[int, ...]            # leading dims: (El,) for the routed experts, () otherwise
    rows: tuple[int, ...]            # N (out features) as its parts, each its own block grid
    k: int                           # K (in features)
    part_names: tuple[str, ...]      # names of the parts: ("q", "k", "v"), ("gate", "up"), or () for one
    transposed: bool                 # the model-dtype parameter is [..., K, N] (in, out)
    fp8: bool = False                # held in FP8 (P_fp8 + P_scale_inv), else in the model dtype (P)

    @property
    def routed(self) -> bool:
        return bool(self.lead)

    @property
    def fp8_shape(self) -> tuple[int, ...]:
        return (*self.lead, sum(self.rows), self.k)

    @property
    def model_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.k, sum(self.rows)) if self.transposed else self.fp8_shape

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return (*self.lead, sum(blocks(r) for r in self.rows), blocks(self.k))

    @property
    def one_grid(self) -> bool:
        """The parts' stacked grids are the block grid of the whole [N, K] (one GEMM)."""
        return all(r % BLOCK == 0 for r in self.rows[:-1])

    def part(self, name: str | None) -> tuple[int, int, int, int]:
        """Rows [a, b) and block rows [sa, sb) of part ``name`` (None: all of them)."""
        if name is None:
            return 0, sum(self.rows), 0, sum(blocks(r) for r in self.rows)
        i = self.part_names.index(name)
        a, sa = sum(self.rows[:i]), sum(blocks(r) for r in self.rows[:i])
        return a, a + self.rows[i], sa, sa + blocks(self.rows[i])

    def unit_keys(self, experts: range) -> list[tuple]:
        """The keys of the units a load or a weight sync fills separately: (expert?, part?)."""
        parts = [(p,) for p in self.part_names] or [()]
        return [(e, *p) for e in experts for p in parts] if self.routed else parts


def layer_projections(c: Any, i: int, n_local: int) -> dict[str, Projection]:
    """Layer ``i``'s projections (``c``: its ModelConfig; ``n_local``: the routed experts it holds)."""
    D, H, Hk, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    dense, experts = c.fp8_projection(routed=False), c.fp8_projection(routed=True)
    out = {"wqkv": Projection("wqkv", (), (H * hd, Hk * hd, Hk * hd), D, ("q", "k", "v"), False, dense),
           "wo": Projection("wo", (), (D,), H * hd, (), False, dense)}
    if not c.is_moe_layer(i):
        out.update(_mlp("dense", c.dense_intermediate, D, dense))
        return out
    I = c.expert_intermediate
    out["w13"] = Projection("w13", (n_local,), (I, I), D, ("gate", "up"), True, experts)
    out["w2"] = Projection("w2", (n_local,), (D,), I, (), True, experts)
    if c.shared_expert_intermediate:
        out.update(_mlp("shared", c.shared_expert_intermediate, D, dense))
    return out


def _mlp(prefix: str, inter: int, D: int, fp8: bool) -> dict[str, Projection]:
    return {prefix + "_w13": Projection(prefix + "_w13", (), (inter, inter), D, ("gate", "up"), True, fp8),
            prefix + "_w2": Projection(prefix + "_w2", (), (D,), inter, (), True, fp8)}


def add_projection(layer: nn.Module, pr: Projection) -> None:
    """Register projection ``pr``'s parameter(s) on ``layer``, in the model dtype or in FP8 (the
    model-dtype name is then None)."""
    if not pr.fp8:
        setattr(layer, pr.leaf, nn.Parameter(torch.empty(pr.model_shape)))
        return
    setattr(layer, pr.leaf, None)
    setattr(layer, pr.leaf + FP8_SUFFIX, nn.Parameter(torch.zeros(pr.fp8_shape, dtype=FP8), requires_grad=False))
    setattr(layer, pr.leaf + SCALE_SUFFIX,
            nn.Parameter(torch.ones(pr.scale_shape, dtype=torch.float32), requires_grad=False))


def base_leaf(leaf: str) -> str:
    """``w13_fp8`` / ``w13_scale_inv`` -> ``w13``; other names unchanged."""
    return leaf.removesuffix(FP8_SUFFIX).removesuffix(SCALE_SUFFIX)


def is_routed_expert(model: nn.Module, name: str) -> bool:
    """``name`` (an engine parameter name) holds routed experts ([El, ...]: an expert-parallel shard)."""
    pr = projection_of(model, name)
    return pr is not None and pr.routed


def projection_of(model: nn.Module, name: str) -> Projection | None:
    """The projection an engine parameter name belongs to (``layers.3.w13_scale_inv`` -> layer 3's
    ``w13``), None for any other parameter."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "layers":
        return None
    return model.layers[int(parts[1])].projections.get(base_leaf(parts[2]))


# ====================================================================== quantization
@torch.no_grad()
def quantize_parts(w: Tensor, rows: tuple[int, ...] = ()) -> tuple[Tensor, Tensor]:
    """w [..., N, K] (out, in) -> (q, scale_inv), each part of ``rows`` (N split; empty: one part)
    on its own block grid, the parts stacked along N."""
    if len(rows) <= 1:
        return quantize_blockwise(w)
    qs, ss = zip(*(quantize_blockwise(p) for p in w.split(list(rows), dim=-2)))
    return torch.cat(qs, dim=-2), torch.cat(ss, dim=-2)


@torch.no_grad()
def store(layer: nn.Module, pr: Projection, value: Tensor, index: tuple = ()) -> None:
    """Write a model-layout value of projection ``pr`` (``index``: one expert's, e.g. ``(j,)``)
    into ``layer`` in its format: copied (cast to the parameter's dtype), or cast to the model
    dtype, then quantized (the FP8 weights are the quantized model-dtype weights)."""
    if not pr.fp8:
        p = getattr(layer, pr.leaf)
        (p[index] if index else p).copy_(value)
        return
    w = value.to(layer.model_dtype)
    if pr.transposed:
        w = w.transpose(-1, -2)
    q, s = quantize_parts(w, pr.rows)
    qp, sp = getattr(layer, pr.leaf + FP8_SUFFIX), getattr(layer, pr.leaf + SCALE_SUFFIX)
    (qp[index] if index else qp).copy_(q)
    (sp[index] if index else sp).copy_(s)


def has_nan(t: Tensor) -> bool:
    """Any NaN / inf in ``t`` (e4m3 has NaN only: its bit patterns S.1111.111)."""
    if not t.is_floating_point() or t.numel() == 0:
        return False
    if t.dtype == FP8:
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    lo, hi = value_range(t)
    return not (math.isfinite(lo) and math.isfinite(hi))


def value_range(t: Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty float tensor in one pass; a NaN anywhere makes both NaN and an
    inf shows at its end. One ``aminmax`` instead of ``isfinite().all()`` then ``abs().max()``: a
    weight sync checks every tensor it is given, and on the host that was ~55x slower (a 512 MiB
    bf16 bucket: 0.94 s against 0.017 s on 2 cores)."""
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return float(lo), float(hi)


# ====================================================================== the forward, by format
def experts_fp8_torch(x: Tensor, r: Routing, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor,
                      residual: Tensor | None = None) -> Tensor:
    """The FP8 routed experts in torch (:func:`~ainfer_pd.engine.quant.fp8.experts_fp8_reference`),
    with the Triton kernel's signature (``residual`` added after, in x's dtype)."""
    y = experts_fp8_reference(x, r.topk_idx, r.topk_weights, w13, w13_scale, w2, w2_scale)
    return y if residual is None else residual + y


@dataclass(slots=True)
class Fp8Kernels:
    """What an FP8 model's forward calls: the torch references (any device) unless the runner
    sets the Triton kernels (``fp8_ops.fp8_linear`` / ``fp8_ops.fused_experts_fp8``)."""

    linear: Callable[..., Tensor] = fp8_linear_reference
    """(x [T, K], q [N, K], scale_inv, bias | None) -> [T, N] in x's dtype."""
    experts: Callable[..., Tensor] = experts_fp8_torch
    """(x [T, D], routing, w13_fp8, w13_scale_inv, w2_fp8, w2_scale_inv, residual=None) -> [T, D] in x's dtype
    (plus ``residual`` [T, D] when given)."""


def project(layer: nn.Module, leaf: str, x: Tensor, bias: Tensor | None, kernels: Fp8Kernels) -> Tensor:
    """x [T, K] times projection ``leaf`` of ``layer`` (plus ``bias``) -> [T, N]."""
    pr = layer.projections[leaf]
    if not pr.fp8:
        return F.linear(x, getattr(layer, leaf), bias)
    q, s = getattr(layer, leaf + FP8_SUFFIX), getattr(layer, leaf + SCALE_SUFFIX)
    if pr.one_grid:
        return kernels.linear(x, q, s, bias)
    outs = []
    for name in pr.part_names:
        a, b, sa, sb = pr.part(name)
        outs.append(kernels.linear(x, q[a:b], s[sa:sb], None if bias is None else bias[a:b]))
    return torch.cat(outs, dim=-1)


def mlp(layer: nn.Module, prefix: str, x: Tensor, kernels: Fp8Kernels) -> Tensor:
    """The SwiGLU MLP ``prefix`` (``dense`` or ``shared``) of ``layer``: x [T, D] -> [T, D]."""
    if not layer.projections[prefix + "_w13"].fp8:
        return swiglu_dense(x, getattr(layer, prefix + "_w13"), getattr(layer, prefix + "_w2"))
    g, u = project(layer, prefix + "_w13", x, None, kernels).chunk(2, dim=-1)
    return project(layer, prefix + "_w2", F.silu(g) * u, None, kernels)


def routed(model: nn.Module, layer: nn.Module, x: Tensor, r: Routing, residual: Tensor | None = None) -> Tensor:
    """Every routed expert of ``layer`` on this model (no expert parallelism): x [T, D] -> [T, D], plus
    ``residual`` [T, D] when given (the Triton kernels add it inside their k-slot sum: no add launch)."""
    if not layer.projections["w13"].fp8:
        return model.expert_kernel(x, r, layer.w13, layer.w2, residual=residual)
    return model.fp8_kernels.experts(x, r, layer.w13_fp8, layer.w13_scale_inv, layer.w2_fp8, layer.w2_scale_inv,
                                     residual=residual)


def grouped(layer: nn.Module, j0: int, j1: int, xg: Tensor, counts: Tensor, kernels: Fp8Kernels) -> Tensor:
    """The local experts [j0, j1) (indices into ``layer``'s experts) over rows xg [N, D] grouped by
    expert, ``counts`` [j1 - j0] rows each; rows past the counts come back zero. No top-k weights
    (the expert exchange's combine applies them). No host synchronisation."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    n = xg.shape[0]
    if not layer.projections["w13"].fp8:
        out = swiglu_grouped(xg, layer.w13[j0:j1], layer.w2[j0:j1], offs)
        return out if out.shape[0] == n else torch.cat([out, xg.new_zeros(n - out.shape[0], xg.shape[1])])
    e = torch.searchsorted(offs, torch.arange(n, dtype=torch.int32, device=xg.device), right=True)
    live = e < j1 - j0                                     # rows past the counts: weight 0
    r = routing_of(e.clamp(max=j1 - j0 - 1).unsqueeze(1), live.to(xg.dtype).unsqueeze(1), j1 - j0)
    return kernels.experts(xg, r, layer.w13_fp8[j0:j1], layer.w13_scale_inv[j0:j1], layer.w2_fp8[j0:j1],
                           layer.w2_scale_inv[j0:j1])
