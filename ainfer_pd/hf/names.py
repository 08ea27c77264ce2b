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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from torch import Tensor, nn

from ..config import ModelConfig

Unit = tuple


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

    def source(self, t: Tensor, lo: int, hi: int) -> Tensor:
        """The part of ``t`` this rank keeps, in the region's layout (a view)."""
        if self.expert_axis:
            t = t[lo:hi]
        return t.transpose(-1, -2) if self.transpose else t


class NameTable:
    """Every name the model accepts (checkpoint, transformers and engine families)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.hf: dict[str, Target] = dict(_hf_targets(model.cfg, model.expert_range, self.params))
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
    """Units of one engine parameter: the parts a name in another family may fill separately."""
    leaf = name.rsplit(".", 1)[-1]
    lo, hi = model.expert_range
    if leaf in ("wqkv", "bqkv"):
        yield from ((name, part) for part in ("q", "k", "v"))
    elif leaf == "w13" and p.dim() == 3:                  # routed experts [El, D, 2I]
        yield from ((name, e, part) for e in range(lo, hi) for part in ("gate", "up"))
    elif leaf == "w2" and p.dim() == 3:
        yield from ((name, e) for e in range(lo, hi))
    elif leaf in ("shared_w13", "dense_w13"):
        yield from ((name, part) for part in ("gate", "up"))
    else:
        yield (name,)


# ---------------------------------------------------------------------------- checkpoint / transformers names
def _whole(p: str, shape: tuple, transpose: bool = False) -> Target:
    return Target(p, (), shape, transpose=transpose, units=((p,),))


def _hf_targets(c: ModelConfig, experts: tuple[int, int], params: dict) -> Iterator[tuple[str, Target]]:
    D = c.hidden_size
    yield "model.embed_tokens.weight", _whole("embed", (c.vocab_size, D))
    yield "model.norm.weight", _whole("final_norm", (D,))
    yield "lm_head.weight", (Target(None, (), (c.vocab_size, D)) if c.tie_word_embeddings
                             else _whole("lm_head", (c.vocab_size, D)))
    for i in range(c.num_layers):
        hp, ip = f"model.layers.{i}.", f"layers.{i}."
        yield from _attention_targets(c, hp, ip)
        if not c.is_moe_layer(i):
            yield from _mlp(hp + "mlp.", ip + "dense_w13", ip + "dense_w2", D, c.dense_intermediate)
            continue
        yield from _moe_targets(c, hp, ip, experts)


def _attention_targets(c: ModelConfig, hp: str, ip: str) -> Iterator[tuple[str, Target]]:
    """One layer's norms and attention (``hp``: its checkpoint prefix, ``ip``: the engine's)."""
    D, H, Hk, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    rows = {"q": (0, H * hd), "k": (H * hd, (H + Hk) * hd), "v": ((H + Hk) * hd, (H + 2 * Hk) * hd)}
    yield hp + "input_layernorm.weight", _whole(ip + "attn_norm", (D,))
    yield hp + "post_attention_layernorm.weight", _whole(ip + "ffn_norm", (D,))
    for part, (a, b) in rows.items():
        yield (hp + f"self_attn.{part}_proj.weight",
               Target(ip + "wqkv", (slice(a, b),), (b - a, D), units=((ip + "wqkv", part),)))
        if c.qkv_bias:
            yield (hp + f"self_attn.{part}_proj.bias",
                   Target(ip + "bqkv", (slice(a, b),), (b - a,), units=((ip + "bqkv", part),)))
    yield hp + "self_attn.o_proj.weight", _whole(ip + "wo", (D, H * hd))
    if c.o_bias:
        yield hp + "self_attn.o_proj.bias", _whole(ip + "bo", (D,))
    if c.qk_norm:
        yield hp + "self_attn.q_norm.weight", _whole(ip + "q_norm", (hd,))
        yield hp + "self_attn.k_norm.weight", _whole(ip + "k_norm", (hd,))


def _moe_targets(c: ModelConfig, hp: str, ip: str, experts: tuple[int, int]) -> Iterator[tuple[str, Target]]:
    """One MoE layer's router, routed experts (packed and per expert) and shared expert."""
    D, E, I = c.hidden_size, c.num_experts, c.expert_intermediate
    lo, hi = experts
    # mixtral checkpoints spell the MoE block_sparse_moe.* (its experts w1/w3/w2); transformers 5 mlp.*
    for mp in ([hp + "block_sparse_moe."] if c.architecture == "mixtral" else []) + [hp + "mlp."]:
        yield mp + "gate.weight", _whole(ip + "router", (E, D))
    if c.router == "sigmoid":
        yield hp + "mlp.gate.e_score_correction_bias", _whole(ip + "router_bias", (E,))
    w13, w2 = ip + "w13", ip + "w2"
    # transformers' packed experts (named_parameters of the installed version)
    yield (hp + "mlp.experts.gate_up_proj",
           Target(w13, (), (E, 2 * I, D), transpose=True, expert_axis=True,
                  units=tuple((w13, e, part) for e in range(lo, hi) for part in ("gate", "up"))))
    yield (hp + "mlp.experts.down_proj",
           Target(w2, (), (E, D, I), transpose=True, expert_axis=True, units=tuple((w2, e) for e in range(lo, hi))))
    yield from _expert_targets(c, hp, w13, w2, experts)
    Is = c.shared_expert_intermediate
    if Is:
        shared = "mlp.shared_expert." if c.architecture == "qwen2_moe" else "mlp.shared_experts."
        yield from _mlp(hp + shared, ip + "shared_w13", ip + "shared_w2", D, Is)
        if c.shared_expert_gate:
            yield hp + "mlp.shared_expert_gate.weight", _whole(ip + "shared_gate", (1, D))


