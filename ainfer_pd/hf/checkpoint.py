"""Reading a Hugging Face model directory into the engine model, lazily and per rank.

The directory holds ``config.json`` and one or many ``*.safetensors`` files, with or without
``model.safetensors.index.json``. Every file is opened with ``safe_open`` (headers only); each
tensor is read when it is copied into its parameter, and with expert parallelism a rank reads
only its own experts' tensors (packed expert tensors: only its slice). Before anything is read
the whole checkpoint is checked against the model: every tensor name known, every shape as
``config.json`` implies, every part of the model filled exactly once; a failure is a
:class:`~ainfer_pd.errors.CheckpointError` naming the tensor (or shard).

Pickled weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are never unpickled: a directory
with only those is refused. A directory with ``config.json`` and no weight files at all gives
the seeded random init of the real shapes (benchmarks), and says so in the log.

FP8 (``model.quantization: fp8``), for an FP8 projection (the routed experts; the dense ones too
with ``model.fp8_dense``): a weight stored in a float dtype (a bf16 checkpoint, or the modules an
FP8 checkpoint keeps unquantized: ``modules_to_not_convert`` / ``ignored_layers``) is cast to the
model dtype and quantized at load, on the device; a float8_e4m3fn weight (an FP8 checkpoint) is
copied with its ``weight_scale_inv``. For a projection the FP8 model keeps in the model dtype (the
dense ones by default) a float weight is copied as it is and a float8_e4m3fn one is dequantized
with its ``weight_scale_inv`` into the model dtype, on the device. Either way a missing or
misshaped ``weight_scale_inv``, or one beside a weight stored in a float dtype, is a
CheckpointError naming the tensor. A float8 tensor for any other model-dtype parameter (the
router, ...), or any float8 tensor in a model without ``quantization: fp8``, is refused by name.

FP8 KV cache scales (``self_attn.k_scale`` / ``v_scale`` and the other names vLLM reads:
:mod:`.kv_scales`) are noted, not read here: an FP8 pool reads them when it is made
(``cache.kv_scales``), a pool in the model dtype ignores them.
"""
from __future__ import annotations

import json
import logging
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine.quant.fp8 import FP8, check_scale
from ..engine.model.linear import SCALE_SUFFIX
from ..errors import CheckpointError
from .config import num_extra_layers, read_config_json
from .kv_scales import kv_scale_of
from .names import name_table

log = logging.getLogger("ainfer_pd.hf")

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "F8_E4M3": FP8}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(slots=True)
class LoadReport:
    """What loading one model (one rank) did."""

    path: str
    random_init: bool = False
    files: list[str] = field(default_factory=list)
    """Weight files opened (headers read)."""
    tensors_read: list[str] = field(default_factory=list)
    """Names whose data this rank read (expert parallelism: its own experts only)."""
    tensors_skipped: list[str] = field(default_factory=list)
    """Names of other ranks' experts, or unused extra layers: never read."""
    kv_scale_tensors: dict[str, str] = field(default_factory=dict)
    """An FP8 KV pool's K / V scales the checkpoint carries (name -> file): read when the pool is
    made (:mod:`.kv_scales`, ``cache.kv_scales``), ignored by a pool in the model dtype."""
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def weight_files(model_dir: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a model directory and the index's name -> file map (None
    without an index). No weight files at all -> ([], None); pickle only -> CheckpointError."""
    d = Path(model_dir)
    idx = d / INDEX
    if idx.is_file():
        wmap = _read_index(idx, d.name)
        shards = sorted(set(wmap.values()))
        absent = [s for s in shards if not (d / s).is_file()]
        if absent:
            raise CheckpointError(f"{d.name}: shard(s) {', '.join(absent)} listed in {INDEX} are missing "
                                  f"({len(wmap)} tensors indexed over {len(shards)} shards)")
        return [d / s for s in shards], dict(wmap)
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files, None
    pickled = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise CheckpointError(f"{d.name} holds pickled weights only ({', '.join(pickled[:3])}): ainfer-pd never "
                              "unpickles checkpoints (loading a pickle can run arbitrary code); convert them to "
                              "safetensors (e.g. save_pretrained(..., safe_serialization=True))")
    return [], None


def _read_index(idx: Path, dname: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file), every entry checked before any
    shard is looked at: an object of names to file names, each a plain ``*.safetensors`` name
    inside the model directory (issue 34, item 15: ``../x.safetensors``, an absolute path or a
    sub-path is refused before anything outside the directory is opened or even looked up)."""
    try:
        data = json.loads(idx.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{dname}/{INDEX} is not readable JSON ({exc})") from None
    if not isinstance(data, dict) or "weight_map" not in data:
        raise CheckpointError(f"{dname}/{INDEX} has no weight_map object")
    wmap = data["weight_map"]
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{dname}/{INDEX}: weight_map must be an object of tensor name -> shard file, "
                              f"got {type(wmap).__name__}")
    for name, fname in wmap.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"{dname}/{INDEX}: weight_map[{name!r}]={fname!r}: expected a shard file name")
        if not _inside(fname):
            raise CheckpointError(f"{dname}/{INDEX}: weight_map[{name!r}]={fname!r} is not a file of the model "
                                  "directory (shards are plain *.safetensors names inside it)")
    return wmap


