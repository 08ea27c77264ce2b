"""Tile plans of the blockwise-FP8 kernels (:mod:`.fp8_kernels`): pure functions of host-known
shapes, so a captured decode graph replays the plan it was captured with.

Tiles from the H200 sweep of ``benchmarks/fp8_kernel_check.py`` (Qwen3-30B-A3B shape, d957096):
decode (T = 1-128) best with 16 x 32 gate_up / 16 x 64 down tiles (0.030 / 0.118 / 0.169 / 0.180 ms
at T = 1 / 16 / 64 / 128, 1.38-1.45x the FP8 weight-bytes bound, 1.6-1.67x faster than bf16, with
x and act quantized by launches of their own); prefill (T = 2,048 / 8,192) best of the four tried
with 64 x 128 tiles, 8 warps (0.52 / 1.60 ms, against bf16's 0.49 / 1.33: the 128-row tiles with
two float32 accumulators spill). Every ``block_k`` divides 128 (one activation / weight scale
column per K step).

Decode now swaps the operands (``swap_ab``, 16 x 64 tiles for both GEMMs): the 16 x 32 / 16 x 64
tiles above compiled for sm_90 to ``mma.sync ... f16.f16`` (Triton's mma v2 has no e4m3 on
Hopper), every weight byte widened to float16 first (``cvt.rn.f16x2.e4m3x2``; the bf16 kernels,
which need no widening, run at ~1.2x their bytes), while the transposed product puts the weight
tile on wgmma's M side: ``wgmma ... e4m3.e4m3``, no widening, 64 / 56 registers, no spills
(``benchmarks/kernel_ptx_report.py``). On the H200: 0.0297 / 0.114 / 0.1655 / 0.1764 ms at T = 1
/ 16 / 64 / 128, 1.41 / 1.35 / 1.40x the bytes at T 16-128, against 0.030 / 0.118 / 0.169 / 0.180
for the 16 x 32 / 16 x 64 tiles of the kernels before (a 16 x 128 down with 3 stages measured
1-1.5% faster at T 16-128 and 6% slower at T 1). Prefill keeps 64 x 128 tiles: compiled as the
runtime specializes them (16-byte aligned pointers, strides divisible by 16, which is what
pipelines the loads into cp.async copies) they spill nothing, gate_up with 8 warps and down with
4; with one weight scale per tile they ran 0.461 / 1.386 ms at T 2,048 / 8,192 (were 0.514 /
1.591); 128 x 128 tiles, which no longer spill (3.75 ms before), 0.512 / 1.390.

Where activations are quantized (:class:`Fp8MoEPlan`'s flags; the results are the same bytes
either way, only launches and traffic differ):

* ``quant_x_on_load``: gate_up reads x's float rows and quantizes each 128-column K step in
  registers (no x-quantization launch, no x_q buffer; each row is re-quantized by each of its k
  pairs and each N tile: cheap at decode sizes). Needs gate_up ``block_k == 128``. Off: one
  launch quantizes x first.
* ``quant_act_on_load``: gate_up writes float32 act and down quantizes each 128-column group as it
  loads it (needs down ``block_k == 128``). Off: a gate_up of ``block_n == 128`` quantizes act in
  its epilogue, any other writes float32 act and a separate launch quantizes it. act stays
  float32 (the oracle quantizes float32 act): stored in bf16 every group's amax moves, ~2% of the
  e4m3 bytes change and the output lands ~1e-2 (relative) from the oracle, while the float32
  act's traffic (N x I x 4 bytes written and read) is ~0.5% of a decode layer's weight bytes.
* ``fold_sum``: down sums each token's k rows itself (the last of its programs to finish for a
  token's column tile adds the k rows, float32, in slot order; gate_up zeroes the per-token
  counters; no sum launch, no atomic on a value, so a token's output depends neither on its
  batch nor on run order). Off: a torch sum of rows in x's dtype. Needs Triton >= 3.5.

The decode plan quantizes both on load (5 launches a call, was 7: the layout's 2, gate_up, down,
the sum); ``fold_sum`` and the prefill on-load paths are plan options until the H200 sweep
(``fp8_kernel_check.py``'s ``sweep_*`` figures) has timed them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import ConfigError
from ..fused_moe.plan import GemmPlan, MoEPlan, by_rows_per_expert
from .fp8 import BLOCK

_WGMMA_M = 64
"""Rows of one Hopper wgmma's M side (one warp group)."""


