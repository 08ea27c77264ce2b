"""What the verl server is configured by: ``rollout.engine_kwargs.ainfer_pd``, the ainfer-pd YAML,
verl's model directory and the rollout config's own fields (``gpu_memory_utilization``).

Pure functions of their inputs (no worker, no Ray); the server and the replica both call
:func:`build_worker_config`, so they agree on the config a replica runs.
"""
from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Optional

from ...errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)

#: Keys of ``rollout.engine_kwargs.ainfer_pd`` (everything else is rejected).
ENGINE_KWARGS = {
    "config": "path of an ainfer-pd WorkerConfig YAML (default: the packaged configs/tiny-cpu.yaml); its model "
              "section is replaced by actor_rollout_ref.model.path when that is a Hugging Face directory",
    "overrides": "dotted WorkerConfig overrides, e.g. {'scheduler.policy': 'fine-grained'}",
    "worker_cls": "import path of the worker class (default ainfer_pd.RolloutWorker)",
    "max_retained_trajectories": "idle trajectories kept for KV reuse (LRU), default 4096",
    "cast_weight_dtype": "cast incoming floating weights to the model's dtype (default true)",
    "http": "also serve a token-in/token-out HTTP endpoint (default false)",
    "host": "HTTP bind address (default 127.0.0.1)",
    "sleep_level": "override the sleep level verl's mode implies (hybrid 2, colocated 1): 0, 1 or 2",
    "sleep_keep_weights": "at sleep level 2 keep the weights in pinned host memory (default false: dropped, "
                          "as vLLM's level 2; verl's hybrid sync refills them after wake_up(['weights']))",
    "rank_timeout_s": "seconds a multi-rank replica waits for its ranks to start / answer (default 300)",
    "profile_dir": "torch.profiler trace directory of start_profile / stop_profile (default: rollout.profiler."
                   "save_path when the profiler tool is torch, else $TMPDIR/ainfer_pd_profile)",
    "metrics_port": "serve Prometheus text at http://host:PORT/metrics (0 = a free port; default: off, "
                    "unless rollout.prometheus.enable)",
}


def to_plain(obj: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def field(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` of verl's rollout config (a DictConfig, a dataclass or a plain dict)."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def engine_kwargs_of(rollout_config: Any) -> dict:
    """``rollout.engine_kwargs.ainfer_pd`` as a plain dict, unknown keys rejected."""
    ek = to_plain(field(rollout_config, "engine_kwargs")) or {}
    mine = dict(ek.get("ainfer_pd") or {})
    unknown = sorted(set(mine) - set(ENGINE_KWARGS))
    if unknown:
        raise ConfigError(f"unknown rollout.engine_kwargs.ainfer_pd key(s) {unknown}; known: {sorted(ENGINE_KWARGS)}")
    return mine


def default_config_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "configs", "tiny-cpu.yaml"))


def model_path_of(model_config: Any) -> Optional[str]:
    """The Hugging Face directory of verl's ``actor_rollout_ref.model`` (``HFModelConfig``:
    ``local_path``, the local copy verl made, else ``path``); None when there is none (no
    model section, or a path that is not a local directory with ``config.json``)."""
    mc = to_plain(model_config)
    for key in ("local_path", "path"):
        p = field(mc, key)
        if isinstance(p, str) and p and os.path.isfile(os.path.join(os.path.expanduser(p), "config.json")):
            return os.path.expanduser(p)
    return None


def memory_overrides(rollout_config: Any, device: str, overrides: dict) -> dict:
    """verl's ``rollout.gpu_memory_utilization`` as ``cache.gpu_memory_utilization``; on CUDA the
    pool is then sized from it (``cache.num_blocks: 0``). Explicit ``overrides`` of either key win."""
    util = field(rollout_config, "gpu_memory_utilization")
    if util is None or "cache.gpu_memory_utilization" in overrides:
        return {}
    util = float(util)
    if not 0.0 <= util <= 1.0:
        raise ConfigError(f"rollout.gpu_memory_utilization must be in [0, 1], got {util}")
    out = {"cache.gpu_memory_utilization": util}
    if device == "cuda" and "cache.num_blocks" not in overrides and util > 0:
        out["cache.num_blocks"] = 0
    return out


def build_worker_config(engine_kwargs: dict, model_path: Optional[str] = None, rollout_config: Any = None):
    """The worker config: the ainfer-pd YAML; with ``model_path`` (verl's model directory) the
    model section is that directory's ``config.json`` (architecture, shapes, dtype, weights);
    verl's memory share (:func:`memory_overrides`); then the dotted ``overrides`` (e.g.
    ``{"model.dtype": "float32"}``)."""
    from ...config import WorkerConfig
    path = engine_kwargs.get("config") or default_config_path()
    if not os.path.isabs(path) and not os.path.exists(path):
        # Ray actors may not share the driver's cwd: also try the ainfer-pd checkout root.
        alt = os.path.join(os.path.dirname(os.path.dirname(default_config_path())), path)
        path = alt if os.path.exists(alt) else path
    cfg = WorkerConfig.from_yaml(path)
    if model_path:
        data = cfg.to_dict()
        data["model"] = {"path": model_path}
        cfg = WorkerConfig.from_dict(data)
    overrides = dict(engine_kwargs.get("overrides") or {})
    mem = memory_overrides(rollout_config, cfg.device.device, overrides) if rollout_config is not None else {}
    if mem:
        logger.info("ainfer_pd: verl's memory share -> %s", mem)
    merged = {**mem, **overrides}
    return cfg.replace(**merged) if merged else cfg


def import_worker_class(path: str):
    """``engine_kwargs.ainfer_pd.worker_cls`` ("pkg.mod.Class" or "pkg.mod:Class")."""
    mod, _, name = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"cannot import worker class {path!r}: {exc}") from None
