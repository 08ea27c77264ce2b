"""An FP8 KV pool's per-layer K / V scales by name: from a checkpoint, or from a weight sync.

The names are the ones vLLM reads (``maybe_remap_kv_scale_name`` and the compressed-tensors cache
scale mapper), for layer N under ``model.layers.N.self_attn.``:

* ``k_scale`` / ``v_scale`` and ``attn.k_scale`` / ``attn.v_scale`` (vLLM's own module path);
* ``k_proj.k_scale`` / ``v_proj.v_scale`` (NVIDIA ModelOpt);
* ``k_proj.output_scale`` / ``v_proj.output_scale`` (compressed-tensors, Quark);
* ``kv_scale``: one scale for both K and V (vLLM's deprecated form; its value serves both).

Each is one scalar (numel 1: shape ``()`` or ``[1]``; per-head scales are refused) in a float dtype,
positive and finite; a layer whose K is scaled must have its V scaled too, and the reverse. A
scale stores ``x`` as ``e4m3(x / scale)`` (:mod:`ainfer_pd.engine.attention.kv_fp8`): vLLM's
``k_scale``, the same meaning. With tensor or expert parallelism every rank takes the same
per-layer scales (a rank's KV heads are scaled by its layer's scale).

``cache.kv_scales`` (:func:`initial_kv_scales`, a pure function; :func:`kv_scales_for`) picks what
the pool starts with: ``unit`` 1.0, ``checkpoint`` the checkpoint's (every layer, else a
:class:`CheckpointError` naming the first missing tensor), ``auto`` the checkpoint's when it has
any, else 1.0. An MTP draft layer (``spec.method: mtp``: ``layers[num_layers]``, its own KV layer)
takes the checkpoint's scales when it carries that layer's, else each column's largest over the
target's layers: its KV only shapes drafts, which verification keeps from changing the output. The checkpoint loader only notes where the scale tensors are
(``LoadReport.kv_scale_tensors``: never unexpected); they are read when an FP8 pool is made, so a
pool in the model dtype (``cache.kv_dtype: auto``) ignores them. A weight sync carrying these
names writes them in place (:class:`KvScaleStage`).
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..errors import AInferPDError, CheckpointError, WeightUpdateError

if TYPE_CHECKING:
    from ..config_sections import CacheConfig

log = logging.getLogger("ainfer_pd.hf")

KV_SCALE_LEAVES: dict[str, tuple[int, ...]] = {
    "k_scale": (0,), "v_scale": (1,),
    "attn.k_scale": (0,), "attn.v_scale": (1,),
    "k_proj.k_scale": (0,), "v_proj.v_scale": (1,),
    "k_proj.output_scale": (0,), "v_proj.output_scale": (1,),
    "kv_scale": (0, 1),
}
"""The leaf of a scale name under ``model.layers.N.self_attn.`` -> the columns of ``kv_scales``
it fills (0: K, 1: V)."""
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$")
_KV = ("K", "V")


def kv_scale_of(name: str, num_layers: int) -> tuple[int, tuple[int, ...]] | None:
    """(layer, columns) of a K / V scale name of a model of ``num_layers`` layers; None for any
    other name (a layer past the model's included: those are not this model's scales)."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None or m.group(2) not in KV_SCALE_LEAVES:
        return None
    layer = int(m.group(1))
    return (layer, KV_SCALE_LEAVES[m.group(2)]) if layer < num_layers else None


def canonical_name(layer: int, col: int) -> str:
    """The name a missing scale is reported by: ``model.layers.N.self_attn.k_scale`` (or ``v_scale``)."""
    return f"model.layers.{layer}.self_attn.{'kv'[col]}_scale"


def scale_value(name: str, t: object, error: type[AInferPDError]) -> float:
    """The value of scale tensor ``name``: a float scalar, positive and finite, else ``error``."""
    if not isinstance(t, Tensor):
        raise error(f"K / V scale {name!r} is not a tensor ({type(t).__name__})")
    if t.layout != torch.strided or t.device.type == "meta":
        raise error(f"K / V scale {name!r} has no values here (a {t.layout} tensor on {t.device.type})")
    if t.numel() != 1:
        raise error(f"K / V scale {name!r} has shape {tuple(t.shape)}: one scalar per layer is needed (per-head or "
                    "per-token KV scales are not supported)")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise error(f"K / V scale {name!r} has dtype {t.dtype}; a float32 / bf16 / fp16 scalar is needed")
    v = float(t.detach().reshape(()).cpu())
    if not (math.isfinite(v) and 0 < v <= torch.finfo(torch.float32).max):      # kept as float32
        raise error(f"K / V scale {name!r} is {v!r}: a scale must be positive and finite")
    return v


