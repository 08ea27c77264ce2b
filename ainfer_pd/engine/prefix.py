"""The engine's side of the prefix cache: what a waiting turn would reuse, demand and reserve.

The admission rule itself stays in one place (:func:`ainfer_pd.sched.planner.fits` over
:meth:`KVCacheManager.admission_demand` / :meth:`KVCacheManager.pool_blocks`); this module only
feeds it a turn's prompt, with the prompt's block hashes computed once per turn.
"""
from __future__ import annotations

from ..sched.planner import PendingPrefill
from .block_hash import worth_waiting
from .kv_cache import KVCacheManager
from .state import SeqTokens, Turn


def prompt_hashes(kv: KVCacheManager, t: Turn) -> list:
    """The chained hashes of ``t``'s prompt blocks (cached on the turn: its prompt never changes)."""
    if t.prompt_hashes is None:
        t.prompt_hashes = kv.prompt_hashes(t.context, tid=t.tid)
    return t.prompt_hashes


def total_tokens(t: Turn) -> int:
    return len(t.context) + t.params.max_new_tokens


def pending_view(kv: KVCacheManager, turns) -> list[PendingPrefill]:
    """The planner's view of the waiting ``turns`` (FIFO), without those that should wait for a
    sibling writing the first block they miss: an admitted turn (``kv.writing``) or one ahead of
    them in this view, whose prompt blocks it will write (they share that block once the
    sibling's pass completed, instead of computing it again in the same epoch)."""
    out: list[PendingPrefill] = []
    ahead: set = set()                  # prompt blocks the turns ahead in the view will write
    for t in turns:
        if t.lifetime:
            out.append(PendingPrefill(t.request_id, t.remaining_prompt, True, 0))
            continue
        hashes = prompt_hashes(kv, t)
        v = kv.admission_view(t.tid, total_tokens(t), t.context, hashes)
        if (v.waits or (v.next_hash is not None and v.next_hash in ahead)) and worth_waiting(
                _written_by_others(hashes, v.next_hash, kv.writing, ahead), kv.block_size, kv.wait_min_tokens):
            continue
        if kv.sharing and v.next_hash is not None:
            ahead.update(hashes[hashes.index(v.next_hash):])
        out.append(PendingPrefill(t.request_id, len(t.context) - v.cached, False, v.demand))
    return out


def _written_by_others(hashes: list, first: bytes, writing, ahead: set) -> int:
    """Leading prompt blocks from ``first`` on that a sibling (admitted or ahead) will write."""
    n = 0
    for h in hashes[hashes.index(first):]:
        if h not in writing and h not in ahead:
            break
        n += 1
    return n


def demand(kv: KVCacheManager, t: Turn) -> int:
    return kv.admission_demand(t.tid, total_tokens(t), t.context, prompt_hashes(kv, t))


def reserve(kv: KVCacheManager, t: Turn, now: float) -> None:
    """Admit ``t``: reserve its blocks sharing its cached prefix; ``t.num_cached`` and
    ``t.prefilled`` become the tokens reused (only the rest is prefilled)."""
    t.lifetime = kv.reserve(t.tid, total_tokens(t), SeqTokens(t), now, hashes=prompt_hashes(kv, t))
    t.num_cached = t.prefilled = kv.trajectories[t.tid].num_tokens
