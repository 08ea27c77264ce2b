"""Weight names -> where they land in this engine's parameters.

Three families of names are understood, for every supported architecture:

* the checkpoint's safetensors names (per expert: ``model.layers.N.mlp.experts.E.gate_proj.weight``
  [I, D], ``up_proj`` [I, D], ``down_proj`` [D, I]; mixtral ``block_sparse_moe.experts.E.w1/w3/w2``);
* the installed transformers' ``named_parameters()`` names and layouts (transformers 5 packs a
  layer's experts as ``mlp.experts.gate_up_proj`` [E, 2I, D], gate rows first, and
  ``mlp.experts.down_proj`` [E, D, I]; glm4_moe's ``mlp.gate.e_score_correction_bias`` is a buffer);
* this engine's own parameter names (``embed``, ``layers.N.wqkv``, ``layers.N.w13`` ...): whole
  parameters, as :meth:`torch.nn.Module.named_parameters` of the engine's model lists them.

A :class:`Target` says which parameter a name fills, where (a row block of the fused ``wqkv``,
the gate or up half of one expert's ``w13`` column block, ...), in which layout (transposed or
not; packed over the expert axis or one expert) and which *units* of the model it covers, so a
load or a weight sync can check that every unit is filled exactly once. With expert parallelism
the names of other ranks' experts are known but not this rank's (``mine`` False): they are
skipped without being read.

Layouts: this engine keeps ``wqkv`` [(H + 2Hk) hd, D] = [q; k; v] rows, ``w13`` [El, D, 2I]
(gate columns, then up), ``w2`` [El, I, D], dense / shared ``*_w13`` [D, 2I] and ``*_w2`` [I, D].

FP8 models (``model.quantization: fp8``, :mod:`ainfer_pd.engine.model.linear`): an FP8
projection ``P`` (the routed experts; the dense ones too with ``model.fp8_dense``) is ``P_fp8``
(out, in: the checkpoint's layout, no transposes) and ``P_scale_inv``; a weight name's target is a
row block of ``P_fp8`` (one part: q, k, v, gate, up, or the whole) with the matching block rows of
``P_scale_inv`` (:class:`Fp8Part`). A weight arriving in a float dtype is quantized into both (a
bf16 checkpoint, a trainer's bf16 sync); one arriving in float8_e4m3fn (an FP8 checkpoint) is
copied, and its ``weight_scale_inv`` (a name of its own here) fills the scales. Each is a unit of
its own, so a load or a complete sync needs every scale exactly once. A projection an FP8 model
keeps in the model dtype (the dense ones without ``fp8_dense``) takes a float weight as it is and
a float8_e4m3fn one with its ``weight_scale_inv`` (the pair *dequantized* into the model dtype:
``Target.dequant``; the scale's target writes nothing alone, it is read with its weight).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..engine.model.linear import (FLOAT8, FP8_SUFFIX, SCALE_SUFFIX, Projection, layer_projections, projection_of,
                                   quantize_parts)
from ..engine.quant.fp8 import FP8, dequantize_blockwise, scale_shape

Unit = tuple


@dataclass(frozen=True, slots=True)
class Fp8Part:
    """The block scales a weight fills with its FP8 values when it arrives in a float dtype and is
    quantized: ``scale[index]``, its ``units``; each of the ``split`` row parts (empty: one)
    on its own block grid (the packed ``gate_up_proj``: gate, then up)."""

    scale: str
    index: tuple
    units: tuple[Unit, ...]
    split: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Target:
    """Where one named tensor lands."""

    param: str | None                 # engine parameter name; None: known, carries nothing (tied lm_head)
    index: tuple = ()                 # index of the parameter region it fills
    shape: tuple[int, ...] = ()       # the named tensor's own shape
    transpose: bool = False           # its last two dims are transposed relative to the region
    expert_axis: bool = False         # packed: axis 0 runs over all E experts; this rank keeps [lo, hi)
    expert: int | None = None         # per-expert tensor: the global expert id
    mine: bool = True                 # False: another expert-parallel rank's expert
    units: tuple[Unit, ...] = ()      # the model units this tensor fills (on this rank)
    fp8: Fp8Part | None = None        # an FP8 projection's values: a float tensor is quantized (FP8 models)
    scale_of: tuple[int, ...] | None = None   # a weight_scale_inv: the shape of the weight it scales
    dequant: bool = False             # a model-dtype projection of an FP8 model: an e4m3 weight is dequantized
                                      # with its weight_scale_inv (whose own target has param None)

    def dequantizes(self, dtype: torch.dtype) -> bool:
        """A weight of ``dtype`` is dequantized on its way in (with its ``weight_scale_inv``, the
        same name + ``_scale_inv``): float8_e4m3fn into a model-dtype projection of an FP8 model."""
        return self.dequant and self.scale_of is None and dtype == FP8

    @property
    def pairs_scale(self) -> bool:
        """A ``weight_scale_inv`` of a model-dtype projection: read with its e4m3 weight, never alone."""
        return self.dequant and self.scale_of is not None

    def source(self, t: Tensor, lo: int, hi: int) -> Tensor:
        """The part of ``t`` this rank keeps, in the region's layout (a view)."""
        if self.expert_axis:
            t = t[lo:hi]
        return t.transpose(-1, -2) if self.transpose else t

    def quantizes(self, dtype: torch.dtype) -> bool:
        """A tensor of ``dtype`` is quantized on its way in (an FP8 projection, a float tensor)."""
        return self.fp8 is not None and dtype not in FLOAT8

    def units_for(self, dtype: torch.dtype) -> tuple[Unit, ...]:
        """The units a tensor of ``dtype`` fills: a quantized one fills its scales too."""
        return self.units + self.fp8.units if self.quantizes(dtype) else self.units

    def accepts(self, dtype: torch.dtype, param_dtype: torch.dtype) -> bool:
        """A tensor of ``dtype`` may fill this target's parameter (of ``param_dtype``): the same
        dtype; a float one into an FP8 projection (quantized) or into a float parameter (cast);
        never a float8 one into anything but float8_e4m3fn, nor a cast into float8."""
        if dtype == param_dtype:
            return True
        if self.dequantizes(dtype):
            return True
        if dtype in FLOAT8 or param_dtype in FLOAT8:
            return param_dtype == FP8 and self.quantizes(dtype) and dtype.is_floating_point
        return dtype.is_floating_point and param_dtype.is_floating_point

    def writes(self, src: Tensor, device: torch.device, dtype: torch.dtype) -> list[tuple[str, tuple, Tensor]]:
        """(parameter, index, tensor) of ``src`` (:meth:`source`'s view): itself, or its FP8 values
        and their block scales: cast to the model ``dtype`` on ``device``, then quantized (an FP8
        model's weights are the quantized weights the model-dtype model would hold)."""
        if not self.quantizes(src.dtype):
            return [(self.param, self.index, src)]
        q, s = quantize_parts(src.to(device=device, dtype=dtype), self.fp8.split)
        return [(self.param, self.index, q), (self.fp8.scale, self.fp8.index, s)]

    def dequantized(self, q: Tensor, scale_inv: Tensor, device: torch.device, dtype: torch.dtype) -> Tensor:
        """An e4m3 weight of this target and its ``weight_scale_inv`` (checkpoint layout, this rank's
        part) -> the weight in ``dtype`` on ``device``, in the region's layout (:meth:`source`'s)."""
        w = dequantize_blockwise(q.to(device), scale_inv.to(device), dtype)
        return w.transpose(-1, -2) if self.transpose else w


