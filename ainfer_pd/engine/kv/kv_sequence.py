"""The blocks one trajectory's turn in flight holds in the paged KV cache (a *sequence*)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .block_hash import ROOT


@dataclass(slots=True)
class TrajectoryKV:
    """The blocks one trajectory's turn in flight holds (a *sequence*)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0          # tokens whose KV is computed and valid
    lifetime: int = 0            # lifetime of the reservation
    last_used: float = 0.0
    pinned: bool = True          # held by a turn in flight (always, while the entry exists)
    stale: bool = False          # computed (partly) with old weights: shares nothing, cached never
    num_shared: int = 0          # leading blocks found in the cache (read-only, owned by nobody)
    hashes: list[bytes] = field(default_factory=list)   # chained hashes of the complete blocks
    prompt_hashes: Any = ()      # the prompt's block hashes, known at reservation: completed blocks take them
    tokens: Any = ()             # the sequence's token ids (sliceable; grows while it decodes)
    root: bytes = ROOT           # parent hash of its first block (salted by the trajectory without sharing)
    writing: list[bytes] = field(default_factory=list)  # hashes of prompt blocks it will complete
    block_arr: Any = None        # ``blocks`` as array('q') (extended with them as output grows): block tables
    owner_checked: tuple = ()    # (lifetime, pool's ownership_losses) of the last full ownership check

    @property
    def private_blocks(self) -> list[int]:
        return self.blocks[self.num_shared:]