class KvScaleSet:
    """The K / V scales of one model found by name (a checkpoint's, or one weight sync's), each
    checked as it arrives; ``error`` is the typed error of every refusal."""

    def __init__(self, num_layers: int, error: type[AInferPDError]) -> None:
        self.num_layers = num_layers
        self.error = error
        self.found: dict[tuple[int, int], tuple[str, float]] = {}
        """(layer, column: 0 K, 1 V) -> (the name that gave it, its value)."""

    def takes(self, name: str) -> bool:
        return kv_scale_of(name, self.num_layers) is not None

    def add(self, name: str, t: object) -> None:
        where = kv_scale_of(name, self.num_layers)
        if where is None:
            raise self.error(f"{name!r} is not a K / V scale of a model of {self.num_layers} layers")
        layer, cols = where
        v = scale_value(name, t, self.error)
        for c in cols:
            prev = self.found.get((layer, c))
            if prev is not None:
                raise self.error(f"K / V scale {name!r} scales layer {layer}'s {_KV[c]}, which {prev[0]!r} "
                                 "already scales")
        for c in cols:
            self.found[(layer, c)] = (name, v)

    def __len__(self) -> int:
        return len(self.found)

    def check_pairs(self) -> None:
        """Every layer with a K scale has a V scale, and the reverse; else the error names the
        tensor that is there and the one that is not."""
        for (layer, c), (name, _) in sorted(self.found.items()):
            if (layer, 1 - c) not in self.found:
                raise self.error(f"K / V scale {name!r} scales layer {layer}'s {_KV[c]} but nothing scales its "
                                 f"{_KV[1 - c]} (e.g. {canonical_name(layer, 1 - c)!r}): both or neither")

    def first_missing(self, upto: int | None = None) -> str | None:
        """The name of the first scale of layers 0 .. ``upto`` - 1 (default: every layer) not given
        (None: all given)."""
        for layer in range(self.num_layers if upto is None else upto):
            for c in (0, 1):
                if (layer, c) not in self.found:
                    return canonical_name(layer, c)
        return None

    def rows(self) -> tuple[list[int], Tensor]:
        """The layers given (both scales: :meth:`check_pairs` first) and their ``[n, 2]`` float32 (K, V)."""
        self.check_pairs()
        layers = sorted({layer for layer, _ in self.found})
        vals = [[self.found[(layer, c)][1] for c in (0, 1)] for layer in layers]
        return layers, torch.tensor(vals, dtype=torch.float32).reshape(len(layers), 2)


# ---------------------------------------------------------------------------- policy
def initial_kv_scales(mode: str, found: KvScaleSet | None, num_layers: int, draft_layers: int = 0) -> Tensor:
    """``cache.kv_scales`` -> the pool's first ``[num_layers + draft_layers, 2]`` float32 scales
    (CPU), from the checkpoint's scales ``found`` (None: no checkpoint). ``unit``: 1.0;
    ``checkpoint``: ``found``, every layer; ``auto``: ``found`` when it has any, else 1.0. A
    checkpoint carrying scales for some layers only is refused either way (no layer silently at
    1.0). The MTP draft layers after the target's: see :func:`with_draft_rows`."""
    return with_draft_rows(_target_kv_scales(mode, found, num_layers), found, draft_layers)


def with_draft_rows(target: Tensor, found: KvScaleSet | None, draft_layers: int) -> Tensor:
    """``target`` ``[L, 2]`` and ``draft_layers`` rows after it: a draft layer's own scales where
    ``found`` has both, else each column's largest over ``target`` (a draft layer's K / V are the
    same kind of activations; the largest scale saturates none that a target layer would not)."""
    if not draft_layers:
        return target
    L = target.shape[0]
    rows = target.amax(dim=0, keepdim=True).repeat(draft_layers, 1)
    for i in range(draft_layers):
        if found is not None and (L + i, 0) in found.found and (L + i, 1) in found.found:
            rows[i] = torch.tensor([found.found[(L + i, c)][1] for c in (0, 1)], dtype=torch.float32)
    return torch.cat([target, rows])