class NameTable:
    """Every name the model accepts (checkpoint, transformers and engine families)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.hf: dict[str, Target] = dict(hf_targets(model.cfg, model.expert_range, mtp_layer_of(model)))
        # the engine's own names: whole parameters (EP: this rank's expert shard)
        self.own = {n: Target(n, (), tuple(p.shape), units=tuple(_units_of(model, n, p)))
                    for n, p in self.params.items()}
        self.required: set[Unit] = {u for t in self.own.values() for u in t.units}
        """Units a checkpoint must fill."""
        self.sync_required: set[Unit] = {u for u in self.required if not u[0].endswith(".router_bias")}
        """Units a complete weight sync must fill: all but glm4_moe's ``e_score_correction_bias``,
        a buffer that ``named_parameters()`` does not list (sent, e.g. in a ``state_dict()``, it is
        applied; not sent, it keeps its value)."""

    def lookup(self, name: str) -> Target | None:
        t = self.hf.get(name)
        return t if t is not None else self.own.get(name)

    def cast_dtype(self, target: Target, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` for ``target`` may be cast to before it is staged: its
        parameter's, or for a float tensor of an FP8 projection the model dtype (it is quantized
        after; a cast to float8 would drop the block scales)."""
        if target.param is None or target.dequantizes(dtype):      # e4m3 + its scales: dequantized after
            return dtype
        if target.quantizes(dtype):
            return self.model.cfg.torch_dtype
        return self.params[target.param].dtype

    def is_hf(self, name: str) -> bool:
        return name in self.hf

    def describe_missing(self, missing: set[Unit], limit: int = 5) -> str:
        """The checkpoint names of some missing units (what the caller forgot)."""
        names = []
        for n, t in self.hf.items():
            if t.mine and not t.expert_axis and any(u in missing for u in t.units):
                names.append(n)
                if len(names) >= limit:
                    break
        more = f" (+{len(missing) - len(names)} more parts)" if len(missing) > len(names) else ""
        return ", ".join(names) + more


