"""The block accounting audit of the KV cache (every block free, cached or held, and held exactly
as often as the sequences reference it; the writer announcements consistent). A mixin of
:class:`.kv_cache.KVCacheManager` (its state is the manager's)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .kv_sequence import TrajectoryKV


class KVAudit:
    trajectories: dict[str, "TrajectoryKV"]
    writing: dict[bytes, int]
    block_size: int
    alloc: "BlockPool"

    def check_no_leak(self) -> bool:
        """Block accounting is consistent: every block is free, cached or held, and held exactly
        as often as the sequences reference it."""
        return not self.audit()

    def audit(self) -> list[str]:
        """The inconsistencies :meth:`check_no_leak` looks for ([] when none)."""
        held: dict[int, int] = {}
        bad = []
        for tid, kv in self.trajectories.items():
            if len(set(kv.blocks)) != len(kv.blocks):
                bad.append(f"{tid!r} holds a block twice")
            for b in kv.blocks:
                held[b] = held.get(b, 0) + 1
            for j in range(kv.num_shared, len(kv.blocks)):   # shared by others only once complete
                b = kv.blocks[j]
                # NOTE: completeness, not registration: invalidate() unregisters a complete block
                # that a sibling already shares (both sequences are stale from then on)
                if self.alloc.ref[b] != 1 and (j + 1) * self.block_size > kv.num_tokens:
                    bad.append(f"{tid!r}: incomplete private block {b} has {self.alloc.ref[b]} references")
        bad += self.alloc.check(held)
        for h, n in self.writing.items():
            if n != sum(kv.writing.count(h) for kv in self.trajectories.values()):
                bad.append("writer announcements are inconsistent")
                break
        return bad
