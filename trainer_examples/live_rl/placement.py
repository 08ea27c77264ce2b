"""Where the live-RL example runs: device choice, the worker config, the trainer's dtypes and the
weights handed to the worker.

One device serves both sides: the worker (``device.device`` of its config) and the trainable copy.
The trainer keeps float32 master weights; its forward computes in ``compute_dtype`` (by default the
worker's dtype, so the trainer's logprobs are those of the weights the worker holds) and the sync
hands the worker tensors already in the worker's dtype and on its device.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from ainfer_pd import WorkerConfig
from ainfer_pd.errors import BackendUnavailableError, ConfigError

DEVICES = ("auto", "cpu", "cuda")
TRAIN_COMPUTE = ("worker", "float32")
MASTER_DTYPE = torch.float32


class LiveRLConfigError(ConfigError):
    """A live-RL option does not fit the worker config (bad --set, --device, KV sizing)."""


def resolve_device(requested: str | None, configured: str, *, cuda_available: bool | None = None) -> str:
    """``requested`` (the --device flag; None = take the config's ``device.device``) -> "cpu" | "cuda".

    ``auto`` is cuda when available. Raises BackendUnavailableError for cuda without CUDA."""
    want = configured if requested is None else requested
    if want not in DEVICES:
        raise LiveRLConfigError(f"device {want!r}: expected one of {DEVICES}")
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if want == "auto":
        return "cuda" if has_cuda else "cpu"
    if want == "cuda" and not has_cuda:
        raise BackendUnavailableError("--device cuda (or device.device: cuda in the config) but CUDA is not "
                                      "available on this host; use --device cpu with a CPU-sized config")
    return want


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """["model.dtype=bfloat16", "cache.num_blocks=4096"] -> {dotted key: YAML-typed value}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise LiveRLConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. model.dtype=bfloat16")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise LiveRLConfigError(f"--set {item!r}: value is not valid YAML ({exc})") from None
    return out


def worker_config(path: str | Path, policy: str, device: str | None, overrides: Mapping[str, Any]) -> WorkerConfig:
    """The worker config of one policy run: the YAML, then ``overrides``, then the policy and the
    resolved device (``device`` = the --device flag; None keeps the config's ``device.device``)."""
    cfg = WorkerConfig.from_yaml(path)
    if overrides:
        cfg = cfg.replace(**dict(overrides))
    dev = resolve_device(device, cfg.device.device)
    cfg = cfg.replace(**{"scheduler.policy": policy, "device.device": dev})
    return cfg


def compute_dtype(choice: str, worker_dtype: torch.dtype) -> torch.dtype:
    """The dtype the trainer's forward runs in: the worker's ("worker") or float32."""
    if choice not in TRAIN_COMPUTE:
        raise LiveRLConfigError(f"train compute dtype {choice!r}: expected one of {TRAIN_COMPUTE}")
    return worker_dtype if choice == "worker" else torch.float32


@torch.no_grad()
def worker_weights(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The trainer's parameters as (name, tensor) in the worker's dtype and on its device (detached;
    the worker copies them in place into its own parameters)."""
    return [(n, p.detach().to(device=device, dtype=dtype)) for n, p in model.named_parameters()]


def synchronize(device: torch.device) -> None:
    """Wait for every kernel on ``device`` (all streams): timings include the GPU work. No-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> dict[str, Any]:
    """What the JSON records about the device."""
    if device.type != "cuda":
        return {"type": "cpu", "torch_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "total_memory_gb": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda, "max_memory_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
