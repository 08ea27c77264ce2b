"""The packaged worker configs (``ainfer_pd/configs/*.yaml``), found through
:mod:`importlib.resources`, so they are there in a wheel install as in a checkout.

``config_path("tiny-cpu")`` is the file of a packaged config, ``read_config_text`` its text,
``config_names()`` every name, and :func:`resolve_config` turns what a user passes as a config
(a path, or a packaged name such as ``tiny-cpu`` or ``configs/tiny-cpu.yaml``) into a file.
An unknown name raises :class:`UnknownConfigError`.
"""
from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path, PurePath

from .errors import ConfigError

PACKAGE = "ainfer_pd.configs"
SUFFIX = ".yaml"
#: The folder name under which the configs are addressed in a checkout (``configs/tiny-cpu.yaml``).
CHECKOUT_FOLDER = "configs"


class UnknownConfigError(ConfigError):
    """No packaged config has that name (and no file has that path)."""


def config_names() -> list[str]:
    """The names of the packaged configs (file names without ``.yaml``), sorted."""
    return sorted(r.name[: -len(SUFFIX)] for r in files(PACKAGE).iterdir() if r.name.endswith(SUFFIX))


def _packaged_name(name: str | os.PathLike) -> str | None:
    """``tiny-cpu`` of ``tiny-cpu``, ``tiny-cpu.yaml`` or ``configs/tiny-cpu.yaml``; None for
    anything else (an absolute path, another folder)."""
    p = PurePath(name)
    if p.is_absolute() or str(p.parent) not in (".", CHECKOUT_FOLDER) or not p.name:
        return None
    return p.name[: -len(SUFFIX)] if p.name.endswith(SUFFIX) else p.name


def config_path(name: str | os.PathLike) -> Path:
    """The file of the packaged config ``name`` (``tiny-cpu``, ``tiny-cpu.yaml`` or
    ``configs/tiny-cpu.yaml``); :class:`UnknownConfigError` when there is none."""
    stem = _packaged_name(name)
    res = files(PACKAGE) / f"{stem}{SUFFIX}" if stem else None
    if res is None or not res.is_file():
        raise UnknownConfigError(f"no packaged config {str(name)!r}; packaged: {', '.join(config_names())}")
    return Path(str(res))


def read_config_text(name: str | os.PathLike) -> str:
    """The YAML text of the packaged config ``name`` (see :func:`config_path`)."""
    return config_path(name).read_text()


def resolve_config(path: str | os.PathLike) -> Path:
    """The config file ``path`` names: the file itself when it exists, else the packaged config of
    that name (``tiny-cpu``, ``tiny-cpu.yaml``, ``configs/tiny-cpu.yaml`` from any directory);
    :class:`UnknownConfigError` when neither exists."""
    p = Path(path)
    if p.is_file():
        return p
    if _packaged_name(path) is not None:
        try:
            return config_path(path)
        except UnknownConfigError:
            pass
    raise UnknownConfigError(f"config file not found: {path} (no such file, and no packaged config of that name; "
                             f"packaged: {', '.join(config_names())})")
