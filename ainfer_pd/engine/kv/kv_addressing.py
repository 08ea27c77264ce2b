"""Positions of a sequence -> KV cache slots, block ids and block tables: the host-side metadata
of a batch (:meth:`.runner.ModelRunner.build`). A mixin of :class:`.kv_cache.KVCacheManager` (the
sequences, ``trajectories``, and the block size are the manager's)."""
from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .kv_sequence import TrajectoryKV


class BlockAddressing:
    trajectories: dict[str, "TrajectoryKV"]
    block_size: int
    alloc: "BlockPool"

    def slot_of(self, tid: str, pos: int) -> int:
        """Cache slot of position ``pos`` of ``tid`` (host int, no tensor)."""
        bs = self.block_size
        return self.trajectories[tid].blocks[pos // bs] * bs + pos % bs

    def block_table(self, tids: list[str], num_blocks: int) -> torch.Tensor:
        """[len(tids), num_blocks] int64: each row's first blocks, padded with block 0 (masked keys)."""
        if not tids or num_blocks <= 0:
            return torch.zeros(len(tids), max(0, num_blocks), dtype=torch.int64)
        out = array("q", bytes(8 * len(tids) * num_blocks))
        for i, tid in enumerate(tids):
            arr = self.trajectories[tid].block_arr
            n = min(len(arr), num_blocks)
            out[i * num_blocks:i * num_blocks + n] = arr[:n]          # slices of arrays: memcpy
        return torch.frombuffer(out, dtype=torch.int64).view(len(tids), num_blocks)

    def block_ids(self, tid: str, num_tokens: int) -> torch.Tensor:
        """Host int64 ids of the blocks holding the first ``num_tokens`` positions of ``tid``."""
        return torch.tensor(self.trajectories[tid].blocks[:self.alloc.blocks_for(num_tokens)], dtype=torch.int64)

    def slots(self, tid: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of ``tid``: [end - start] int64."""
        blocks = torch.tensor(self.trajectories[tid].blocks, dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
