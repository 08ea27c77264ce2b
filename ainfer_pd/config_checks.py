"""The field checks the config sections' ``validate()`` share."""
from __future__ import annotations

from typing import Any

from .errors import ConfigError


def check_positive(obj: Any, *names: str) -> None:
    """Each named field of the section ``obj`` is a positive integer (not a bool)."""
    section = type(obj).__name__.removesuffix("Config").lower()
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{section}.{n} must be a positive integer, got {v!r}")