def _target_kv_scales(mode: str, found: KvScaleSet | None, num_layers: int) -> Tensor:
    ones = torch.ones(num_layers, 2, dtype=torch.float32)
    if mode == "unit":
        return ones
    if found is None or not len(found):
        if mode == "checkpoint":
            raise CheckpointError(f"cache.kv_scales=checkpoint: the checkpoint carries no K / V scales (first missing: "
                                  f"{canonical_name(0, 0)!r}); use kv_scales auto or unit, or calibrate them "
                                  "(RolloutWorker.calibrate_kv_scales)")
        return ones
    found.check_pairs()
    missing = found.first_missing(num_layers)
    if missing is not None:
        raise CheckpointError(f"the checkpoint's K / V scales miss {missing!r} ({2 * num_layers - len(found)} of "
                              f"{2 * num_layers} missing): an FP8 KV pool takes a scale for every layer's K and V")
    layers, vals = found.rows()
    keep = [i for i, layer in enumerate(layers) if layer < num_layers]
    ones[[layers[i] for i in keep]] = vals[keep]
    return ones


# ---------------------------------------------------------------------------- mechanism
def read_checkpoint_kv_scales(model_dir: str | Path, where: dict[str, str], num_layers: int) -> KvScaleSet:
    """The scales the loader found (name -> file of ``model_dir``), read and checked (a
    :class:`CheckpointError` naming a malformed one); a non-scalar is refused from its header."""
    from safetensors import safe_open
    found = KvScaleSet(num_layers, CheckpointError)
    by_file: dict[str, list[str]] = {}
    for name, fname in sorted(where.items()):
        by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        with safe_open(str(Path(model_dir) / fname), framework="pt", device="cpu") as h:
            for name in names:
                shape = tuple(h.get_slice(name).get_shape())
                if math.prod(shape) != 1:
                    raise CheckpointError(f"K / V scale {name!r} in {fname} has shape {shape}: one scalar per layer "
                                          "is needed (per-head or per-token KV scales are not supported)")
                found.add(name, h.get_tensor(name))
    return found


@torch.no_grad()
def kv_scales_for(model: nn.Module, cache: "CacheConfig", device: torch.device | str) -> Tensor | None:
    """The scales of ``model``'s KV pool: None for a pool in the model dtype (``cache.kv_dtype:
    auto``); for an FP8 pool the ones it has (made once, kept across sleeps and rewritten in
    place), else new ones (:func:`~ainfer_pd.engine.attention.kv_fp8.new_kv_scales`) filled per
    ``cache.kv_scales`` from the checkpoint ``model`` was loaded from, if any."""
    from ..engine.attention.kv_fp8 import new_kv_scales
    if cache.kv_dtype != "fp8_e4m3":
        return None
    if model.kv_scales is not None:
        return model.kv_scales
    L, n = model.cfg.num_layers, len(model.layers)          # n - L: the MTP draft layer, when built
    report = getattr(model, "load_report", None)
    found = None
    if cache.kv_scales != "unit" and report is not None and report.kv_scale_tensors:
        found = read_checkpoint_kv_scales(report.path, report.kv_scale_tensors, n)
        report.tensors_read.extend(sorted(report.kv_scale_tensors))
    values = initial_kv_scales(cache.kv_scales, found, L, n - L)
    scales = new_kv_scales(n, device)
    scales.copy_(values)
    if found is not None:
        log.info("FP8 KV scales from the checkpoint: K %.4g..%.4g, V %.4g..%.4g", float(values[:, 0].min()),
                 float(values[:, 0].max()), float(values[:, 1].min()), float(values[:, 1].max()))
    return scales


class KvScaleStage:
    """The K / V scales of one weight sync (:class:`~ainfer_pd.engine.model.weights.WeightStage`):
    each checked as it arrives; written in place into ``model.kv_scales`` by :meth:`apply`, which
    the sync calls only after every other check of the sync passed (all-or-nothing). A model
    whose pool has no scales (``cache.kv_dtype: auto``) ignores them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.scales = KvScaleSet(len(model.layers), WeightUpdateError)       # an MTP draft layer's too

    def takes(self, name: str) -> bool:
        return self.scales.takes(name)

    @property
    def ignored(self) -> bool:
        return self.model.kv_scales is None

    def add(self, name: str, t: object) -> bool:
        """Check and keep scale ``name``; False (nothing kept) when the pool has no scales."""
        if not isinstance(t, Tensor):
            raise WeightUpdateError(f"K / V scale {name!r} is not a tensor ({type(t).__name__})")
        if self.ignored:
            return False
        self.scales.add(name, t)
        return True

    def check(self) -> None:
        self.scales.check_pairs()

    @torch.no_grad()
    def apply(self) -> int:
        """Write the staged rows in place (captured graphs read the same storage); the number of
        scale tensors written."""
        if self.ignored or not len(self.scales):
            return 0
        layers, vals = self.scales.rows()
        ks = self.model.kv_scales
        ks[torch.tensor(layers, device=ks.device)] = vals.to(ks.device)
        return len({name for name, _ in self.scales.found.values()})
