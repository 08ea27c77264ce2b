"""Launch plans of the paged kernels: pure functions of shapes known on the host.

A plan depends only on host-known shapes (rows, padded key length, dtype), never on device
values, so a CUDA graph bucket always replays the plan it was captured with.
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


def decode_plan(rows: int, kv_heads: int, max_keys: int, num_sms: int, *, block_n: int = 64,
                programs_per_sm: int = 4, min_split_keys: int = 256, num_warps: int = 4,
                num_stages: int = 2) -> DecodePlan:
    """Split the keys of each (row, KV head) so about ``programs_per_sm`` programs run per SM,
    never below ``min_split_keys`` keys a split (short rows gain nothing from splitting)."""
    want = -(-programs_per_sm * num_sms // max(1, rows * kv_heads))
    cap = max(1, -(-max_keys // min_split_keys))
    splits = max(1, min(want, cap))
    split_keys = -(-max_keys // splits)
    split_keys = -(-split_keys // block_n) * block_n
    splits = -(-max_keys // split_keys)
    return DecodePlan(splits, split_keys, block_n, num_warps, num_stages)


def prefill_plan(head_dim: int, fp32: bool) -> PrefillPlan:
    """Tile shape of the varlen prefill kernel (shared memory bounds the fp32 tiles)."""
    if fp32:
        return PrefillPlan(32, 32, 4, 1)
    if head_dim <= 64:
        return PrefillPlan(128, 64, 4, 2)
    return PrefillPlan(128, 64, 8, 2)
