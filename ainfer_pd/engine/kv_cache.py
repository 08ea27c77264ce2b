"""Paged KV blocks with lifetimes; per-trajectory retention and LRU eviction.

Mechanism only: ``can_*`` checks, then ``allocate`` / ``free`` (no exceptions for
control flow). Every block records the lifetime id of the reservation that owns it,
so a result of an old lifetime can never be written into a block that was reused.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..errors import CapacityError, LifetimeError


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives low ids first
        self.owner = [0] * num_blocks                                  # lifetime id, 0 = free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, lifetime: int) -> list[int]:
        assert self.can_allocate(n), "allocate() without can_allocate()"
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.owner[b] = lifetime
        return out

    def retag(self, blocks: list[int], lifetime: int) -> None:
        for b in blocks:
            self.owner[b] = lifetime

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.owner[b] != 0, f"double free of block {b}"
            self.owner[b] = 0
            self._free.append(b)

    def check_owner(self, blocks: list[int], lifetime: int) -> bool:
        return all(self.owner[b] == lifetime for b in blocks)


_lifetimes = itertools.count(1)


def new_lifetime() -> int:
    return next(_lifetimes)


@dataclass(slots=True)
class TrajectoryKV:
    """The retained KV of one trajectory."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0          # tokens whose KV is computed and valid
    lifetime: int = 0            # lifetime of the current reservation (0 = none)
    last_used: float = 0.0
    pinned: bool = False         # a turn is in flight: never evicted
    stale: bool = False          # computed (partly) with old weights: dropped when the turn ends


