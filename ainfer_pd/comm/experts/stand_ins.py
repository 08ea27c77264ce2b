"""CPU stand-ins for a phase's CUDA stream and events, and D's double-buffer selector.

On a GPU host :func:`make_stream` / :func:`make_event` return the CUDA objects; on the CPU
they return named host objects, so the ownership audit sees one identity per phase either way.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

class HostStream:
    """CPU stand-in for a phase's CUDA stream (a named object: it owns an identity only)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"HostStream({self.name!r})"


class HostEvent:
    """CPU stand-in for a CUDA event: ``record()`` marks completion, ``synchronize()`` waits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ev = threading.Event()

    def reset(self) -> None:
        self._ev.clear()

    def record(self) -> None:
        self._ev.set()

    def query(self) -> bool:
        return self._ev.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._ev.wait(timeout)

    def __repr__(self) -> str:
        return f"HostEvent({self.name!r})"


class DoubleBufferIndex:
    """D's double-buffer selector (which of two buffer sets the next call uses)."""

    def __init__(self) -> None:
        self.value = 0

    def flip(self) -> int:
        cur = self.value
        self.value ^= 1
        return cur


def make_stream(device: torch.device, name: str) -> Any:
    if device.type == "cuda":  # pragma: no cover - GPU host only
        return torch.cuda.Stream(device=device)
    return HostStream(name)


def make_event(device: torch.device, name: str) -> Any:
    if device.type == "cuda":  # pragma: no cover - GPU host only
        return torch.cuda.Event()
    return HostEvent(name)
