"""Frozen configuration dataclasses, one per component; YAML in, validated once.

``WorkerConfig.from_yaml(path)`` is the only entry point most users need. Unknown
keys, wrong types and inconsistent values raise :class:`~ainfer_pd.errors.ConfigError`
naming the offending key. No flag silently changes another; derived values are
properties.

The sections live in :mod:`.config_model` (``ModelConfig``) and :mod:`.config_sections`
(cache, scheduler, mux, parallel, device) and :mod:`.config_spec` (speculative decoding); this
module holds the whole :class:`WorkerConfig`,
its cross-section checks and the YAML / dict loading, and re-exports every section.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .comm.ordering import ORDERINGS  # noqa: F401  (re-exported; its one home)
from .config_model import ARCHITECTURES, DTYPES, ROUTERS, ModelConfig  # noqa: F401
from .config_sections import (EXPERT_BACKENDS, KERNEL_BACKENDS, P_HOST_PACINGS, POLICIES,  # noqa: F401
                              SPANS, CacheConfig, DeviceConfig, MuxConfig, ParallelConfig,
                              SchedulerConfig)
from .config_spec import SPEC_METHODS, SpecConfig  # noqa: F401
from .errors import ConfigError, TopologyError, UnsupportedOptionError


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    mux: MuxConfig = field(default_factory=MuxConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    trace_dir: str | None = None
    """Directory for the per-rank JSONL control trace (None = no file)."""
    faults: dict = field(default_factory=dict)
    """Fault injection for tests (see ainfer_pd.faults); empty in production."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for sub in (self.model, self.cache, self.scheduler, self.mux, self.parallel, self.device, self.spec):
            sub.validate()
        if self.spec.enabled and self.scheduler.overlap_decode is True:
            raise UnsupportedOptionError("spec.method with scheduler.overlap_decode=true: a speculating D iteration "
                                         "needs the previous one's tokens on the host (its drafts continue them); "
                                         "use overlap_decode auto (overlapped while no row speculates) or false",
                                         key="spec.method")
        if self.spec.mtp and self.model.num_mtp_layers < 1:
            raise UnsupportedOptionError(f"spec.method=mtp needs a model with an MTP layer (glm4_moe with "
                                         f"num_nextn_predict_layers >= 1); this {self.model.architecture} model has "
                                         "model.num_mtp_layers=0", key="spec.method")
        if self.parallel.expert_parallel > 1 and self.model.num_experts % self.parallel.expert_parallel:
            raise TopologyError(f"model.num_experts={self.model.num_experts} is not divisible by "
                                f"expert_parallel={self.parallel.expert_parallel}")
        if self.parallel.atp > 1 and self.model.num_kv_heads % self.parallel.atp:
            raise TopologyError(f"model.num_kv_heads={self.model.num_kv_heads} is not divisible by ATP={self.parallel.atp}")
        if self.parallel.expert_backend == "local" and self.parallel.expert_parallel > 1:
            raise ConfigError("parallel.expert_backend=local cannot run expert_parallel > 1; use torch or deepep")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerConfig":
        return _build(cls, data, "")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "WorkerConfig":
        """The config of a Hugging Face model directory: the model section from its
        ``config.json`` (architecture, sizes, dtype), the rest defaults. ``overrides`` is nested
        like the YAML sections, e.g. ``{"model": {"dtype": "float32"}, "device": {"device": "cpu"}}``."""
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (overrides or {}).items()}
        model = data.setdefault("model", {})
        if not isinstance(model, dict):
            raise ConfigError("overrides['model'] must be a mapping")
        model["path"] = str(model_dir)
        return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "WorkerConfig":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path.name}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"malformed YAML in {path.name}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path.name}: top level must be a mapping")
        data.pop("name", None)
        data.pop("description", None)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **dotted: Any) -> "WorkerConfig":
        """A copy with dotted keys replaced, e.g. ``cfg.replace(**{"scheduler.policy": "normal"})``."""
        data = self.to_dict()
        for key, value in dotted.items():
            node = data
            parts = key.split(".")
            for p in parts[:-1]:
                if p not in node or not isinstance(node[p], dict):
                    raise ConfigError(f"unknown config key {key!r}")
                node = node[p]
            if parts[-1] not in node:
                raise ConfigError(f"unknown config key {key!r}")
            node[parts[-1]] = value
        return WorkerConfig.from_dict(data)


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}")
    if cls is ModelConfig and data.get("path") is not None:
        # model: {path: DIR, ...}: the fields come from DIR/config.json, keys given here override them
        from .hf.config import model_fields
        if not isinstance(data["path"], str):
            raise ConfigError(f"{prefix}path must be a string, got {data['path']!r}")
        data = {**model_fields(data["path"]), **data}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for member in inner[:-1]:          # the first member that takes the value (bool | str: true or "auto")
            try:
                return _coerce(member, value, key)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value
