"""Carrying an exception across a process boundary: a rank packs what it raised into a picklable
dict (:func:`pack_exception`), the parent re-creates it (:func:`unpack_exception`) with its
attributes and the remote traceback attached (:func:`ainfer_pd.launch.spawn`, the verl replica's
ranks)."""
from __future__ import annotations

import importlib
import pickle
import traceback
from typing import Any

from .errors import RankFailedError

__all__ = ["pack_exception", "unpack_exception"]


def pack_exception(exc: BaseException) -> dict:
    state = {}
    for k, v in getattr(exc, "__dict__", {}).items():
        try:
            pickle.dumps(v)
        except Exception:
            continue
        state[k] = v
    args = []
    for a in exc.args:
        try:
            pickle.dumps(a)
            args.append(a)
        except Exception:
            args.append(repr(a))
    return {"module": type(exc).__module__, "qualname": type(exc).__qualname__, "args": tuple(args),
            "state": state, "repr": f"{type(exc).__name__}: {exc}",
            "tb": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def unpack_exception(rank: int, packed: dict) -> BaseException:
    exc: BaseException
    try:
        obj: Any = importlib.import_module(packed["module"])
        for part in packed["qualname"].split("."):
            obj = getattr(obj, part)
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise TypeError
        exc = obj.__new__(obj)
        exc.args = tuple(packed["args"])
        exc.__dict__.update(packed["state"])
    except Exception:
        exc = RankFailedError(f"rank {rank} raised {packed['repr']}")
    exc.remote_traceback = packed["tb"]  # type: ignore[attr-defined]
    exc.rank = rank  # type: ignore[attr-defined]
    try:
        exc.add_note(f"(raised in rank {rank}; remote traceback:)\n{packed['tb']}")
    except Exception:  # pragma: no cover
        pass
    return exc