def name_table(model: nn.Module) -> NameTable:
    """The model's name table (built once per model and kept on it)."""
    table = getattr(model, "_name_table", None)
    if table is None or table.model is not model:
        table = NameTable(model)
        object.__setattr__(model, "_name_table", table)
    return table


# ---------------------------------------------------------------------------- units
def _units_of(model: nn.Module, name: str, p: Tensor) -> Iterator[Unit]:
    """Units of one engine parameter: the parts a name in another family may fill separately
    (an FP8 projection's values and scales: each its own)."""
    if name.rsplit(".", 1)[-1] == "bqkv":
        yield from ((name, part) for part in ("q", "k", "v"))
        return
    pr = projection_of(model, name)
    if pr is None:
        yield (name,)
        return
    lo, hi = model.expert_range
    yield from ((name, *k) for k in pr.unit_keys(range(lo, hi)))


# ---------------------------------------------------------------------------- checkpoint / transformers names
def _whole(p: str, shape: tuple, transpose: bool = False) -> Target:
    return Target(p, (), shape, transpose=transpose, units=((p,),))


def _proj(c: ModelConfig, pr: Projection, ip: str, part: str | None, shape: tuple, *, j: int | None = None,
          expert: int | None = None, mine: bool = True, experts: range | None = None) -> tuple[Target, Target | None]:
    """Where a checkpoint's (out, in) tensor of projection ``pr``'s ``part`` (None: all its rows)
    lands, in the model's format: ``j`` the local index of one expert's tensor, ``experts`` the
    local experts of a packed one (axis 0 over all E). With the target of its
    ``weight_scale_inv`` in an FP8 model (None otherwise): the FP8 projection's scales, or for a
    projection the FP8 model keeps in the model dtype the scales of an e4m3 weight to dequantize."""
    name = ip + pr.leaf
    a, b, sa, sb = pr.part(part)
    lead = () if j is None else (j,)
    keys = pr.unit_keys(experts) if experts is not None else [tuple(x for x in (expert, part) if x is not None)]
    packed = experts is not None
    if not pr.fp8:
        index = lead if part is None else (*lead, slice(None), slice(a, b)) if pr.transposed else (*lead, slice(a, b))
        units = tuple((name, *k) for k in keys) if mine else ()
        fp8_model = c.quantization == "fp8"
        weight = Target(name, index, shape, transpose=pr.transposed, expert_axis=packed, expert=expert, mine=mine,
                        units=units, dequant=fp8_model)
        scale = Target(None, (), scale_shape(shape), expert_axis=packed, expert=expert, mine=mine, scale_of=shape,
                       dequant=True)
        return weight, scale if fp8_model else None
    qn, sn = name + FP8_SUFFIX, name + SCALE_SUFFIX
    index, sindex = (lead, lead) if part is None else ((*lead, slice(a, b)), (*lead, slice(sa, sb)))
    units, sunits = (tuple((qn, *k) for k in keys), tuple((sn, *k) for k in keys)) if mine else ((), ())
    split = pr.rows if part is None and len(pr.rows) > 1 else ()
    weight = Target(qn, index, shape, expert_axis=packed, expert=expert, mine=mine, units=units,
                    fp8=Fp8Part(sn, sindex, sunits, split))
    scale = Target(sn, sindex, scale_shape(shape), expert_axis=packed, expert=expert, mine=mine, units=sunits,
                   scale_of=shape)
    return weight, scale


