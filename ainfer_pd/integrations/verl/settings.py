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

from ...config_files import config_path, resolve_config
from ...errors import BackendUnavailableError, ConfigError, UnsupportedOptionError

logger = logging.getLogger(__name__)

#: The packaged config a replica runs unless ``engine_kwargs.ainfer_pd.config`` names another.
DEFAULT_CONFIG = "tiny-cpu"

#: Keys of ``rollout.engine_kwargs.ainfer_pd`` (everything else is rejected).
ENGINE_KWARGS = {
    "config": "path of an ainfer-pd WorkerConfig YAML, or a packaged config's name (e.g. tiny-2rank-cpu; default: "
              "the packaged tiny-cpu); its model "
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
    """The packaged ``tiny-cpu`` config (:mod:`ainfer_pd.config_files`)."""
    return str(config_path(DEFAULT_CONFIG))


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


#: verl ``rollout.*`` keys and what each one means here (:func:`rollout_overrides`, :func:`rollout_notes`).
ROLLOUT_KEYS = {
    "max_model_len": "model.max_context_len (vLLM's max model length: a longer prompt is refused, generation "
                     "stops at the limit); above the model's own limit: UnsupportedOptionError",
    "dtype": "model.dtype (the rollout model's dtype; 'auto': the checkpoint's)",
    "seed": "not used: an unseeded request draws from a seed of its trajectory; sampling_params['seed'] seeds a "
            "request (one warning)",
    "max_num_seqs": "caps scheduler.max_decode_batch (sequences decoded together; one warning when the ainfer-pd "
                    "config's cap is lower)",
    "max_num_batched_tokens": "caps scheduler.max_prefill_tokens (prompt tokens prefilled per step; one warning "
                              "when the config's cap is lower)",
    "enable_prefix_caching": "cache.prefix_sharing",
    "enforce_eager": "true: device.cuda_graphs false (decode without CUDA graphs)",
    "cudagraph_capture_sizes": "device.graph_batch_sizes",
    "quantization": "fp8: model.quantization fp8 (blockwise FP8 weights, quantized at load and at every weight "
                    "sync; the returned logprobs are the FP8 model's own); any other value refused "
                    "(UnsupportedOptionError)",
    "mtp": "mtp.enable_rollout: spec.method mtp (the checkpoint's MTP layer drafts, verified exactly in the D "
           "iteration; glm4_moe with num_nextn_predict_layers), spec.num_draft_tokens = num_speculative_tokens "
           "(vLLM's meaning); method other than mtp, or speculative_eagle_topk > 1 (a draft tree) refused "
           "(UnsupportedOptionError). The trainer's weight syncs must carry the MTP layer (a set without it is "
           "refused: no stale head)",
    "load_format": "auto / safetensors / hf: the checkpoint is read; dummy: read anyway, verl's first sync "
                   "replaces it (one warning); other formats refused",
    "enable_sleep_mode": "false: sleep() keeps weights and KV on the device (one warning)",
    "profiler": "tool torch: save_path is the start_profile directory; another tool: one warning",
    "expert_parallel_size": "> 1: parallel.expert_parallel",
}

_LOAD_FORMATS = {"auto", "safetensors", "hf", "dummy"}


def _sub(config: Any, key: str, sub: str, default: Any = None) -> Any:
    return field(to_plain(field(config, key)), sub, default)


def rollout_overrides(rollout_config: Any, cfg: Any, overrides: dict) -> dict:
    """The worker-config keys verl's ``rollout.*`` fields set (:data:`ROLLOUT_KEYS`); explicit
    ``overrides`` of the same worker keys win. Raises :class:`UnsupportedOptionError` naming a
    rollout key this engine cannot honour."""
    out: dict = {}

    def put(key: str, value: Any) -> None:
        if key not in overrides:
            out[key] = value

    if field(rollout_config, "quantization"):
        put("model.quantization", _quantization(field(rollout_config, "quantization")))
    if _sub(rollout_config, "mtp", "enable_rollout", False):
        for k, v in _mtp(rollout_config).items():
            put(k, v)
    fmt = field(rollout_config, "load_format")
    if fmt is not None and str(fmt) not in _LOAD_FORMATS:
        raise UnsupportedOptionError(f"rollout.load_format={fmt!r}: ainfer-pd reads Hugging Face safetensors "
                                     f"({sorted(_LOAD_FORMATS)})", key="load_format")
    mml = field(rollout_config, "max_model_len")
    if mml is not None:
        mml = int(mml)
        limit = int(cfg.model.max_context_len)
        if mml > limit and "model.max_context_len" not in overrides:
            raise UnsupportedOptionError(f"rollout.max_model_len={mml} exceeds the model's context limit {limit}",
                                         key="max_model_len")
        put("model.max_context_len", mml)
    dtype = field(rollout_config, "dtype")
    if dtype is not None and str(dtype) != "auto":
        put("model.dtype", str(dtype).replace("torch.", ""))
    mns = field(rollout_config, "max_num_seqs")
    if mns is not None and int(mns) < cfg.scheduler.max_decode_batch:
        put("scheduler.max_decode_batch", int(mns))
    mbt = field(rollout_config, "max_num_batched_tokens")
    if mbt is not None and int(mbt) < cfg.scheduler.max_prefill_tokens:
        put("scheduler.max_prefill_tokens", int(mbt))
    epc = field(rollout_config, "enable_prefix_caching")
    if epc is not None:
        put("cache.prefix_sharing", bool(epc))
    if field(rollout_config, "enforce_eager", False):
        put("device.cuda_graphs", False)
    sizes = field(rollout_config, "cudagraph_capture_sizes")
    if sizes:
        put("device.graph_batch_sizes", tuple(sorted(int(x) for x in sizes)))
    eps = field(rollout_config, "expert_parallel_size")
    if eps is not None and int(eps) > 1:
        put("parallel.expert_parallel", int(eps))
    return out


def _mtp(rollout_config: Any) -> dict:
    """The ``spec`` keys of verl's ``rollout.mtp`` with ``enable_rollout`` (:data:`ROLLOUT_KEYS`)."""
    method = str(_sub(rollout_config, "mtp", "method", "mtp"))
    if method != "mtp":
        raise UnsupportedOptionError(f"rollout.mtp.method={method!r}: ainfer-pd drafts with the checkpoint's MTP "
                                     "layer only (method mtp)", key="mtp")
    topk = int(_sub(rollout_config, "mtp", "speculative_eagle_topk", 1) or 1)
    if topk != 1:
        raise UnsupportedOptionError(f"rollout.mtp.speculative_eagle_topk={topk}: ainfer-pd drafts one greedy chain "
                                     "per row (top-k 1), not a tree", key="mtp")
    k = int(_sub(rollout_config, "mtp", "num_speculative_tokens", 1) or 1)
    return {"spec.method": "mtp", "spec.num_draft_tokens": k}


def _quantization(quant: Any) -> str:
    """``model.quantization`` of verl's ``rollout.quantization``: fp8; anything else refused by name."""
    if str(quant).lower() != "fp8":
        raise UnsupportedOptionError(f"rollout.quantization={quant!r}: ainfer-pd serves the model dtype or fp8 "
                                     "(blockwise, 128 x 128 weight blocks) only", key="quantization")
    return "fp8"


def rollout_notes(rollout_config: Any, cfg: Any) -> list[str]:
    """One line per verl ``rollout.*`` key whose value this engine does not apply as asked (the
    server logs each once as a warning)."""
    notes = []
    seed = field(rollout_config, "seed")
    if seed is not None:
        notes.append(f"rollout.seed={seed} is not used: an unseeded request draws from a seed of its trajectory "
                     "(sampling_params['seed'] seeds a request)")
    mns = field(rollout_config, "max_num_seqs")
    if mns is not None and int(mns) > cfg.scheduler.max_decode_batch:
        notes.append(f"rollout.max_num_seqs={mns}: at most scheduler.max_decode_batch="
                     f"{cfg.scheduler.max_decode_batch} sequences decode together (the ainfer-pd config's cap)")
    mbt = field(rollout_config, "max_num_batched_tokens")
    if mbt is not None and int(mbt) > cfg.scheduler.max_prefill_tokens:
        notes.append(f"rollout.max_num_batched_tokens={mbt}: at most scheduler.max_prefill_tokens="
                     f"{cfg.scheduler.max_prefill_tokens} prompt tokens are prefilled per step (the ainfer-pd config's cap)")
    if str(field(rollout_config, "load_format", "")) == "dummy":
        notes.append("rollout.load_format=dummy: the checkpoint's weights are read anyway (verl's first weight sync "
                     "replaces them)")
    if field(rollout_config, "enable_sleep_mode", True) is False:
        notes.append("rollout.enable_sleep_mode=False: sleep() keeps weights and KV on the device")
    if field(rollout_config, "quantization_config_file") is not None:
        notes.append("rollout.quantization_config_file is not read: rollout.quantization fp8 quantizes the routed "
                     "experts blockwise (with model.fp8_dense every attention and MLP projection; router, embedding "
                     "and head stay in the model dtype)")
    tool = _sub(rollout_config, "profiler", "tool")
    if tool not in (None, "torch"):
        notes.append(f"rollout.profiler.tool={tool!r}: start_profile writes torch.profiler traces")
    return notes


def build_worker_config(engine_kwargs: dict, model_path: Optional[str] = None, rollout_config: Any = None):
    """The worker config: the ainfer-pd YAML; with ``model_path`` (verl's model directory) the
    model section is that directory's ``config.json`` (architecture, shapes, dtype, weights);
    verl's memory share (:func:`memory_overrides`) and ``rollout.*`` keys (:func:`rollout_overrides`);
    then the dotted ``overrides`` (e.g. ``{"model.dtype": "float32"}``)."""
    from ...config import WorkerConfig
    # a path, or a packaged config's name ("tiny-2rank-cpu", "configs/tiny-2rank-cpu.yaml"): Ray
    # actors may not share the driver's cwd, and a wheel install has no checkout
    cfg = WorkerConfig.from_yaml(resolve_config(engine_kwargs.get("config") or DEFAULT_CONFIG))
    if model_path:
        data = cfg.to_dict()
        data["model"] = {"path": model_path}
        cfg = WorkerConfig.from_dict(data)
    overrides = dict(engine_kwargs.get("overrides") or {})
    mem = memory_overrides(rollout_config, cfg.device.device, overrides) if rollout_config is not None else {}
    if mem:
        logger.info("ainfer_pd: verl's memory share -> %s", mem)
    keys = rollout_overrides(rollout_config, cfg, overrides) if rollout_config is not None else {}
    merged = {**mem, **keys, **overrides}
    return cfg.replace(**merged) if merged else cfg


def import_worker_class(path: str):
    """``engine_kwargs.ainfer_pd.worker_cls`` ("pkg.mod.Class" or "pkg.mod:Class")."""
    mod, _, name = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailableError(f"cannot import worker class {path!r}: {exc}") from None
