"""Weights in and out: safetensors only (never pickle), checked in-place updates.

:class:`WeightStage` is the all-or-nothing weight sync of the engine model in any family of
names (:mod:`ainfer_pd.hf.names`); ``apply_named_tensors`` the plain same-name copy for any module.
"""
from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import ConfigError, WeightUpdateError, WorkerAsleepError
from ..quant.fp8 import FP8
from .linear import FLOAT8, SCALE_SUFFIX, has_nan, is_routed_expert, value_range


def save_safetensors(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import save_file
    # named_parameters, not state_dict: a tied head is the embedding (one tensor, listed once)
    save_file({k: v.detach().contiguous().cpu() for k, v in model.named_parameters()}, str(path))


def load_safetensors(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import load_file
    p = Path(path)
    if p.suffix != ".safetensors":
        raise ConfigError("model.weights_path must be a .safetensors file (pickled weights are refused)")
    if not p.exists():
        raise ConfigError(f"model.weights_path does not exist: {p.name}")
    apply_named_tensors(model, load_file(str(p)).items(), strict=True)


def check_named_tensors(model: nn.Module, named: Iterable[tuple[str, Tensor]]) -> list[tuple[nn.Parameter, Tensor]]:
    """Validate every (name, tensor) against the model before touching anything."""
    params = dict(model.named_parameters())
    plan: list[tuple[nn.Parameter, Tensor]] = []
    for name, t in named:
        if name not in params:
            raise WeightUpdateError(f"unknown weight name {name!r}")
        p = params[name]
        if not isinstance(t, Tensor):
            raise WeightUpdateError(f"weight {name!r} is not a tensor")
        if tuple(t.shape) != tuple(p.shape):
            raise WeightUpdateError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if not _dtype_ok(t.dtype, p.dtype):
            raise WeightUpdateError(f"weight {name!r} has dtype {t.dtype}, expected {p.dtype}")
        _check_values(name, t, p.dtype)
        plan.append((p, t))
    return plan


@torch.no_grad()
def apply_named_tensors(model: nn.Module, named: Iterable[tuple[str, Tensor]], *, strict: bool = False) -> int:
    """All-or-nothing in-place copy (converted to each parameter's dtype and device; the
    parameter's storage is never rebound, so CUDA graphs that captured it stay valid);
    returns the number of tensors copied."""
    named = list(named)
    plan = check_named_tensors(model, named)
    if strict:
        missing = set(dict(model.named_parameters())) - {n for n, _ in named}
        if missing:
            raise WeightUpdateError(f"missing weights: {sorted(missing)[:5]}")
    for p, t in plan:
        p.copy_(t)                                 # copy_ converts dtype and device
    return len(plan)


# ====================================================================== named syncs into the engine model
@dataclass(slots=True)
class SyncReport:
    """What one weight sync did on this rank."""

    applied: list[str] = field(default_factory=list)
    """Names copied into this rank's parameters."""
    skipped: list[str] = field(default_factory=list)
    """Names of other expert-parallel ranks' experts: shape-checked, never read."""
    ignored: list[str] = field(default_factory=list)
    """Known names that carry nothing here (the tied ``lm_head.weight``)."""


class WeightStage:
    """One all-or-nothing weight sync into an engine model.

    :meth:`add` checks each (name, tensor) the moment it arrives (a name of any family of
    :mod:`ainfer_pd.hf.names`; shape, dtype, finiteness of the part this rank keeps; no part
    given twice) and keeps a reference to it (``copy=True``: a copy in the parameter's dtype and
    device, for sources that reuse their buffers, e.g. verl's checkpoint engines, which overwrite
    a bucket's memory with the next bucket); nothing is written until :meth:`apply`, which first
    checks that the sync is complete (unless ``partial``). So a generator over several buckets
    whose last bucket is bad leaves every weight as it was. Without ``copy`` the caller must not
    reuse a tensor's memory for another one of the same sync (the copies happen at the end).

    An FP8 KV pool's K / V scales (``model.layers.N.self_attn.k_scale`` and the other names of
    :mod:`ainfer_pd.hf.kv_scales`) are checked as they arrive and written in place by :meth:`apply`
    with the rest; a model whose pool is in the model dtype ignores them.

    FP8 models (:mod:`ainfer_pd.hf.names`): a float tensor for an FP8 projection is quantized as it
    is staged; an e4m3 one needs its ``weight_scale_inv`` in the same sync. For a projection the
    FP8 model keeps in the model dtype a float tensor is copied as it is, and an e4m3 one and its
    ``weight_scale_inv`` (in any order, any buckets) are dequantized when both have arrived; one of
    the two without the other fails :meth:`apply` (partial syncs too), nothing written.

    The stage refuses a model whose weights are released (sleep level 2: every parameter has
    shape ``(0,)``) with :class:`~ainfer_pd.errors.WorkerAsleepError`, and never uses a name
    table built from released parameters (issue 34, item 12: such a table, cached on the model,
    used to fail every later complete sync).
    """

    def __init__(self, model: nn.Module, *, partial: bool = False, copy: bool = False) -> None:
        from ...hf.names import name_table
        released = [n for n, p in model.named_parameters() if p.numel() == 0]
        if released:
            raise WorkerAsleepError(f"the weights are off the device ({len(released)} parameters released, e.g. "
                                    f"{released[0]!r}): wake_up(['weights']) before a weight sync")
        table = name_table(model)
        if any(t.shape != tuple(table.params[n].shape) for n, t in table.own.items()):
            object.__setattr__(model, "_name_table", None)      # built from other shapes: rebuild it
            table = name_table(model)
        self.model = model
        self.table = table
        self.partial = partial
        self.copy = copy
        self.report = SyncReport()
        self.cancelled = False
        """Set from another thread to stop :meth:`add_all` at its next item (:class:`StageCancelled`)."""
        self._plan: list[tuple[Tensor, Tensor]] = []     # (parameter region, source view or copy)
        self._covered: dict = {}                          # unit -> the name that filled it
        self._unscaled: list[tuple[str, tuple]] = []      # e4m3 values by a checkpoint name: (name, its scale's units)
        self._pairs: dict[str, dict[str, Tensor]] = {}    # weight name -> its e4m3 "q" / scale "s" waiting for the other
        self._paired: set[str] = set()                    # weight names whose e4m3 + scale were dequantized
        self._hf_names = False
        self._manifest: list[tuple[str, tuple[int, ...], str]] = []
        # the engine's own names of expert-parallel shards ([E/e, ...] on each rank): the manifest
        # records them at the whole experts' shape, so every rank of one sync publishes the same
        self._expert_shards = {n for n in table.params if is_routed_expert(model, n)}
        self._items = 0
        from ...hf.kv_scales import KvScaleStage
        self._kv = KvScaleStage(model)          # an FP8 KV pool's K / V scales, by their checkpoint names

    # ------------------------------------------------------------------ input forms
    def add_all(self, named: Iterable[Any] | Mapping[str, Tensor]) -> "WeightStage":
        """(name, tensor) pairs, a generator of them, a ``{name: tensor}`` mapping (a
        ``state_dict()``), or an iterable of *buckets* (each a list / tuple of pairs or a mapping);
        anything else is a WeightUpdateError naming the item."""
        items = named.items() if isinstance(named, Mapping) else named
        for item in items:
            self.add_item(item)
        return self

    def add_item(self, item: Any) -> None:
        """One item of a sync: a (name, tensor) pair or a bucket of them."""
        i = self._items
        self._items += 1
        if isinstance(item, Mapping):
            for pair in item.items():
                self._add_pair(pair, i)
        elif is_bucket(item):
            for pair in item:
                self._add_pair(pair, i)
        else:
            self._add_pair(item, i)

    def _add_pair(self, item: Any, i: int) -> None:
        if self.cancelled:
            raise StageCancelled("the weight sync was cancelled")
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise WeightUpdateError(f"update_weights item {i} is not a (name, tensor) pair or a bucket of them: "
                                    f"{type(item).__name__}"
                                    + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
        self.add(*item)

    def add(self, name: str, t: Tensor) -> None:
        if self._kv.takes(name):                # every rank takes the same per-layer scales
            staged = self._kv.add(name, t)      # False: a pool in the model dtype has none (ignored)
            self._manifest.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
            (self.report.applied if staged else self.report.ignored).append(name)
            return
        target = self._target(name, t)
        shape = tuple(t.shape)
        if name in self._expert_shards:     # this rank's shard of the experts: the manifest says the whole
            shape = (self.model.cfg.num_experts, *shape[1:])
        self._manifest.append((name, shape, str(t.dtype).removeprefix("torch.")))
        self._hf_names |= self.table.is_hf(name)
        if not target.mine:
            self.report.skipped.append(name)
            return
        if target.pairs_scale or target.dequantizes(t.dtype):
            self._add_to_pair(name, target, t)
            return
        if target.param is None:
            self.report.ignored.append(name)
            return
        p = self.table.params[target.param]
        if not target.accepts(t.dtype, p.dtype):
            raise WeightUpdateError(f"weight {name!r} has dtype {t.dtype}, expected {_expected(target, p.dtype)}")
        lo, hi = self.model.expert_range
        src = target.source(t, lo, hi)
        _check_values(name, src, t.dtype if target.quantizes(t.dtype) else p.dtype)
        self._cover(name, target, target.units_for(t.dtype))
        if target.fp8 is not None and not target.quantizes(t.dtype):
            self._unscaled.append((name, target.fp8.units))
        for pname, index, v in target.writes(src, p.device, self.model.cfg.torch_dtype):
            q = self.table.params[pname]
            if self.copy and v is src:     # the source's memory may be reused by the next bucket: our own copy
                v = v.detach().to(device=q.device, dtype=q.dtype, copy=True)
            self._plan.append((q[index] if index else q, v))       # a quantized tensor is already our own
        self.report.applied.append(name)

    def _target(self, name: str, t: Tensor) -> Any:
        """The target of ``name``, after the checks that need no parameter: a known name, a dense
        tensor with values, of the name's shape."""
        if not isinstance(name, str):
            raise WeightUpdateError(f"weight name {name!r} is not a string")
        target = self.table.lookup(name)
        if target is None:
            c = self.model.cfg
            raise WeightUpdateError(f"unknown weight name {name!r} (a {c.architecture} model of {c.num_layers} layers "
                                    "takes its checkpoint's names, the installed transformers' named_parameters() "
                                    "names, or this engine's own parameter names)")
        if not isinstance(t, Tensor):
            raise WeightUpdateError(f"weight {name!r} is not a tensor ({type(t).__name__})")
        if t.layout != torch.strided:
            raise WeightUpdateError(f"weight {name!r} is a {t.layout} tensor; a dense (strided) one is needed")
        if t.device.type == "meta":
            raise WeightUpdateError(f"weight {name!r} is on the meta device (it has no values)")
        if tuple(t.shape) != target.shape:
            raise WeightUpdateError(f"weight {name!r} has shape {tuple(t.shape)}, expected {target.shape}")
        return target

    def _cover(self, name: str, target: Any, units: tuple) -> None:
        """Mark ``units`` filled by ``name``; a unit filled twice in one sync is a WeightUpdateError."""
        for u in units:
            prev = self._covered.get(u)
            if prev is not None:
                raise WeightUpdateError(f"weight {name!r} fills a part of {target.param!r} that {prev!r} already "
                                        "filled in this sync")
        for u in units:
            self._covered[u] = name

    def _add_to_pair(self, name: str, target: Any, t: Tensor) -> None:
        """An e4m3 weight of a projection this FP8 model keeps in the model dtype, or its
        ``weight_scale_inv``: kept (a copy with ``copy``) until the other half arrives, then
        dequantized into the model dtype and staged."""
        scale = target.pairs_scale
        weight = name.removesuffix(SCALE_SUFFIX) if scale else name
        wt = self.table.lookup(weight)
        p = self.table.params[wt.param]
        if scale and (t.dtype in FLOAT8 or not t.is_floating_point()):
            raise WeightUpdateError(f"block scales {name!r} have dtype {t.dtype}; expected float32")
        _check_values(name, t, FP8 if not scale else torch.float32)
        if not scale:
            self._cover(name, wt, wt.units)
        pair = self._pairs.setdefault(weight, {})
        if ("s" if scale else "q") in pair or weight in self._paired:
            raise WeightUpdateError(f"weight {name!r} was given twice in this sync")
        pair["s" if scale else "q"] = t.detach().to(p.device, copy=True) if self.copy else t
        self.report.applied.append(name)
        if len(pair) < 2:
            return
        del self._pairs[weight]
        self._paired.add(weight)
        lo, hi = self.model.expert_range
        q, s = (pair["q"][lo:hi], pair["s"][lo:hi]) if wt.expert_axis else (pair["q"], pair["s"])
        w = wt.dequantized(q, s, p.device, p.dtype)
        _check_values(weight, w, p.dtype)                    # a scale too large for the model dtype: inf
        self._plan.append((p[wt.index] if wt.index else p, w))

    # ------------------------------------------------------------------ completeness, manifest, apply
    def missing(self) -> set:
        return self.table.sync_required - self._covered.keys()

    def check_complete(self) -> None:
        """Every K / V scale given has its pair; unless ``partial``: every unit of the model was
        given, else WeightUpdateError."""
        self._kv.check()
        if self.partial:
            return
        missing = self.missing()
        if missing:
            mtp = self._mtp_units(missing)
            if mtp and mtp == missing:
                raise WeightUpdateError(f"incomplete weight sync: the MTP draft layer (spec.method mtp) is missing "
                                        f"{self.table.describe_missing(mtp)} ({len(mtp)} of its parts not given; "
                                        "nothing was written): it is synced with the rest, never left stale")
            if self._hf_names:
                what = self.table.describe_missing(missing)
            else:
                what = ", ".join(sorted({u[0] for u in missing})[:5])
            raise WeightUpdateError(f"incomplete weight sync: missing {what} ({len(missing)} of "
                                    f"{len(self.table.sync_required)} parts not given; nothing was written; "
                                    "pass partial=True to update a subset)")

    def _mtp_units(self, units: set) -> set:
        """The units of ``units`` that belong to the model's MTP layer (none without one)."""
        if getattr(self.model, "mtp", None) is None:
            return set()
        own = f"layers.{self.model.cfg.num_layers}."
        return {u for u in units if u[0].startswith((own, "mtp."))}

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """What this sync was given, in a canonical order: (name, shape, dtype) of every tensor
        (other expert-parallel ranks' experts included), sorted by name."""
        return sorted(self._manifest)

    def digest(self) -> str:
        """sha256 of :meth:`manifest` and ``partial``: equal on every rank of one collective sync."""
        return manifest_digest(self.manifest(), self.partial)

    @torch.no_grad()
    def apply(self) -> int:
        """Check completeness (unless partial), then copy every staged tensor (converted to the
        parameter's dtype and device; storages are never rebound, so captured CUDA graphs stay
        valid). Returns the number of tensors written."""
        self.check_complete()
        alone = [n for n, units in self._unscaled if any(u not in self._covered for u in units)]
        alone += [n for n, pair in self._pairs.items() if "q" in pair]
        if alone:            # e4m3 values under the previous scales would be other weights (partial syncs too)
            raise WeightUpdateError(f"weight {alone[0]!r} arrived in float8_e4m3fn without its weight_scale_inv "
                                    f"({len(alone)} such; nothing was written)")
        unpaired = [n for n, pair in self._pairs.items() if "q" not in pair]
        if unpaired:         # scales of a weight sent in a float dtype (or not sent): they scale nothing
            raise WeightUpdateError(f"{unpaired[0] + SCALE_SUFFIX!r} arrived without its weight in float8_e4m3fn "
                                    f"({len(unpaired)} such; nothing was written)")
        for region, src in self._plan:
            region.copy_(src)
        return len(self._plan) + self._kv.apply()


class StageCancelled(Exception):
    """Internal: a staging thread stopped at its next item (the sync was cancelled or the worker
    closed); the caller raises the real reason."""


def is_bucket(item: Any) -> bool:
    """A list / tuple of (name, tensor) pairs (or a mapping), as opposed to one pair: a pair is a
    2-sequence whose first element is not itself a sequence."""
    if isinstance(item, Mapping):
        return True
    if not isinstance(item, (list, tuple)):
        return False
    if len(item) == 0:
        return True
    return all(isinstance(x, (list, tuple)) for x in item) and not isinstance(item[0], str)


def manifest_digest(manifest: list[tuple[str, tuple[int, ...], str]], partial: bool) -> str:
    import hashlib
    h = hashlib.sha256(b"partial" if partial else b"complete")
    for name, shape, dtype in manifest:
        h.update(f"\n{name}|{','.join(map(str, shape))}|{dtype}".encode())
    return h.hexdigest()


def _dtype_ok(t: torch.dtype, p: torch.dtype) -> bool:
    """A same-name copy: the same dtype, or float into float; never into or out of float8 (a cast
    would drop the block scales)."""
    if t == p:
        return True
    return t.is_floating_point and p.is_floating_point and not {t, p} & set(FLOAT8)


def _expected(target: Any, dtype: torch.dtype) -> str:
    if target.fp8 is not None:
        return f"{dtype} (with its weight_scale_inv) or a float dtype (quantized on the way in)"
    if target.dequant:
        return f"{dtype} or float8_e4m3fn with its weight_scale_inv (dequantized on the way in)"
    return str(dtype)


def _check_values(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if not t.is_floating_point() or t.numel() == 0:
        return
    if t.dtype in FLOAT8:
        if has_nan(t):
            raise WeightUpdateError(f"weight {name!r} has non-finite values")
        return
    lo, hi = value_range(t)                          # one pass: finiteness and magnitude
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise WeightUpdateError(f"weight {name!r} has non-finite values")
    big = max(-lo, hi)
    if dtype.is_floating_point and big > torch.finfo(dtype).max:    # would become inf in the parameter's dtype
        raise WeightUpdateError(f"weight {name!r} has a value of magnitude {big:.3g}, beyond {dtype}")
