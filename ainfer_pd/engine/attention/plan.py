"""Launch plans of the paged kernels: pure functions of shapes known on the host.

A plan depends only on host-known shapes (padded key length, dtype), never on device values,
so a CUDA graph bucket always replays the plan it was captured with.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodePlan:
    num_splits: int
    split_keys: int       # keys per split (a multiple of block_n)
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_plan(max_keys: int, *, block_n: int = 64, split_keys: int = 256, num_warps: int = 2,
                num_stages: int = 2) -> DecodePlan:
    """Split every row's keys at fixed positions (multiples of ``split_keys``).

    The split boundaries never depend on the batch (rows, the longest row, the graph bucket),
    so a row's result is bitwise the same in any batch, eager or replayed: splits beyond a
    row's length are empty and merge with weight exactly 0. The partial outputs cost
    ``16 / split_keys`` of the KV bytes (6% at 256 keys a split). Programs are (row, KV head,
    split): one row of the Qwen3-30B-A3B shape (4 KV heads) at 5K keys has 80 programs at 256
    keys a split, against 20 at 1024, which left most of the 132 SMs idle (34 us a layer against
    a 2.5 us KV bound; H200, docs/BENCHMARKS.md "Small-batch decode"). block_n, warps and stages
    from the H200 sweep.
    """
    split_keys = -(-split_keys // block_n) * block_n
    return DecodePlan(max(1, -(-max_keys // split_keys)), split_keys, block_n, num_warps, num_stages)


def prefill_plan(head_dim: int, fp32: bool) -> PrefillPlan:
    """Tile shape of the varlen prefill kernel (shared memory bounds the fp32 tiles)."""
    if fp32:
        return PrefillPlan(32, 32, 4, 1)
    return PrefillPlan(64, 64, 4, 2)        # best or within 1% of it on the H200 sweep (4K and 575 + 1500)
