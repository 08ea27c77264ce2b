"""Weights in and out: safetensors only (never pickle), checked in-place updates."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ConfigError, WeightUpdateError


def save_safetensors(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path))


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
        if not (t.dtype == p.dtype or (t.is_floating_point() and p.is_floating_point())):
            raise WeightUpdateError(f"weight {name!r} has dtype {t.dtype}, expected {p.dtype}")
        if not torch.isfinite(t).all():
            raise WeightUpdateError(f"weight {name!r} has non-finite values")
        if t.is_floating_point() and p.is_floating_point() and torch.finfo(p.dtype).max < torch.finfo(t.dtype).max:
            big = float(t.detach().abs().max()) if t.numel() else 0.0
            if big > torch.finfo(p.dtype).max:     # would become inf in the parameter's dtype
                raise WeightUpdateError(f"weight {name!r} has a value of magnitude {big:.3g}, beyond {p.dtype}")
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