def _inside(fname: str) -> bool:
    """``fname`` names a file directly inside the model directory: a plain ``*.safetensors`` name
    (no separator, no ``..``, not absolute, no NUL)."""
    return (fname.endswith(".safetensors") and "/" not in fname and "\\" not in fname and "\0" not in fname
            and fname not in (".", "..") and not fname.startswith(".."))


@torch.no_grad()
def load_pretrained(model: nn.Module, model_dir: str | Path) -> "LoadReport":
    """Fill ``model`` (an engine model built from this directory's config) from its weights;
    random init when it has none. Sets and returns ``model.load_report``."""
    t0 = time.perf_counter()
    d = Path(model_dir)
    hf = read_config_json(d)
    files, index = weight_files(d)
    report = LoadReport(path=str(d))
    if not files:
        log.info("%s has config.json but no weight files: seeded random init (seed %d) of the real shapes",
                 d.name, model.cfg.seed)
        model.init_weights(model.cfg.seed)
        report.random_init = True
        report.seconds = time.perf_counter() - t0
        model.load_report = report
        return report
    lo, hi = model.expert_range
    extra_from = model.cfg.num_layers if num_extra_layers(hf) else None
    from safetensors import safe_open
    with ExitStack() as stack:                     # pass 1: every file's header, nothing read
        handles = {}
        for f in files:
            try:
                handles[f.name] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as exc:          # safetensors raises its own error types
                raise CheckpointError(f"{d.name}/{f.name} is not a readable safetensors file: {exc}") from None
            report.files.append(f.name)
        where = _locate(handles, index, d.name)
        if getattr(model, "mtp", None) is not None:        # the MTP layer's own head / embedding, if stored
            from ..engine.model.mtp_head import adopt_own_tensors
            adopt_own_tensors(model, where)
        table = name_table(model)
        plan = _check(where, handles, table, extra_from, d.name, report)
    _read(d, plan, where, table, report)
    report.seconds = time.perf_counter() - t0
    model.load_report = report
    log.info("loaded %s: %d tensors, %.2f GB in %.2f s (%.2f GB/s)%s", d.name, len(report.tensors_read),
             report.bytes_read / 1e9, report.seconds, report.gb_per_s,
             f"; experts {lo}..{hi - 1} of {model.cfg.num_experts}" if not model.holds_all_experts else "")
    return report


def _read(d: Path, plan: list, where: dict[str, str], table, report: LoadReport) -> None:
    """Pass 2: one file mapped at a time, this rank's tensors only, each written into its
    parameter(s); an e4m3 weight of a model-dtype projection with its ``weight_scale_inv`` (from
    whichever file holds it), dequantized."""
    from safetensors import safe_open
    lo, hi = table.model.expert_range
    dtype = table.model.cfg.torch_dtype
    by_file: dict[str, list] = {}
    for name, fname, target in plan:
        by_file.setdefault(fname, []).append((name, target))
    with ExitStack() as stack:
        scale_files: dict[str, Any] = {}          # the files scales are read from, opened once
        for fname, items in by_file.items():
            with safe_open(str(d / fname), framework="pt", device="cpu") as h:
                for name, target in items:
                    t = _get(h, name, target.expert_axis, lo, hi)
                    dev = table.params[target.param].device
                    if target.dequantizes(t.dtype):
                        sname = name + SCALE_SUFFIX
                        sf = where[sname]
                        if sf not in scale_files:
                            scale_files[sf] = stack.enter_context(safe_open(str(d / sf), framework="pt", device="cpu"))
                        s = _get(scale_files[sf], sname, target.expert_axis, lo, hi)
                        src = target.dequantized(t, s, dev, dtype)
                        report.tensors_read.append(sname)
                        report.bytes_read += s.numel() * s.element_size()
                    else:
                        src = _layout(t, target.transpose, dev)
                    for pname, index, v in target.writes(src, dev, dtype):
                        p = table.params[pname]
                        (p[index] if index else p).copy_(v)
                    report.tensors_read.append(name)
                    report.bytes_read += t.numel() * t.element_size()
                    del t, src


def _get(h: Any, name: str, expert_axis: bool, lo: int, hi: int) -> torch.Tensor:
    """Tensor ``name`` of an open file: the experts [lo, hi) of a packed one, else all of it."""
    return h.get_slice(name)[lo:hi] if expert_axis else h.get_tensor(name)


def _layout(t, transpose: bool, device) -> "torch.Tensor":
    """``t`` in its parameter region's layout. Transposes run where they are cheap: on the GPU
    after a contiguous host-to-device copy, on the host into a contiguous buffer first (a strided
    destination fed by a transposed source is about 2x slower on the CPU, measured)."""
    if not transpose:
        return t
    if device.type != "cpu":
        return t.to(device).transpose(-1, -2)
    return t.transpose(-1, -2).contiguous()