def _named(hf_name: str, targets: tuple[Target, Target | None]) -> Iterator[tuple[str, Target]]:
    """A checkpoint weight's target and, in an FP8 model, its ``weight_scale_inv``'s."""
    weight, scale = targets
    yield hf_name, weight
    if scale is not None and hf_name.endswith(".weight"):
        yield hf_name + SCALE_SUFFIX, scale


def mtp_layer_of(model: nn.Module) -> tuple[str, ...] | None:
    """What :func:`hf_targets` needs of ``model``'s MTP layer: None without one, else the optional
    tensors it holds of its own (``head``, ``embed``: :mod:`ainfer_pd.engine.model.mtp_layer`)."""
    m = getattr(model, "mtp", None)
    return None if m is None else tuple(w for w in ("head", "embed") if getattr(m, w) is not None)


def hf_targets(c: ModelConfig, experts: tuple[int, int],
               mtp: tuple[str, ...] | None = None) -> Iterator[tuple[str, Target]]:
    """(checkpoint or transformers name, its target) of a model of ``c`` holding ``experts`` [lo, hi)
    and, unless ``mtp`` is None, the MTP layer (``mtp``: its own optional tensors, :func:`mtp_layer_of`)."""
    D = c.hidden_size
    yield "model.embed_tokens.weight", _whole("embed", (c.vocab_size, D))
    yield "model.norm.weight", _whole("final_norm", (D,))
    yield "lm_head.weight", (Target(None, (), (c.vocab_size, D)) if c.tie_word_embeddings
                             else _whole("lm_head", (c.vocab_size, D)))
    for i in range(c.num_layers):
        hp, ip = f"model.layers.{i}.", f"layers.{i}."
        prs = layer_projections(c, i, experts[1] - experts[0])     # c: the attention TP shard's heads
        yield from _attention_targets(c, hp, ip, prs)
        if not c.is_moe_layer(i):
            yield from _mlp(c, hp + "mlp.", ip, prs, "dense")
            continue
        yield from _moe_targets(c, hp, ip, experts, prs)
    if mtp is not None:
        yield from _mtp_targets(c, experts, mtp)


def _mtp_targets(c: ModelConfig, experts: tuple[int, int], own: tuple[str, ...]) -> Iterator[tuple[str, Target]]:
    """The MTP layer ``model.layers.L.*`` (L = num_layers): a decoder layer in the main layers' names
    and formats, then ``enorm``, ``hnorm``, ``eh_proj`` (an e4m3 one of an FP8 checkpoint is
    dequantized with its ``weight_scale_inv``), ``shared_head.norm``, and ``shared_head.head`` /
    ``embed_tokens`` (into the layer's own copy when it holds one, else known and skipped: the
    main head / embedding serve)."""
    D, V, L = c.hidden_size, c.vocab_size, c.num_layers
    hp, ip = f"model.layers.{L}.", f"layers.{L}."
    prs = layer_projections(c, L, experts[1] - experts[0])
    yield from _attention_targets(c, hp, ip, prs)
    yield from _moe_targets(c, hp, ip, experts, prs)
    for leaf, param in (("enorm", "mtp.enorm"), ("hnorm", "mtp.hnorm"), ("shared_head.norm", "mtp.head_norm")):
        yield f"{hp}{leaf}.weight", _whole(param, (D,))
    fp8_model = c.quantization == "fp8"
    eh = Target("mtp.eh_proj", (), (D, 2 * D), units=(("mtp.eh_proj",),), dequant=fp8_model)
    yield from _named(hp + "eh_proj.weight", (eh, Target(None, (), scale_shape((D, 2 * D)), scale_of=(D, 2 * D),
                                                         dequant=True) if fp8_model else None))
    for which, leaf in (("head", "shared_head.head"), ("embed", "embed_tokens")):
        yield f"{hp}{leaf}.weight", _whole(f"mtp.{which}", (V, D)) if which in own else Target(None, (), (V, D))


