"""The verify cost table of several ranks (issue 38), agreed (pure).

Every rank measures the same grid at start (:func:`~ainfer_pd.engine.runtime.verify_costs.measure_verify_costs`:
the grid is a function of the config only, the passes padded as a real iteration), but each rank
times its own side of the lockstep passes. A D iteration of several ranks ends when its slowest
rank does, so the table that describes it is the world's: each entry the most any rank measured
(:func:`world_times`), the same on every replica leader, which then chooses K from one table.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import SpecInputError

__all__ = ["world_times"]


def world_times(tables: Sequence[Mapping[int, Mapping[int, float]]]) -> dict[int, dict[int, float]]:
    """``{B: {w: s}}``, each entry the most any rank measured (``tables`` in rank order). Every
    rank must have measured the same grid (batch sizes and widths): a rank whose grid differs is
    named (its config differs, or it measured other passes, whose collectives did not pair up)."""
    if not tables:
        raise SpecInputError("no rank's verify cost table to agree")
    grid = {B: sorted(row) for B, row in tables[0].items()}
    for r, t in enumerate(tables):
        mine = {B: sorted(row) for B, row in t.items()}
        if mine != grid:
            raise SpecInputError(f"rank {r} measured the verify cost grid {mine}, rank 0 {grid}: every rank "
                                 f"must run the same passes")
    return {B: {w: max(float(t[B][w]) for t in tables) for w in ws} for B, ws in grid.items()}