@dataclass(frozen=True, slots=True)
class Fp8MoEPlan:
    """The FP8 fused MoE's tiles and where it quantizes (see the module docstring)."""
    gate_up: GemmPlan
    down: GemmPlan
    quant_x_on_load: bool = True
    quant_act_on_load: bool = True
    fold_sum: bool = False
    swap_ab: bool = False
    """Both GEMMs compute their products transposed (``dot(W tile, X tile^T)``): the weight's
    block_n rows are the MMA's M side and the block_m token rows its N side, which lets Hopper
    run a decode-sized row block on its e4m3 wgmma (a 16-row A operand takes mma.sync, which
    has no e4m3 on sm_90: the weights were widened to float16). block_n is then the MMA's M
    (64 or 128 with 4 warps) and block_m >= 16 (tl.dot's least)."""

    direct: bool = False
    """Each pair its own row block, no layout launches (:attr:`..fused_moe.plan.MoEPlan.direct`):
    a token decoding alone."""

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


# fused MoE: (rows per expert on average) -> plans
# On the H200 (e244292) quantizing on load ran 2.9-3.6x SLOWER than the separate launches at every
# decode size (T 64: 0.577 against 0.169 ms; the register-quantized e4m3 tile goes through a layout
# conversion before the MMA), and 4-5x at prefill: every table entry launches separately.
_MOE_SMALL = Fp8MoEPlan(GemmPlan(16, 64, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4),
                        quant_x_on_load=False, quant_act_on_load=False, swap_ab=True)
_MOE_MEDIUM = Fp8MoEPlan(GemmPlan(64, 128, 128, 8, 8, 3), GemmPlan(64, 128, 128, 8, 4, 4),
                         quant_x_on_load=False, quant_act_on_load=False)
# prefill: gate_up 64 columns a program with 4 warps (3 CTAs an SM by registers and shared memory, against
# one for the 64 x 128 x 8-warp tile, whose K steps leave the tensor cores idle through each wgmma wait and its
# scaling FMAs), act quantized by a launch of its own (a program holds half a 128-column group). H100, f197768,
# `fp8_kernel_check.py --tiles`: T 2,048 0.438 against 0.485 ms, T 8,192 1.340 against 1.416 ms (-10% / -5%)
_MOE_LARGE = Fp8MoEPlan(GemmPlan(64, 64, 128, 8, 4, 3), GemmPlan(64, 128, 128, 8, 4, 4),
                        quant_x_on_load=False, quant_act_on_load=False)
# the same gate_up with 4 stages up to 128 rows an expert (2,048 tokens of the Qwen3 shape): H100, f20a8d9,
# `fp8_kernel_check.py --tiles`: T 2,048 0.4280 against 0.4438 ms; at T 8,192 1.3560 against 1.3254 (slower)
_MOE_LARGE_S4 = dataclasses.replace(_MOE_LARGE, gate_up=dataclasses.replace(_MOE_LARGE.gate_up, num_stages=4))
_S4_MAX_ROWS_PER_EXPERT = 128
_MOE_ALONE = Fp8MoEPlan(_MOE_SMALL.gate_up, _MOE_SMALL.down, quant_x_on_load=False, quant_act_on_load=False,
                        swap_ab=True, direct=True)
# dense GEMM: (rows) -> plan
_GEMM_SMALL = GemmPlan(16, 32, 128, 1, 4, 4)
_GEMM_MEDIUM = GemmPlan(64, 128, 128, 8, 4, 3)
_GEMM_LARGE = GemmPlan(128, 128, 128, 8, 8, 3)