def _locate(handles: dict, index: dict[str, str] | None, dname: str) -> dict[str, str]:
    """name -> file holding it (the index's claim checked against the file headers)."""
    where: dict[str, str] = {}
    for fname, h in handles.items():
        for name in h.keys():
            if name in where:
                raise CheckpointError(f"{dname}: tensor {name!r} is stored twice ({where[name]} and {fname})")
            where[name] = fname
    if index is not None:
        for name, fname in index.items():
            if where.get(name) != fname:
                raise CheckpointError(f"{dname}/{INDEX} puts {name!r} in {fname}, but that file does not hold it")
    return where


def _check(where: dict[str, str], handles: dict, table, extra_from: int | None, dname: str,
           report: LoadReport) -> list:
    """Pass 1 (headers only): every name known, every shape and dtype right, every part of
    the model filled exactly once. Returns the (name, file, target) list this rank reads."""
    c = table.model.cfg
    plan, unexpected, covered = [], [], {}
    for name in sorted(where):
        target = table.hf.get(name)
        if target is None:
            if kv_scale_of(name, len(table.model.layers)) is not None:   # FP8 KV pool scales (an MTP layer's too)
                report.kv_scale_tensors[name] = where[name]
                continue
            m = _LAYER.match(name)
            if (m and extra_from is not None and int(m.group(1)) >= extra_from) or name.endswith("rotary_emb.inv_freq"):
                report.tensors_skipped.append(name)      # MTP layers not built (spec.method mtp: the first is)
                continue
            unexpected.append(name)
            continue
        sl = handles[where[name]].get_slice(name)
        dtype = _check_tensor(name, tuple(sl.get_shape()), sl.get_dtype(), target, where, table, dname)
        if target.pairs_scale:                            # read with its e4m3 weight, which it must have
            _check_paired_scale(name, where, handles, dname)
            continue
        if not target.mine:
            report.tensors_skipped.append(name)
            continue
        if target.param is None:                          # the tied lm_head: the embedding serves
            report.tensors_skipped.append(name)
            continue
        for u in target.units_for(dtype):
            if u in covered:
                raise CheckpointError(f"{dname}: tensor {name!r} fills a part of {target.param!r} that "
                                      f"{covered[u]!r} already fills")
            covered[u] = name
        plan.append((name, where[name], target))
    if unexpected:
        raise CheckpointError(f"{dname}: {len(unexpected)} tensor(s) a {c.architecture} model of {c.num_layers} "
                              f"layers has no place for, e.g. {', '.join(unexpected[:4])}")
    missing = table.required - covered.keys()
    if missing:
        raise CheckpointError(f"{dname}: the checkpoint lacks {table.describe_missing(missing)} "
                              f"({len(missing)} of {len(table.required)} parts of the model)")
    return plan


def _check_tensor(name: str, shape: tuple, dt: str, target, where: dict[str, str], table, dname: str) -> torch.dtype:
    """One tensor's header against its target: shape, dtype (float8 only into an FP8 projection,
    with its ``weight_scale_inv`` present), a block-scale grid of the right shape. Its dtype."""
    c = table.model.cfg
    if target.scale_of is not None:
        check_scale(f"{dname}: {name!r} in {where[name]}", target.scale_of, shape)
    if shape != target.shape:
        raise CheckpointError(f"{dname}: tensor {name!r} in {where[name]} has shape {shape}, but config.json "
                              f"({c.architecture}) implies {target.shape}")
    dtype = _DTYPES.get(dt)
    if dtype is None:
        raise CheckpointError(f"{dname}: tensor {name!r} has dtype {dt}; only floating and float8_e4m3fn (blockwise "
                              "FP8) checkpoints are supported")
    if target.scale_of is not None and dtype == FP8:
        raise CheckpointError(f"{dname}: block scales {name!r} are float8; expected float32")
    if dtype == FP8 and target.fp8 is None and not target.dequantizes(dtype):
        why = ("this engine keeps it in the model dtype" if c.quantization == "fp8"
               else "an FP8 checkpoint loads with model.quantization: fp8")
        raise CheckpointError(f"{dname}: tensor {name!r} is stored in float8_e4m3fn; {why}")
    if dtype == FP8 and name + SCALE_SUFFIX not in where:
        raise CheckpointError(f"{dname}: tensor {name!r} is stored in float8_e4m3fn but the checkpoint has no "
                              f"{name + SCALE_SUFFIX!r} (its block scales)")
    return dtype


def _check_paired_scale(name: str, where: dict[str, str], handles: dict, dname: str) -> None:
    """A ``weight_scale_inv`` of a projection the FP8 model keeps in the model dtype scales an e4m3
    weight (dequantized at load); beside a weight stored in a float dtype it would be ignored, so
    it is refused (the weight's absence is reported as missing)."""
    weight = name.removesuffix(SCALE_SUFFIX)
    if weight in where:
        dt = handles[where[weight]].get_slice(weight).get_dtype()
        if _DTYPES.get(dt) != FP8:
            raise CheckpointError(f"{dname}: {name!r} scales {weight!r}, which is stored in {dt}, not "
                                  "float8_e4m3fn (block scales belong to FP8 weights only)")