def _attention_targets(c: ModelConfig, hp: str, ip: str, prs: dict) -> Iterator[tuple[str, Target]]:
    """One layer's norms and attention (``hp``: its checkpoint prefix, ``ip``: the engine's)."""
    D, H, Hk, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    rows = {"q": (0, H * hd), "k": (H * hd, (H + Hk) * hd), "v": ((H + Hk) * hd, (H + 2 * Hk) * hd)}
    yield hp + "input_layernorm.weight", _whole(ip + "attn_norm", (D,))
    yield hp + "post_attention_layernorm.weight", _whole(ip + "ffn_norm", (D,))
    for part, (a, b) in rows.items():
        yield from _named(hp + f"self_attn.{part}_proj.weight", _proj(c, prs["wqkv"], ip, part, (b - a, D)))
        if c.qkv_bias:
            yield (hp + f"self_attn.{part}_proj.bias",
                   Target(ip + "bqkv", (slice(a, b),), (b - a,), units=((ip + "bqkv", part),)))
    yield from _named(hp + "self_attn.o_proj.weight", _proj(c, prs["wo"], ip, None, (D, H * hd)))
    if c.o_bias:
        yield hp + "self_attn.o_proj.bias", _whole(ip + "bo", (D,))
    if c.qk_norm:
        yield hp + "self_attn.q_norm.weight", _whole(ip + "q_norm", (hd,))
        yield hp + "self_attn.k_norm.weight", _whole(ip + "k_norm", (hd,))


def _moe_targets(c: ModelConfig, hp: str, ip: str, experts: tuple[int, int],
                 prs: dict) -> Iterator[tuple[str, Target]]:
    """One MoE layer's router, routed experts (packed and per expert) and shared expert."""
    D, E, I = c.hidden_size, c.num_experts, c.expert_intermediate
    lo, hi = experts
    # mixtral checkpoints spell the MoE block_sparse_moe.* (its experts w1/w3/w2); transformers 5 mlp.*
    for mp in ([hp + "block_sparse_moe."] if c.architecture == "mixtral" else []) + [hp + "mlp."]:
        yield mp + "gate.weight", _whole(ip + "router", (E, D))
    if c.router == "sigmoid":
        yield hp + "mlp.gate.e_score_correction_bias", _whole(ip + "router_bias", (E,))
    # transformers' packed experts (named_parameters of the installed version)
    local = range(lo, hi)
    yield hp + "mlp.experts.gate_up_proj", _proj(c, prs["w13"], ip, None, (E, 2 * I, D), experts=local)[0]
    yield hp + "mlp.experts.down_proj", _proj(c, prs["w2"], ip, None, (E, D, I), experts=local)[0]
    yield from _expert_targets(c, hp, ip, experts, prs)
    if c.shared_expert_intermediate:
        shared = "mlp.shared_expert." if c.architecture == "qwen2_moe" else "mlp.shared_experts."
        yield from _mlp(c, hp + shared, ip, prs, "shared")
        if c.shared_expert_gate:
            yield hp + "mlp.shared_expert_gate.weight", _whole(ip + "shared_gate", (1, D))


def _expert_targets(c: ModelConfig, hp: str, ip: str, experts: tuple[int, int],
                    prs: dict) -> Iterator[tuple[str, Target]]:
    """The checkpoint's per-expert tensors of one layer (other ranks' experts: ``mine`` False)."""
    D, E, I = c.hidden_size, c.num_experts, c.expert_intermediate
    lo, hi = experts
    if c.architecture == "mixtral":
        names = {"gate": "block_sparse_moe.experts.{e}.w1.weight", "up": "block_sparse_moe.experts.{e}.w3.weight",
                 "down": "block_sparse_moe.experts.{e}.w2.weight"}
    else:
        names = {p: f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")}
    for e in range(E):
        kw = dict(j=e - lo, expert=e, mine=lo <= e < hi)
        for part in ("gate", "up"):
            yield from _named(hp + names[part].format(e=e), _proj(c, prs["w13"], ip, part, (I, D), **kw))
        yield from _named(hp + names["down"].format(e=e), _proj(c, prs["w2"], ip, None, (D, I), **kw))


def _mlp(c: ModelConfig, prefix: str, ip: str, prs: dict, kind: str) -> Iterator[tuple[str, Target]]:
    """A SwiGLU MLP (``kind`` dense or shared) stored as gate_proj / up_proj [I, D] and down_proj [D, I]."""
    w13, w2 = prs[kind + "_w13"], prs[kind + "_w2"]
    I, D = w13.rows[0], w2.rows[0]
    for part in ("gate", "up"):
        yield from _named(prefix + f"{part}_proj.weight", _proj(c, w13, ip, part, (I, D)))
    yield from _named(prefix + "down_proj.weight", _proj(c, w2, ip, None, (D, I)))