def fp8_moe_plan(num_pairs: int, num_experts: int, tokens: int | None = None) -> Fp8MoEPlan:
    """The fused MoE's plan for ``num_pairs`` (token, slot) rows over ``num_experts`` experts; a
    token decoding alone (``tokens`` 1) takes the decode tiles without the layout launches."""
    if tokens == 1:
        return _MOE_ALONE
    large = _MOE_LARGE_S4 if num_pairs <= _S4_MAX_ROWS_PER_EXPERT * max(1, num_experts) else _MOE_LARGE
    return by_rows_per_expert(num_pairs, num_experts, _MOE_SMALL, _MOE_MEDIUM, large)


def as_fp8_moe_plan(plan: MoEPlan | Fp8MoEPlan) -> Fp8MoEPlan:
    """A plain :class:`MoEPlan` (tiles only) is the separate-launch path: x and act quantized by
    launches of their own (act in gate_up's epilogue when its block_n is 128), a torch sum."""
    if isinstance(plan, Fp8MoEPlan):
        return plan
    return Fp8MoEPlan(plan.gate_up, plan.down, quant_x_on_load=False, quant_act_on_load=False, direct=plan.direct)


def fp8_gemm_plan(rows: int) -> GemmPlan:
    """The dense GEMM's plan for ``rows`` activation rows."""
    if rows <= 16:
        return _GEMM_SMALL
    if rows <= 256:
        return _GEMM_MEDIUM
    return _GEMM_LARGE


def fuses_act_quant(plan: Fp8MoEPlan) -> bool:
    """Whether gate_up quantizes ``act`` in its epilogue (act not quantized on load by down, and
    gate_up's columns exactly one 1 x 128 group)."""
    return not plan.quant_act_on_load and plan.gate_up.block_n == BLOCK


def check_fp8_plan(g: GemmPlan, on_load: bool = False) -> None:
    """A plan whose K step straddles two scale columns is a ValueError, so is one whose column tile
    straddles two weight scale rows (the kernels load one weight scale per tile and K step); so is
    a plan quantizing on load (``on_load``) whose K step is not exactly one 128-column group."""
    if g.block_k <= 0 or BLOCK % g.block_k or g.block_k < 32:
        raise ValueError(f"FP8 block_k must divide {BLOCK} (and be >= 32, the FP8 MMA's K), got {g.block_k}")
    if g.block_n <= 0 or BLOCK % g.block_n:
        raise ConfigError(f"FP8 block_n must divide {BLOCK} (a tile's columns share one weight scale row), "
                          f"got {g.block_n}")
    if on_load and g.block_k != BLOCK:
        raise ValueError(f"quantizing on load needs block_k == {BLOCK} (one group per K step), got {g.block_k}")


def check_fp8_moe_plan(plan: Fp8MoEPlan) -> None:
    """Both GEMMs' tiles (:func:`check_fp8_plan`) and one row block for both; swapped operands
    need weight tiles (block_n) of whole 64-row wgmma M sides."""
    if plan.gate_up.block_m != plan.down.block_m:
        raise ValueError("both GEMMs walk the same aligned blocks: gate_up and down need one block_m")
    if plan.direct and (plan.gate_up.group_m != 1 or plan.down.group_m != 1):
        raise ValueError("a direct plan has no row groups: group_m must be 1")
    for name, g in (("gate_up", plan.gate_up), ("down", plan.down)):
        if plan.swap_ab and g.block_n % _WGMMA_M:
            raise ConfigError(f"swap_ab: {name}.block_n must be a multiple of {_WGMMA_M} (the weight tile is the "
                              f"MMA's M side), got {g.block_n}")
    check_fp8_plan(plan.gate_up, plan.quant_x_on_load)
    check_fp8_plan(plan.down, plan.quant_act_on_load)
