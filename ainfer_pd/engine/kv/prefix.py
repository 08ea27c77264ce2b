"""The engine's side of the prefix cache: what a waiting turn would reuse, demand and reserve.

The admission rule itself stays in one place (:func:`ainfer_pd.sched.planner.fits` over
:meth:`KVCacheManager.admission_demand` / :meth:`KVCacheManager.pool_blocks`); this module only
feeds it a turn's prompt, with the prompt's block hashes computed once per turn.
"""
from __future__ import annotations

import dataclasses

from ...sched.output_reserve import OutputReserve, expected_tokens, reserve_tokens
from ...sched.planner import PendingPrefill
from .block_hash import worth_waiting
from .kv_cache import KVCacheManager
from ..loop.state import SeqTokens, Turn


def prompt_hashes(kv: KVCacheManager, t: Turn) -> list:
    """The chained hashes of ``t``'s prompt blocks (cached on the turn: its prompt never changes)."""
    if t.prompt_hashes is None:
        t.prompt_hashes = kv.prompt_hashes(t.prompt, tid=t.tid)
    return t.prompt_hashes


def left(t: Turn) -> int:
    """Output tokens ``t`` may still generate."""
    return t.params.max_new_tokens - len(t.out_tokens)


def total_tokens(t: Turn, r: OutputReserve) -> int:
    """Positions ``t``'s admission reserves (``cache.reserve_output``)."""
    return reserve_tokens(r, len(t.prompt), left(t))


def demand_tokens(t: Turn, r: OutputReserve, ratio: float) -> int:
    """Positions the admission check counts for ``t``: its reservation plus, when output grows on
    demand, what it is expected to write beyond it."""
    return expected_tokens(r, len(t.prompt), left(t), ratio)


def pending_view(kv: KVCacheManager, turns, r: OutputReserve, ratio: float) -> list[PendingPrefill]:
    """The planner's view of the waiting ``turns`` (FIFO), without those that should wait for a
    sibling writing the first block they miss: an admitted turn (``kv.writing``) or one ahead of
    them in this view, whose prompt blocks it will write (they share that block once the
    sibling's pass completed, instead of computing it again in the same epoch; only when at least
    ``kv.wait_min_tokens`` would be shared).

    Each turn's :meth:`~KVCacheManager.admission_view` is kept on the turn and reused while
    ``kv.version`` is unchanged (the D loop asks for this view every iteration; a view walks the
    prompt's blocks). Chained hashes make one key per sibling group enough for the turns ahead:
    two prompts whose first missing blocks have the same hash agree on every block before it."""
    out: list[PendingPrefill] = []
    ahead: dict = {}                    # first missing block of a turn ahead -> (its hashes, index)
    wanted: set = set()
    bs, min_tokens = kv.block_size, kv.wait_min_tokens
    for t in turns:
        if t.lifetime:
            out.append(PendingPrefill(t.request_id, t.remaining_prompt, True, 0))
            continue
        hashes = prompt_hashes(kv, t)
        v = _view(kv, t, hashes, r, ratio)
        h = v.next_hash
        if h is not None:
            wanted.add(h)
        if kv.sharing and h is not None:
            i = v.num_shared
            front = ahead.get(h)
            if v.waits or front is not None:
                n = max(_run(hashes, i, kv.writing) if v.waits else 0,
                        _common(hashes, i, *front) if front is not None else 0)
                if worth_waiting(n, bs, min_tokens):
                    continue
            ahead.setdefault(h, (hashes, i))
        out.append(PendingPrefill(t.request_id, len(t.prompt) - v.cached, False, v.demand))
    kv.wanted = wanted
    return out


def prefill_left(kv: KVCacheManager, t: Turn) -> int:
    """Prompt tokens ``t`` still has to prefill: the rest of an admitted turn, else its prompt
    less the prefix the cache holds for it now (the prompt's view, memoized)."""
    if t.lifetime:
        return t.remaining_prompt
    return len(t.prompt) - _prompt_view(kv, t, prompt_hashes(kv, t)).cached


def _prompt_view(kv: KVCacheManager, t: Turn, hashes: list):
    """The admission view of ``t``'s prompt alone, kept on the turn while ``kv.version`` is
    unchanged (the walk over its prompt blocks; the demand of any reservation follows from it)."""
    memo = t.prefix_view
    if memo is not None and memo[0] == kv.version:
        return memo[1]
    v = kv.admission_view(t.tid, len(t.prompt), t.prompt, hashes)
    t.prefix_view = (kv.version, v, None, None)
    return v


def _view(kv: KVCacheManager, t: Turn, hashes: list, r: OutputReserve, ratio: float):
    """The admission view of ``t`` at the demand ``r`` and ``ratio`` give: the prompt's view (a
    memoized walk) plus the blocks past the prompt the demand adds (every shared block lies inside
    the prompt, so the prompt's demand is its blocks less the shared ones held elsewhere). Kept
    on the turn beside the prompt's view while the demand is unchanged (the D loop asks every
    iteration)."""
    need = demand_tokens(t, r, ratio)
    memo = t.prefix_view
    if memo is not None and memo[0] == kv.version and memo[2] == need:
        return memo[3]
    v = _prompt_view(kv, t, hashes)
    more = kv.alloc.blocks_for(need) - kv.alloc.blocks_for(len(t.prompt))
    out = dataclasses.replace(v, demand=v.demand + more) if more > 0 else v
    t.prefix_view = (kv.version, v, need, out)
    return out


def _run(hashes: list, i: int, writing) -> int:
    """Blocks ``hashes[i:]`` that admitted siblings will write, from ``i`` on."""
    n = 0
    while i + n < len(hashes) and hashes[i + n] in writing:
        n += 1
    return n


def _common(hashes: list, i: int, other: list, j: int) -> int:
    """Blocks ``hashes[i:]`` shares with ``other[j:]`` (a turn ahead, which will write them)."""
    n = 0
    while i + n < len(hashes) and j + n < len(other) and hashes[i + n] == other[j + n]:
        n += 1
    return n


def demand(kv: KVCacheManager, t: Turn, r: OutputReserve, ratio: float) -> int:
    """Blocks ``t``'s admission takes out of the pool, as the admission check counts them."""
    return _view(kv, t, prompt_hashes(kv, t), r, ratio).demand


def reserve(kv: KVCacheManager, t: Turn, now: float, r: OutputReserve) -> None:
    """Admit ``t``: reserve its blocks sharing its cached prefix; ``t.prefilled`` (and, at its
    first admission, ``t.num_cached``) become the tokens reused (only the rest is prefilled)."""
    t.lifetime = kv.reserve(t.tid, total_tokens(t, r), SeqTokens(t), now, hashes=prompt_hashes(kv, t))
    t.prefilled = kv.trajectories[t.tid].num_tokens
    if not t.preemptions:
        t.num_cached = t.prefilled
