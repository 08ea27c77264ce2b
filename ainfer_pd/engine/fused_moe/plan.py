"""Tile plans of the fused MoE kernels: pure functions of host-known shapes.

A plan depends only on the number of (token, slot) rows and the dtype, so a decode graph
bucket replays the plan it was captured with.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GemmPlan:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class MoEPlan:
    gate_up: GemmPlan
    down: GemmPlan
    direct: bool = False
    """Each (token, slot) pair is a row block of its own, its expert read from the routing: no
    layout launches (``moe_align_kernel``, ``moe_scatter_kernel``), one MMA row of ``block_m`` used.
    For a token decoding alone (the rollout's tail chain, where a layer is launch latency, not
    bytes): its k pairs have k distinct experts, so every weight tile is still read once; with
    more tokens an expert two pairs share is read twice. ``group_m`` must be 1."""

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


# (rows per expert on average) -> plans; tuned on the H200 (docs/RESULTS.md, GPU data path: kernel tiles)
_SMALL = MoEPlan(GemmPlan(16, 64, 256, 1, 4, 3), GemmPlan(16, 128, 128, 1, 4, 3))
_MEDIUM = MoEPlan(GemmPlan(64, 64, 64, 8, 4, 3), GemmPlan(64, 128, 64, 8, 4, 3))
_LARGE = MoEPlan(GemmPlan(128, 128, 32, 8, 8, 4), GemmPlan(128, 128, 32, 16, 8, 4))
_FP32 = MoEPlan(GemmPlan(16, 32, 32, 1, 4, 1), GemmPlan(16, 32, 32, 1, 4, 1))
_ALONE = MoEPlan(_SMALL.gate_up, _SMALL.down, direct=True)


def by_rows_per_expert(num_pairs: int, num_experts: int, small, medium, large):
    """A plan table's tier by (token, slot) rows per expert: up to 8 ``small`` (decode), up to 64
    ``medium``, else ``large`` (prefill)."""
    per_expert = num_pairs / max(1, num_experts)
    return small if per_expert <= 8 else medium if per_expert <= 64 else large


def moe_plan(num_pairs: int, num_experts: int, fp32: bool, tokens: int | None = None) -> MoEPlan:
    """Small row blocks when experts get a few rows each (decode), large ones for prefill; a token
    decoding alone (``tokens`` 1) takes the small tiles without the layout launches
    (:attr:`MoEPlan.direct`: the same grid, the same tiles and bits, two launches fewer)."""
    if fp32:
        return _FP32
    if tokens == 1:
        return _ALONE
    return by_rows_per_expert(num_pairs, num_experts, _SMALL, _MEDIUM, _LARGE)
