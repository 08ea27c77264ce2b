"""Paged KV with content-addressed prefix sharing, lifetimes and LRU eviction.

Mechanism only: ``can_*`` / query methods, then ``reserve`` / ``mark_written`` / ``finish_turn``
(no exceptions for control flow); the addresses and choices are :mod:`.block_hash`, the blocks
:mod:`.block_pool`.

* A *sequence* (one turn of a trajectory, keyed by the trajectory id) holds blocks from its
  admission until its turn ends: the shared prefix it found (full blocks registered under
  the chained hash of their tokens: read-only, reference-counted), then its private blocks,
  which only it writes. An idle trajectory holds nothing: its KV stays in the cache as
  content, found again by its tokens - by its own next turn, by a new request id for the
  same context, by GRPO siblings of the same prompt.
* A full block becomes shareable only once its KV is completely written (``mark_written``,
  called after the pass that wrote it completed); the last, incomplete block of an ended
  sequence is kept as an adoptable *tail*: one later sequence continuing those tokens takes it
  over and writes the rest (the exact continuation of a trajectory loses nothing).
* Unreferenced blocks with content are evicted least recently released first (a chain's tail
  before its head); a referenced block is never evicted.
* Lifetimes: every private block carries the lifetime id of its sequence's reservation, so a
  result of an old lifetime is never promoted and never marks a reused block written; a block
  returns to the pool only after the engine knows no device work touches it (an abort waits
  for its submitted work to drain).
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any, Sequence

from ...errors import CapacityError, LifetimeError
from .block_hash import ROOT, best_tail, block_hash, chain_hashes, release_order
from .block_pool import BlockPool
from .kv_addressing import BlockAddressing
from .kv_audit import KVAudit
from .kv_sequence import TrajectoryKV

_lifetimes = itertools.count(1)


def new_lifetime() -> int:
    return next(_lifetimes)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the cache holds of a token sequence (a query: nothing is taken)."""

    shared: tuple[int, ...]          # full blocks to share, in order
    hashes: tuple[bytes, ...]        # their chained hashes
    tail: int | None                 # an unreferenced block to adopt after them
    tail_tokens: int                 # tokens of ``tail`` that are kept
    next_hash: bytes | None          # hash of the first full block not found (within the limit)


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """What admitting one turn means for the cache now."""

    demand: int                     # blocks its reservation takes out of the pool (admission_demand)
    cached: int                     # prompt tokens it would reuse
    next_hash: bytes | None         # the first full prompt block it misses (None: none within the limit)
    waits: bool                     # an admitted turn is writing that block: GRPO siblings of one prompt
    # submitted together (admitting now would compute the block twice; waiting shares it once that
    # turn's pass completed)
    num_shared: int = 0             # full prompt blocks it shares (the index of next_hash in its hashes)


