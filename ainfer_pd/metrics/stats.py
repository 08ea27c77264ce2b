"""Small statistics the engine itself keeps (a percentile, the work seconds of a stream); the
run summaries and tables built from them are in the tools layer's report."""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

NAN = float("nan")


def percentile(values: Iterable[float], q: float) -> float:
    """``q``-th percentile (0..100, linear interpolation) of the finite values; NaN when none."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    return float(np.percentile(a, q)) if a.size else NAN


SETUP_ITEMS = frozenset({"D.capture", "P.capture", "P.warmup", "D.verify_costs", "D.draft_costs"})
"""Stream items that set an engine up before its first turn (each phase's graph capture, the prefill
warm-up, :class:`~ainfer_pd.engine.engine.Engine` on CUDA; speculation's cost tables measured at
start, :func:`~ainfer_pd.spec.make.make_speculator`): time on the P / D streams, but no work of
the workload, so not in the bound's P and D terms."""


def work_s(intervals: Iterable[Sequence[Any]], stream: str) -> float:
    """Seconds of the workload's work on ``stream`` ("P" or "D") in ``(name, stream, start, end,
    ...)`` intervals: every item but :data:`SETUP_ITEMS` (the bound's P and D terms)."""
    return sum(float(iv[3]) - float(iv[2]) for iv in intervals
               if str(iv[1]) == stream and str(iv[0]) not in SETUP_ITEMS)
