"""Tile plans of the blockwise-FP8 kernels (:mod:`.fp8_kernels`): pure functions of host-known
shapes, so a captured decode graph replays the plan it was captured with.

Tiles from the H200 sweep of ``benchmarks/fp8_kernel_check.py`` (Qwen3-30B-A3B shape, d957096):
decode (T = 1-128) best with 16 x 32 gate_up / 16 x 64 down tiles (0.030 / 0.118 / 0.169 / 0.180 ms
at T = 1 / 16 / 64 / 128, 1.38-1.45x the FP8 weight-bytes bound, 1.6-1.67x faster than bf16);
prefill (T = 2,048 / 8,192) best of the four tried with 64 x 128 tiles, 8 warps (0.52 / 1.60 ms,
against bf16's 0.49 / 1.33: the 128-row tiles with two float32 accumulators spill). Every ``block_k`` divides 128 (one activation / weight scale column per K step).
A gate_up plan with ``block_n == 128`` quantizes ``act`` in its epilogue (one 1 x 128 group per
program row); any other width writes float32 ``act`` and quantizes it in a separate launch.
"""
from __future__ import annotations

from ..fused_moe.plan import GemmPlan, MoEPlan
from .fp8 import BLOCK

# fused MoE: (rows per expert on average) -> plans
_MOE_SMALL = MoEPlan(GemmPlan(16, 32, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4))
_MOE_MEDIUM = MoEPlan(GemmPlan(64, 128, 128, 8, 8, 3), GemmPlan(64, 128, 128, 8, 4, 4))
_MOE_LARGE = _MOE_MEDIUM
# dense GEMM: (rows) -> plan
_GEMM_SMALL = GemmPlan(16, 32, 128, 1, 4, 4)
_GEMM_MEDIUM = GemmPlan(64, 128, 128, 8, 4, 3)
_GEMM_LARGE = GemmPlan(128, 128, 128, 8, 8, 3)


def fp8_moe_plan(num_pairs: int, num_experts: int) -> MoEPlan:
    """The fused MoE's plan for ``num_pairs`` (token, slot) rows over ``num_experts`` experts."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 8:
        return _MOE_SMALL
    if per_expert <= 64:
        return _MOE_MEDIUM
    return _MOE_LARGE


def fp8_gemm_plan(rows: int) -> GemmPlan:
    """The dense GEMM's plan for ``rows`` activation rows."""
    if rows <= 16:
        return _GEMM_SMALL
    if rows <= 256:
        return _GEMM_MEDIUM
    return _GEMM_LARGE


def fuses_act_quant(gate_up: GemmPlan) -> bool:
    """Whether a gate_up tile quantizes ``act`` itself (its columns are exactly one 1 x 128 group)."""
    return gate_up.block_n == BLOCK


def check_fp8_plan(g: GemmPlan) -> None:
    """A plan whose K step straddles two scale columns is a ValueError."""
    if g.block_k <= 0 or BLOCK % g.block_k or g.block_k < 32:
        raise ValueError(f"FP8 block_k must divide {BLOCK} (and be >= 32, the FP8 MMA's K), got {g.block_k}")
