"""A paired ratio's geometric mean and its 95% confidence interval (Student's t on the log ratios):
what a bench of a few noisy pairs can claim ("on / off 1.03, 95% CI 0.99-1.07": not resolved)."""
from __future__ import annotations

import math
import statistics

# two-sided 97.5% quantiles of Student's t by degrees of freedom (1 .. 30); past 30, the normal's
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive paired ratios; one ratio has no interval (nan)."""
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"ratios must be positive and non-empty, got {ratios}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    df = len(logs) - 1
    half = (_T975[df - 1] if df <= len(_T975) else 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def ratio_ci_text(ratios: list[float]) -> str:
    """``paired_geomean=G paired_ci95=LO-HI`` for a FIG line."""
    g, lo, hi = ratio_ci(ratios)
    return f"paired_geomean={g:.3f} paired_ci95={lo:.3f}-{hi:.3f}"