class KVCacheManager(BlockAddressing, KVAudit):
    """The KV blocks of one rank: sequences, the prefix cache, admission accounting (positions ->
    cache slots and block tables: :class:`.kv_addressing.BlockAddressing`; the consistency audit:
    :class:`.kv_audit.KVAudit`)."""

    def __init__(self, num_blocks: int, block_size: int, *, sharing: bool = True, wait_min_tokens: int = 0) -> None:
        self.alloc = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.sharing = sharing
        """False: a block is reused only by the trajectory that wrote it (its own next turns: the
        exact-continuation path); the chains are salted with the trajectory id."""
        self.wait_min_tokens = wait_min_tokens
        """A turn waits for a sibling writing its missing prompt blocks only when they hold at least
        this many tokens (``cache.prefix_wait_min_tokens``; see :func:`.block_hash.worth_waiting`)."""
        self.trajectories: dict[str, TrajectoryKV] = {}
        self.writing: dict[bytes, int] = {}       # hash -> sequences that will complete that block
        self.version = 0
        """Bumped by every change an :meth:`admission_view` of a waiting turn can see (reservations,
        releases, invalidations, drops, a completed block that is a waiting turn's next missing one
        (``wanted``) or leaves ``writing``): a view computed at the same version is still exact."""
        self.wanted: set[bytes] = set()
        """The first missing prompt block of each waiting turn (set by the engine's pending view)."""
        self.num_prompt_tokens = 0                # prompt tokens of every reservation
        self.num_reused_tokens = 0                # of those, served from the cache

    # -------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (free or cached content)."""
        return self.alloc.num_unreferenced

    @property
    def num_cached_blocks(self) -> int:
        return self.alloc.num_cached

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose content was evicted to make room."""
        return self.alloc.num_evictions

    def evictable_blocks(self, exclude: str | None = None) -> int:
        return self.alloc.num_cached

    def pool_blocks(self) -> int:
        """Blocks an admission can draw on: free ones plus every unreferenced cached one."""
        return self.alloc.num_unreferenced

    def root(self, tid: str) -> bytes:
        return ROOT if self.sharing else ROOT + tid.encode()

    def prompt_hashes(self, tokens: Sequence[int], limit: int | None = None, tid: str = "",
                      known: tuple | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of ``tokens`` within ``limit`` tokens (default all
        but the last token: it is always fed again for its logits). ``known`` = (tokens, hashes)
        of an earlier prompt of ``tid`` (``Trajectory.block_hashes``): the blocks of ``tokens``
        that repeat it keep those hashes (a chained hash is a function of the tokens up to its
        block, checked here by comparing them), only the blocks past them are hashed: a
        continuation of a 12K-token context hashes its new blocks, not 750."""
        limit = len(tokens) - 1 if limit is None else limit
        bs, out = self.block_size, []
        if known is not None:
            ktoks, khashes = known
            m = min(len(khashes), max(0, limit) // bs, len(ktoks) // bs)
            if m and list(tokens[:m * bs]) != list(ktoks[:m * bs]):
                m = 0                               # another prompt: hash it all
            out = list(khashes[:m])
        parent = out[-1] if out else self.root(tid)
        return out + chain_hashes(tokens, bs, max(0, limit), parent, start_block=len(out))

    def match(self, tokens: Sequence[int], limit: int | None = None,
              hashes: Sequence[bytes] | None = None, tid: str = "") -> tuple[PrefixMatch, int]:
        """The longest prefix of ``tokens`` (at most ``limit`` tokens, default ``len - 1``) whose
        KV is cached: shared full blocks, then maybe an adoptable tail. ``hashes`` are
        :meth:`prompt_hashes` of the same tokens and limit (computed when not given).
        Returns (the match, tokens covered)."""
        bs = self.block_size
        limit = len(tokens) - 1 if limit is None else min(limit, len(tokens))
        if hashes is None:
            hashes = self.prompt_hashes(tokens, limit, tid)
        shared: list[int] = []
        for h in hashes:
            b = self.alloc.lookup(h)
            if b is None:
                break
            shared.append(b)
        n = len(shared)
        parent = hashes[n - 1] if n else self.root(tid)
        next_hash = hashes[n] if n < len(hashes) else None
        tail, kept = None, 0
        rest = tokens[n * bs:min(limit, (n + 1) * bs)]
        if len(rest):
            hit = best_tail(self.alloc.candidates(parent), rest)
            if hit is not None:
                tail, kept = hit
        return PrefixMatch(tuple(shared), tuple(hashes[:n]), tail, kept, next_hash), n * bs + kept

    def cached_prefix(self, tokens: Sequence[int], limit: int | None = None, tid: str = "") -> int:
        """Tokens of ``tokens`` whose KV is cached (see :meth:`match`)."""
        return self.match(tokens, limit, tid=tid)[1] if len(tokens) else 0

    def admission_view(self, tid: str, total_tokens: int, tokens: Sequence[int] = (),
                       hashes: Sequence[bytes] | None = None) -> AdmissionView:
        """What admitting a turn of ``tid`` (prompt ``tokens``, ``total_tokens`` with its output)
        means now, from one :meth:`match` (see :class:`AdmissionView`)."""
        need = self.alloc.blocks_for(total_tokens)
        if not len(tokens):
            return AdmissionView(need, 0, None, False)
        m, kept = self.match(tokens, hashes=hashes, tid=tid)
        outside = sum(1 for b in m.shared if self.alloc.ref[b] > 0)
        waits = m.next_hash is not None and m.next_hash in self.writing
        return AdmissionView(max(0, need - outside), kept, m.next_hash, waits, len(m.shared))

    def admission_demand(self, tid: str, total_tokens: int, tokens: Sequence[int] = (),
                         hashes: Sequence[bytes] | None = None) -> int:
        """Blocks that :meth:`reserve` of ``total_tokens`` for ``tid`` (prompt ``tokens``) takes
        out of :meth:`pool_blocks`: every block of the turn, less the shared blocks it reuses that
        are referenced already (outside the pool; an unreferenced cached block it reuses leaves
        the pool like a new one). :func:`ainfer_pd.sched.planner.fits` compares the two."""
        return self.admission_view(tid, total_tokens, tokens, hashes).demand

    # -------------------------------------------------------------- mechanism
    def reserve(self, tid: str, total_tokens: int, tokens: Sequence[int] = (), now: float = 0.0, *,
                hashes: Sequence[bytes] | None = None) -> int:
        """Reserve blocks so ``tid`` can hold ``total_tokens``, sharing the cached prefix of its
        prompt ``tokens`` (a sliceable sequence that may grow as the turn decodes: the blocks it
        completes are hashed from it). Evicts unreferenced cached blocks (LRU) if needed.
        Returns the new lifetime; ``trajectories[tid].num_tokens`` is the reused prefix."""
        old = self.trajectories.get(tid)
        if old is not None:            # a turn of tid still holds blocks (the engine never admits then)
            raise LifetimeError(f"{tid!r} already holds a reservation (lifetime {old.lifetime})")
        root = self.root(tid)
        if len(tokens) and hashes is None:
            hashes = self.prompt_hashes(tokens, tid=tid)
        m, kept = self.match(tokens, hashes=hashes, tid=tid) if len(tokens) else (PrefixMatch((), (), None, 0, None), 0)
        reuse = len(m.shared) + (m.tail is not None)
        need = self.alloc.blocks_for(total_tokens) - reuse
        in_pool = sum(1 for b in m.shared if self.alloc.ref[b] == 0) + (m.tail is not None)
        if need > self.alloc.num_unreferenced - in_pool:
            raise CapacityError(f"KV cache cannot hold {total_tokens} tokens for {tid!r} "
                                f"({self.alloc.num_unreferenced} blocks free or evictable)")
        lifetime = new_lifetime()
        for b in m.shared:
            self.alloc.take(b)
        blocks = list(m.shared)
        if m.tail is not None:
            self.alloc.adopt(m.tail, lifetime)
            blocks.append(m.tail)
        blocks += self.alloc.allocate(max(0, need), lifetime)
        kv = TrajectoryKV(blocks=blocks, num_tokens=kept, lifetime=lifetime, last_used=now,
                          num_shared=len(m.shared), hashes=list(m.hashes), tokens=tokens, root=root,
                          block_arr=array("q", blocks), prompt_hashes=hashes if len(tokens) else ())
        # the prompt's full blocks this sequence will complete: siblings wait for them (admission_view)
        kv.writing = list(hashes[len(m.shared):]) if self.sharing and len(tokens) else []
        for h in kv.writing:
            self.writing[h] = self.writing.get(h, 0) + 1
        self.trajectories[tid] = kv
        self.num_prompt_tokens += len(tokens)
        self.num_reused_tokens += kept
        self.version += 1
        return lifetime

    def grow(self, tid: str, lifetime: int, total_tokens: int) -> bool:
        """On-demand output blocks (``cache.reserve_output: estimate``): make the sequence of
        ``lifetime`` hold blocks for ``total_tokens`` positions, taking new private blocks from
        the pool (free ones first, then evicting the least recently released cached ones). False,
        with nothing taken, when the pool cannot give them all."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime:
            raise LifetimeError(f"grow for {tid!r}: lifetime {lifetime} holds no reservation")
        need = self.alloc.blocks_for(total_tokens) - len(kv.blocks)
        if need <= 0:
            return True
        if not self.alloc.can_allocate(need):
            return False
        evicted = self.alloc.num_evictions
        new = self.alloc.allocate(need, lifetime)
        kv.blocks += new
        kv.block_arr.extend(new)
        if self.alloc.num_evictions != evicted:
            self.version += 1                   # a waiting turn's cached prefix may be gone
        return True

    def mark_written(self, tid: str, lifetime: int, num_tokens: int) -> None:
        """A forward pass of ``lifetime`` wrote KV up to ``num_tokens`` (it completed); refuses
        stale lifetimes. Blocks it completed become shareable under their chained hash."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime or not self._owns(kv, lifetime):
            raise LifetimeError(f"stale result for {tid!r}: lifetime {lifetime} no longer owns its blocks")
        kv.num_tokens = max(kv.num_tokens, num_tokens)
        bs = self.block_size
        known = kv.prompt_hashes                 # the prompt's blocks: hashed once, before admission
        for j in range(len(kv.hashes), min(kv.num_tokens // bs, len(kv.blocks))):
            parent = kv.hashes[-1] if kv.hashes else kv.root
            toks = tuple(kv.tokens[j * bs:(j + 1) * bs])
            h = known[j] if j < len(known) else block_hash(parent, toks)
            kv.hashes.append(h)
            if not kv.stale and self.alloc.register_full(kv.blocks[j], h, parent, toks) and h in self.wanted:
                self.version += 1
            if self._done_writing(kv, h):
                self.version += 1

    def is_current(self, tid: str, lifetime: int) -> bool:
        kv = self.trajectories.get(tid)
        return kv is not None and kv.lifetime == lifetime and self._owns(kv, lifetime)

    def _owns(self, kv: TrajectoryKV, lifetime: int) -> bool:
        """``lifetime`` still writes every private block of ``kv``. Checked block by block only
        when some block of the pool lost its writer since the last check (before: on every decode
        token of every row, O(blocks): 470 a row at 7.5K context)."""
        memo = (lifetime, self.alloc.ownership_losses)
        if kv.owner_checked == memo:
            return True
        if not self.alloc.check_owner(kv.private_blocks, lifetime):
            return False
        kv.owner_checked = memo
        return True

    def finish_turn(self, tid: str, lifetime: int, num_valid_tokens: int, now: float) -> None:
        """The turn of ``lifetime`` ended: its blocks go back to the pool, keeping as cached
        content the first ``num_valid_tokens`` (at most what was written; nothing when the
        weights changed during the turn, see :meth:`invalidate`)."""
        kv = self.trajectories.get(tid)
        if kv is None or kv.lifetime != lifetime:
            return
        self._release_seq(tid, min(num_valid_tokens, kv.num_tokens))

    def abort_turn(self, tid: str, lifetime: int, num_valid_tokens: int, now: float) -> None:
        """The aborted turn of ``lifetime`` drained: as :meth:`finish_turn` (what it wrote stays
        cached: a resubmission of its tokens finds it); any late result of it is stale."""
        self.finish_turn(tid, lifetime, num_valid_tokens, now)

    def invalidate(self) -> int:
        """The weights changed: cached KV no longer matches them. Every content address is
        forgotten (cached blocks are freed now, so the next turns recompute); a sequence in
        flight (reading the new weights from its next stream item on) is marked stale: it
        shares nothing further and leaves nothing cached. Returns the blocks freed now."""
        for kv in self.trajectories.values():
            kv.stale = True
            kv.writing = []
        self.writing.clear()
        self.version += 1
        return self.alloc.unregister_all()

    def drop_cached(self) -> int:
        """Free every cached block (``sleep`` / ``release_kv_cache``). Returns how many."""
        self.version += 1
        return self.alloc.drop_cached()

    def release(self, tid: str) -> None:
        """Drop the sequence of ``tid`` if it still holds blocks (its written KV stays cached)."""
        kv = self.trajectories.get(tid)
        if kv is not None:
            self._release_seq(tid, kv.num_tokens)

    def forget(self, tokens: Sequence[int], keep_tokens: int, *, tid: str = "", known: tuple | None = None) -> int:
        """A released trajectory (``tokens``, its whole context): its cached blocks past the
        first ``keep_tokens`` (the prompt GRPO siblings share) go to the front of the eviction
        order, its last block first (no turn continues it; the contexts of trajectories waiting
        for a tool are kept longer). They stay reusable until evicted. ``known``: (tokens,
        hashes) of its last prompt (``Trajectory.block_hashes``). Returns the blocks demoted."""
        if len(tokens) < 2:
            return 0
        hashes = self.prompt_hashes(tokens, tid=tid, known=known)
        chain = [b for h in hashes[keep_tokens // self.block_size:] if (b := self.alloc.lookup(h)) is not None]
        m, _ = self.match(tokens, hashes=hashes, tid=tid)
        if m.tail is not None and len(m.shared) == len(hashes):
            chain.append(m.tail)
        return sum(self.alloc.demote(b) for b in chain)      # head first: the tail ends in front

    # -------------------------------------------------------------- internals
    def _done_writing(self, kv: TrajectoryKV, h: bytes) -> bool:
        if h not in kv.writing:
            return False
        kv.writing.remove(h)
        n = self.writing.get(h, 0) - 1
        if n > 0:
            self.writing[h] = n
        else:
            self.writing.pop(h, None)
        return True

    def _release_seq(self, tid: str, num_valid: int) -> None:
        kv = self.trajectories.pop(tid)
        self.version += 1
        for h in list(kv.writing):
            self._done_writing(kv, h)
        bs = self.block_size
        last, rem = divmod(num_valid, bs)
        for j in release_order(range(len(kv.blocks))):
            b = kv.blocks[j]
            partial = None
            if j == last and rem and not kv.stale and j >= kv.num_shared and j <= len(kv.hashes):
                # the incomplete last block: adoptable by the next sequence continuing these tokens
                partial = (kv.hashes[j - 1] if j else kv.root, tuple(kv.tokens[j * bs:j * bs + rem]))
            self.alloc.release(b, partial)