def _expert_targets(c: ModelConfig, hp: str, w13: str, w2: str,
                    experts: tuple[int, int]) -> Iterator[tuple[str, Target]]:
    """The checkpoint's per-expert tensors of one layer (other ranks' experts: ``mine`` False)."""
    D, E, I = c.hidden_size, c.num_experts, c.expert_intermediate
    lo, hi = experts
    if c.architecture == "mixtral":
        names = {"gate": "block_sparse_moe.experts.{e}.w1.weight", "up": "block_sparse_moe.experts.{e}.w3.weight",
                 "down": "block_sparse_moe.experts.{e}.w2.weight"}
    else:
        names = {p: f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")}
    for e in range(E):
        mine = lo <= e < hi
        j = e - lo
        yield (hp + names["gate"].format(e=e),
               Target(w13, (j, slice(None), slice(0, I)), (I, D), transpose=True, expert=e, mine=mine,
                      units=((w13, e, "gate"),) if mine else ()))
        yield (hp + names["up"].format(e=e),
               Target(w13, (j, slice(None), slice(I, 2 * I)), (I, D), transpose=True, expert=e, mine=mine,
                      units=((w13, e, "up"),) if mine else ()))
        yield (hp + names["down"].format(e=e),
               Target(w2, (j,), (D, I), transpose=True, expert=e, mine=mine, units=((w2, e),) if mine else ()))


def _mlp(prefix: str, w13: str, w2: str, D: int, I: int) -> Iterator[tuple[str, Target]]:
    """A SwiGLU MLP stored as gate_proj / up_proj [I, D] and down_proj [D, I]."""
    yield prefix + "gate_proj.weight", Target(w13, (slice(None), slice(0, I)), (I, D), transpose=True,
                                              units=((w13, "gate"),))
    yield prefix + "up_proj.weight", Target(w13, (slice(None), slice(I, 2 * I)), (I, D), transpose=True,
                                            units=((w13, "up"),))
    yield prefix + "down_proj.weight", Target(w2, (), (D, I), transpose=True, units=((w2,),))
