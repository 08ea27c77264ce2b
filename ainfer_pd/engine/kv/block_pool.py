"""The physical KV blocks of one rank: reference counts, content addresses, LRU of unreferenced ones.

Mechanism only (the hashing and the choices are :mod:`.block_hash`). Every block is in exactly
one of three states:

* **free**: no content, on the free list;
* **cached**: referenced by no sequence but holding reusable content, in the LRU: a *full*
  block registered under its chained hash (shareable by any sequence with that prefix), or a
  *partial* one (a sequence's last, incomplete block) registered under its parent's hash with
  the tokens it holds (adoptable by one sequence, which then writes the rest of it);
* **held**: referenced by ``ref[b] >= 1`` sequences. A held full block may stay registered
  (others share it read-only); a held block is never partial-registered (its holder writes it).

Allocation takes free blocks first, then evicts the least recently released cached block. A
held block is never evicted. ``owner[b]`` is the lifetime id of the sequence writing the block
(0 when nobody writes it).
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives low ids first
        self.ref = [0] * num_blocks
        self.owner = [0] * num_blocks
        self.ownership_losses = 0        # blocks whose writer let go (release), ever: see check_owner
        self.lru: OrderedDict[int, None] = OrderedDict()              # cached blocks, oldest first
        self.by_hash: dict[bytes, int] = {}                           # full blocks
        self.hash_of: dict[int, bytes] = {}
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}   # block -> (parent hash, tokens)
        self.children: dict[bytes, set[int]] = {}                     # parent hash -> registered blocks
        self.num_evictions = 0

    # -------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks with no content."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks with reusable content (evictable)."""
        return len(self.lru)

    @property
    def num_unreferenced(self) -> int:
        """Blocks an allocation can draw on: free + cached."""
        return len(self._free) + len(self.lru)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, h: bytes) -> int | None:
        """The full block registered under ``h``, if any."""
        return self.by_hash.get(h)

    def candidates(self, parent: bytes) -> list[tuple[int, tuple[int, ...]]]:
        """Unreferenced registered blocks after ``parent`` (adoptable tails), with their tokens."""
        return [(b, self.content[b][1]) for b in self.children.get(parent, ()) if self.ref[b] == 0]

    def check_owner(self, blocks: list[int], lifetime: int) -> bool:
        """Every block of ``blocks`` is written by ``lifetime``. A held block changes owner only
        through :meth:`release` (allocate / adopt take unreferenced blocks), which counts in
        ``ownership_losses``: a caller may skip a re-check while that count has not moved."""
        return all(self.owner[b] == lifetime for b in blocks)

    # -------------------------------------------------------------- mechanism
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_unreferenced

    def allocate(self, n: int, lifetime: int) -> list[int]:
        """``n`` blocks with no content, written by ``lifetime``: free ones first, then the LRU's."""
        assert self.can_allocate(n), "allocate() without can_allocate()"
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                self._unregister(b)
                self.num_evictions += 1
            self.ref[b] = 1
            self.owner[b] = lifetime
            out.append(b)
        return out

    def take(self, b: int) -> None:
        """Share a registered full block (read-only): one more reference."""
        if self.ref[b] == 0:
            del self.lru[b]
        self.ref[b] += 1

    def adopt(self, b: int, lifetime: int) -> None:
        """Take an unreferenced registered block to write the rest of it: it loses its address."""
        assert self.ref[b] == 0, f"adopting block {b} that is referenced"
        del self.lru[b]
        self._unregister(b)
        self.ref[b] = 1
        self.owner[b] = lifetime

    def register_full(self, b: int, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """A held block's KV is complete: shareable under ``h`` from now on (False when another
        block already holds that content: this one stays private and is freed on release)."""
        if h in self.by_hash or b in self.content:
            return False
        self.by_hash[h] = b
        self.hash_of[b] = h
        self.content[b] = (parent, tokens)
        self.children.setdefault(parent, set()).add(b)
        return True

    def demote(self, b: int) -> bool:
        """An unreferenced cached ``b`` is evicted before every other cached block (it stays
        reusable until then). False when ``b`` is not cached."""
        if b not in self.lru:
            return False
        self.lru.move_to_end(b, last=False)
        return True

    def release(self, b: int, partial: tuple[bytes, tuple[int, ...]] | None = None) -> None:
        """Drop one reference. The last one moves the block to the LRU when it has content (a
        registered full block, or ``partial`` = (parent hash, tokens) of a sequence's last
        block, registered now), else to the free list."""
        assert self.ref[b] > 0, f"release of unreferenced block {b}"
        self.ref[b] -= 1
        if self.ref[b]:
            return
        if self.owner[b]:
            self.ownership_losses += 1
        self.owner[b] = 0
        if partial is not None and b not in self.content:
            parent, toks = partial
            self.content[b] = (parent, toks)
            self.children.setdefault(parent, set()).add(b)
        if b in self.content:
            self.lru[b] = None
        else:
            self._free.append(b)

    def unregister_all(self) -> int:
        """Forget every content address (the weights changed, or the cache is dropped): cached
        blocks become free, held ones stay held but unshareable. Returns the cached blocks freed."""
        n = len(self.lru)
        for b in list(self.content):
            self._unregister(b)
        self._free.extend(self.lru)
        self.lru.clear()
        return n

    def drop_cached(self) -> int:
        """Free every cached block (held blocks keep their addresses). Returns how many."""
        n = len(self.lru)
        for b in self.lru:
            self._unregister(b)
            self._free.append(b)
        self.lru.clear()
        return n

    def _unregister(self, b: int) -> None:
        h = self.hash_of.pop(b, None)
        if h is not None and self.by_hash.get(h) == b:
            del self.by_hash[h]
        c = self.content.pop(b, None)
        if c is not None:
            kids = self.children.get(c[0])
            if kids is not None:
                kids.discard(b)
                if not kids:
                    del self.children[c[0]]

    # -------------------------------------------------------------- audit
    def check(self, held: dict[int, int]) -> list[str]:
        """Inconsistencies against ``held`` (block -> references the sequences hold); [] if none."""
        bad = []
        free, lru = set(self._free), set(self.lru)
        if len(free) != len(self._free):
            bad.append("a block is on the free list twice")
        for b in range(self.num_blocks):
            states = (b in free) + (b in lru) + (self.ref[b] > 0)
            if states != 1:
                bad.append(f"block {b}: in {states} states (free {b in free}, cached {b in lru}, ref {self.ref[b]})")
            if self.ref[b] != held.get(b, 0):
                bad.append(f"block {b}: ref {self.ref[b]} but sequences hold {held.get(b, 0)}")
            if b in free and (b in self.content or b in self.hash_of):
                bad.append(f"free block {b} has content")
            if b in lru and b not in self.content:
                bad.append(f"cached block {b} has no content")
        for h, b in self.by_hash.items():
            if self.hash_of.get(b) != h or b not in self.content:
                bad.append(f"hash of block {b} is inconsistent")
        for parent, kids in self.children.items():
            for b in kids:
                if self.content.get(b, (None,))[0] != parent:
                    bad.append(f"block {b} listed under the wrong parent")
        return bad