class KVCacheManager:
    """Blocks of every trajectory on this rank; eviction of idle ones (LRU)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.trajectories: dict[str, TrajectoryKV] = {}
        self.num_evictions = 0

    # -------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.alloc.num_free

    def evictable_blocks(self, exclude: str | None = None) -> int:
        return sum(len(t.blocks) for tid, t in self.trajectories.items() if not t.pinned and tid != exclude)

    def pool_blocks(self) -> int:
        """Blocks an admission can draw on: the free ones plus every idle (unpinned)
        trajectory's, the admitted trajectory's own included."""
        return self.alloc.num_free + self.evictable_blocks()

    def admission_demand(self, tid: str, total_tokens: int) -> int:
        """Blocks that :meth:`reserve` of ``total_tokens`` for ``tid`` takes out of
        :meth:`pool_blocks`: every block of the turn, less the trajectory's own blocks that are
        outside the pool (pinned). It does not depend on how much of the trajectory's retained
        prefix is kept: kept blocks are in the pool and stay in use, the rest is truncated into
        the free list and drawn again. :func:`ainfer_pd.sched.planner.fits` compares the two."""
        kv = self.trajectories.get(tid)
        outside = len(kv.blocks) if kv is not None and kv.pinned else 0
        return max(0, self.alloc.blocks_for(total_tokens) - outside)

    # -------------------------------------------------------------- mechanism
    def reserve(self, tid: str, total_tokens: int, keep_tokens: int, now: float) -> int:
        """Reserve blocks so ``tid`` can hold ``total_tokens``, keeping its first
        ``keep_tokens`` of valid KV; evicts LRU idle trajectories if needed.
        Returns the new lifetime id, which now tags every block of ``tid``."""
        kv = self.trajectories.setdefault(tid, TrajectoryKV())
        keep = min(keep_tokens, kv.num_tokens)
        self._truncate(kv, keep)
        need = self.alloc.blocks_for(total_tokens) - len(kv.blocks)
        if need > self.alloc.num_free:
            self._evict_lru(need - self.alloc.num_free, exclude=tid)
        if need > self.alloc.num_free:
            raise CapacityError(f"KV cache cannot hold {total_tokens} tokens for {tid!r} "
                                f"({self.alloc.num_free} blocks free after evicting every idle trajectory)")
        lifetime = new_lifetime()
        if need > 0:
            kv.blocks.extend(self.alloc.allocate(need, lifetime))
        self.alloc.retag(kv.blocks, lifetime)
        kv.lifetime = lifetime
        kv.pinned = True
        kv.last_used = now
        return lifetime

    def finish_turn(self, tid: str, lifetime: int, num_valid_tokens: int, now: float) -> None:
        """The turn of ``lifetime`` ended: keep ``num_valid_tokens`` of KV, free the rest
        (all of it when the weights changed during the turn: see :meth:`invalidate`)."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime:
            return
        if kv.stale:
            num_valid_tokens, kv.stale = 0, False
        kv.num_tokens = num_valid_tokens
        self._truncate(kv, num_valid_tokens)
        kv.pinned = False
        kv.last_used = now

    def abort_turn(self, tid: str, lifetime: int, num_valid_tokens: int, now: float) -> None:
        """Drop the reservation of an aborted turn; the prefix KV that was valid before stays."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime:
            return
        if kv.stale:
            num_valid_tokens, kv.stale = 0, False
        kv.num_tokens = min(kv.num_tokens, num_valid_tokens)
        self._truncate(kv, kv.num_tokens)
        kv.lifetime = new_lifetime()          # any late result of the old lifetime is now stale
        self.alloc.retag(kv.blocks, kv.lifetime)
        kv.pinned = False
        kv.last_used = now

    def mark_written(self, tid: str, lifetime: int, num_tokens: int) -> None:
        """A forward pass of ``lifetime`` wrote KV up to ``num_tokens``; refuses stale lifetimes."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime or not self.alloc.check_owner(kv.blocks, lifetime):
            raise LifetimeError(f"stale result for {tid!r}: lifetime {lifetime} no longer owns its blocks")
        kv.num_tokens = max(kv.num_tokens, num_tokens)

    def is_current(self, tid: str, lifetime: int) -> bool:
        kv = self.trajectories.get(tid)
        return kv is not None and kv.lifetime == lifetime and self.alloc.check_owner(kv.blocks, lifetime)

    def invalidate(self) -> int:
        """The weights changed: retained KV no longer matches them. Frees every idle
        trajectory's blocks now (its next turn recomputes); a pinned one (a turn in flight,
        which reads the new weights from its next stream item on) is marked stale and keeps
        nothing when that turn ends. Returns the number of blocks freed now."""
        freed = 0
        for kv in self.trajectories.values():
            if kv.pinned:
                kv.stale = True
            elif kv.blocks:
                freed += len(kv.blocks)
                self._truncate(kv, 0)
                kv.lifetime = new_lifetime()
        return freed

    def release(self, tid: str) -> None:
        kv = self.trajectories.pop(tid, None)
        if kv is not None and kv.blocks:
            self.alloc.free(kv.blocks)

    def slot_of(self, tid: str, pos: int) -> int:
        """Cache slot of position ``pos`` of ``tid`` (host int, no tensor)."""
        bs = self.block_size
        return self.trajectories[tid].blocks[pos // bs] * bs + pos % bs

    def block_table(self, tids: list[str], num_blocks: int) -> torch.Tensor:
        """[len(tids), num_blocks] int64: each row's first blocks, padded with block 0 (masked keys)."""
        rows = []
        for tid in tids:
            blocks = self.trajectories[tid].blocks[:num_blocks]
            rows.append(blocks + [0] * (num_blocks - len(blocks)))
        return torch.tensor(rows, dtype=torch.int64).reshape(len(tids), num_blocks)

    def block_ids(self, tid: str, num_tokens: int) -> torch.Tensor:
        """Host int64 ids of the blocks holding the first ``num_tokens`` positions of ``tid``."""
        return torch.tensor(self.trajectories[tid].blocks[:self.alloc.blocks_for(num_tokens)], dtype=torch.int64)

    def slots(self, tid: str, start: int, end: int) -> torch.Tensor:
        """Cache slots of positions [start, end) of ``tid``: [end - start] int64."""
        blocks = torch.tensor(self.trajectories[tid].blocks, dtype=torch.int64)
        pos = torch.arange(start, end, dtype=torch.int64)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    # -------------------------------------------------------------- internals
    def _truncate(self, kv: TrajectoryKV, num_tokens: int) -> None:
        keep = self.alloc.blocks_for(num_tokens)
        if len(kv.blocks) > keep:
            self.alloc.free(kv.blocks[keep:])
            del kv.blocks[keep:]
        kv.num_tokens = min(kv.num_tokens, num_tokens)

    def _evict_lru(self, need: int, exclude: str) -> None:
        idle = sorted((t.last_used, tid) for tid, t in self.trajectories.items()
                      if not t.pinned and tid != exclude and t.blocks)
        for _, tid in idle:
            if need <= 0:
                break
            kv = self.trajectories[tid]
            need -= len(kv.blocks)
            self.alloc.free(kv.blocks)
            kv.blocks = []
            kv.num_tokens = 0
            kv.lifetime = new_lifetime()
            self.num_evictions += 1

    def check_no_leak(self) -> bool:
        """Every non-free block belongs to exactly one trajectory."""
        owned = [b for t in self.trajectories.values() for b in t.blocks]
        return len(owned) == len(set(owned)) and len(owned) + self.alloc.num_free == self.alloc.num_blocks
