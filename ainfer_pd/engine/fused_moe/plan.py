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
    gate_up_tma: bool = False
    """gate_up reads its weight tiles through TMA descriptors (:mod:`.kernels_tma`: Hopper, 16-bit
    weights that :func:`gate_up_tma_ok`); down keeps its pointer loads."""

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m


# (rows per expert on average) -> plans; tuned on the H200 (docs/RESULTS.md, GPU data path: kernel tiles)
_SMALL = MoEPlan(GemmPlan(16, 64, 256, 1, 4, 3), GemmPlan(16, 128, 128, 1, 4, 3))
_MEDIUM = MoEPlan(GemmPlan(64, 64, 64, 8, 4, 3), GemmPlan(64, 128, 64, 8, 4, 3))
_LARGE = MoEPlan(GemmPlan(128, 128, 32, 8, 8, 4), GemmPlan(128, 128, 32, 16, 8, 4))
_FP32 = MoEPlan(GemmPlan(16, 32, 32, 1, 4, 1), GemmPlan(16, 32, 32, 1, 4, 1))
_ALONE = MoEPlan(_SMALL.gate_up, _SMALL.down, direct=True)
# gate_up through TMA descriptors (kernels_tma's docstring), up to TMA_MAX_ROWS_PER_EXPERT rows an expert. H100,
# the Qwen3 shape (E 128, k 8), a layer: 2,048 tokens 0.3326 against _LARGE's 0.3429 ms, 4,096 0.4488 against 0.4806;
# 8,192 (512 rows an expert) 0.8410 against 0.8002, so longer passes keep _LARGE
_LARGE_TMA = MoEPlan(GemmPlan(128, 128, 64, 8, 8, 4), _LARGE.down, gate_up_tma=True)
TMA_MAX_ROWS_PER_EXPERT = 256


def by_rows_per_expert(num_pairs: int, num_experts: int, small, medium, large):
    """A plan table's tier by (token, slot) rows per expert: up to 8 ``small`` (decode), up to 64
    ``medium``, else ``large`` (prefill)."""
    per_expert = num_pairs / max(1, num_experts)
    return small if per_expert <= 8 else medium if per_expert <= 64 else large


def moe_plan(num_pairs: int, num_experts: int, fp32: bool, tokens: int | None = None, tma: bool = False) -> MoEPlan:
    """Small row blocks when experts get a few rows each (decode), large ones for prefill; a token
    decoding alone (``tokens`` 1) takes the small tiles without the layout launches
    (:attr:`MoEPlan.direct`: the same grid, the same tiles and bits, two launches fewer). ``tma``
    (the device has TMA and the weights :func:`gate_up_tma_ok`): prefill's gate_up through descriptors, up to
    :data:`TMA_MAX_ROWS_PER_EXPERT` rows an expert."""
    if fp32:
        return _FP32
    if tokens == 1:
        return _ALONE
    tma = tma and num_pairs <= TMA_MAX_ROWS_PER_EXPERT * max(1, num_experts)
    return by_rows_per_expert(num_pairs, num_experts, _SMALL, _MEDIUM, _LARGE_TMA if tma else _LARGE)


def gate_up_tma_ok(x, w13, block_n: int = _LARGE_TMA.gate_up.block_n) -> bool:
    """``w13`` [E, K, 2I] can be read through a TMA descriptor by tiles ``block_n`` wide: contiguous,
    16- or 32-bit, rows and base on 16 bytes, ``I`` a multiple of ``block_n`` (a tile never straddles
    the two halves); ``x`` in its dtype."""
    I2 = w13.shape[2]
    return (w13.element_size() in (2, 4) and w13.is_floating_point() and x.dtype == w13.dtype
            and w13.is_contiguous() and (I2 // 2) % block_n == 0 and (I2 * w13.element_size()) % 16 == 0
            and w13.data_ptr() % 16 == 0)
