"""Model-free drafts: the continuation of the longest earlier match of a trajectory's context suffix,
in its own context or in its GRPO siblings' (issue 38; SuffixDecoding, Seer's grouped drafts).

A :class:`SuffixIndex` holds one group: the sequences of trajectories that share a first prompt
(the worker's ``Trajectory.group``), each extended as its tokens are produced. :meth:`draft`
looks up the occurrences of the context's last ``min_match`` tokens, measures how far back each
one agrees with the context (up to ``max_match``), keeps the longest agreeing ones, and builds the
draft token by token from their continuations by majority (ties: the most recent occurrence). An
occurrence in the row's own sequence may run into its end: it then continues with the draft built
so far (a repeating pattern drafts through its period).

Why an n-gram index with hash-chained position lists, not a suffix automaton or a suffix tree:
both find the longest match in O(match), but a suffix automaton cannot forget a sequence (the
memory cap and ``forget`` would rebuild it) and a depth-D suffix tree adds up to D Python nodes per
token (a few KB each in CPython). Here a token costs one tuple hash and one dict lookup to add
(the keys built in bulk by :func:`_gram_keys`: 0.65 ms for 2,048 tokens on the CPU VM), and about
4 B (its id in an ``array``) plus its occurrence: an n-gram seen once holds one int (the dict
slot and the int, no list: most n-grams of sampled text occur once, and a list each was one
GC-tracked object a token), one seen more a list of them. ~106 B per token on random tokens,
~70 B on a repetitive trace (``benchmarks/suffix_draft_bench.py``; 169 / 88 B with a list per
n-gram). The longest
match is exact among the ``max_candidates`` most recent occurrences of the key (older ones are
dropped from the key's list); its length is found by comparing ``array`` slices (a binary search,
C-level compares), so a draft is O(candidates x (log max_match + k)) Python steps.

Memory is bounded per group: past ``cap_tokens`` the least recently extended sequences are
evicted (finished siblings first; a sequence extended after its eviction starts again from the
new tokens); one sequence longer than the cap keeps its last ``cap_tokens // 2`` tokens.
Forgetting removes a sequence's occurrences eagerly (one int check or list filter per distinct key it holds).
Siblings' shared prompt is indexed once: a new sequence whose first ``SHARE_MIN``+ tokens repeat a held one's
indexes only what follows them (a group of 9 GRPO rows indexes its prompt once, not 9 times).
Drafts are suggestions: verification (:mod:`.verify`) makes the output exact whatever they are.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

from ..errors import SpecInputError

MIN_MATCH = 3
"""Context tokens a draft's match must agree on (the index's key length)."""
MAX_MATCH = 32
"""Longest agreement measured (a longer one counts as this long)."""
MAX_CANDIDATES = 32
"""Most recent occurrences kept, and scanned, per key."""
CAP_TOKENS = 1 << 16
"""Tokens one group keeps before evicting its least recently extended sequences."""

SHARE_MIN = 64
"""A new sequence whose first tokens repeat this many or more of a held one's (a GRPO sibling's
prompt) indexes only what follows them: the held sequence's occurrences serve both."""
_BULK = 8
"""Past this many new tokens an extend builds its keys in bulk (:func:`_gram_keys`)."""
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


class SuffixIndex:
    """One group's sequences (a trajectory and its GRPO siblings) and the index over them."""

    def __init__(self, *, cap_tokens: int = CAP_TOKENS, min_match: int = MIN_MATCH,
                 max_match: int = MAX_MATCH, max_candidates: int = MAX_CANDIDATES) -> None:
        if not 1 <= min_match <= max_match:
            raise SpecInputError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_candidates < 1 or cap_tokens < 2 * max_match:
            raise SpecInputError(f"need max_candidates >= 1 and cap_tokens >= 2 * max_match, got "
                                 f"{max_candidates}, {cap_tokens}")
        self.cap_tokens, self.min_match, self.max_match = cap_tokens, min_match, max_match
        self.max_candidates = max_candidates
        self._slot: dict[object, int] = {}          # seq id -> slot (dict order: least recently extended first)
        self._tokens: dict[int, array] = {}         # slot -> its token ids
        self._index: dict[int, list[int]] = {}      # hash of an n-gram -> (slot << 32 | last position), oldest first
        self._base: dict[int, tuple[int, int]] = {}  # slot -> (the slot holding its first m tokens, m): not indexed here
        self._next_slot = 0
        self.num_tokens = 0

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def occurrences(self) -> int:
        """Positions indexed (at most one per token held)."""
        return sum(1 if occ.__class__ is int else len(occ) for occ in self._index.values())

    def tokens(self, seq_id: object) -> list[int]:
        """The tokens held for ``seq_id`` (empty if none)."""
        slot = self._slot.get(seq_id)
        return [] if slot is None else self._tokens[slot].tolist()

    def extend(self, seq_id: object, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to ``seq_id``'s sequence (a new one if unknown) and index them. A new
        sequence sharing its first ``SHARE_MIN``+ tokens with a held one indexes only the rest."""
        new = _checked(tokens)
        slot = self._slot.pop(seq_id, None)
        shared = 0
        if slot is None:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._tokens[slot] = array("i")
            shared = self._share(slot, new)
        self._slot[seq_id] = slot                   # most recently extended: last to go
        seq = self._tokens[slot]
        start = len(seq)
        seq.extend(new)
        self.num_tokens += len(new)
        self._index_from(slot, max(start, shared, self.min_match - 1))
        if self.num_tokens > self.cap_tokens:
            self._evict(seq_id)

    def _share(self, slot: int, new: array) -> int:
        """The most first tokens ``new`` shares with a held sequence, if ``SHARE_MIN`` or more (that
        sequence's positions index them for ``slot`` too; 0: none)."""
        best, of = 0, None
        for s, seq in self._tokens.items():
            if s != slot and len(seq) >= SHARE_MIN:
                m = _common_prefix(seq, new)
                if m > best:
                    best, of = m, s
        if best < SHARE_MIN:
            return 0
        self._base[slot] = (of, best)
        return best

    def _index_from(self, slot: int, first: int, end: int | None = None) -> None:
        """Index ``slot``'s n-grams ending at positions ``first`` .. ``end`` - 1 (default: its end)."""
        seq = self._tokens[slot]
        if end is not None:
            seq = seq[:end]
        index, cap, base = self._index, self.max_candidates, slot << _POS_BITS
        for p, key in enumerate(_gram_keys(seq, first, self.min_match), first):
            occ = index.get(key)
            if occ is None:                   # most n-grams occur once: a plain int, no list
                index[key] = base | p
            elif occ.__class__ is int:
                index[key] = [occ, base | p] if cap > 1 else base | p
            else:
                occ.append(base | p)
                if len(occ) > cap:
                    del occ[0]

    def forget(self, seq_id: object) -> None:
        """Drop ``seq_id``'s sequence and its occurrences (no-op if unknown). A sequence whose first
        tokens it held for (:meth:`_share`) indexes them itself now."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return
        self._base.pop(slot, None)
        heir = None
        for d, (of, m) in list(self._base.items()):
            if of != slot:
                continue
            if heir is None:                          # the first indexes its shared tokens itself
                heir, hm = d, m
                del self._base[d]
                self._index_from(d, self.min_match - 1, m)
            else:                                     # the others lean on it, up to what they share
                self._base[d] = (heir, min(m, hm))
                self._index_from(d, max(self.min_match - 1, min(m, hm)), m)
        seq = self._tokens.pop(slot)
        self.num_tokens -= len(seq)
        n = self.min_match
        for key in set(_gram_keys(seq, n - 1, n)):
            occ = self._index.get(key)
            if occ is None:
                continue
            if occ.__class__ is int:
                if occ >> _POS_BITS == slot:
                    del self._index[key]
                continue
            left = [e for e in occ if e >> _POS_BITS != slot]
            if not left:
                del self._index[key]
            elif len(left) == 1:
                self._index[key] = left[0]
            else:
                occ[:] = left

    def draft(self, seq_id: object, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``seq_id``'s sequence ([] when no earlier occurrence
        of its last ``min_match`` tokens has a continuation)."""
        slot = self._slot.get(seq_id)
        if slot is None or k <= 0:
            return []
        ctx = self._tokens[slot]
        L, n = len(ctx), self.min_match
        if L < n:
            return []
        occ = self._index.get(hash(tuple(ctx[L - n:])))
        if occ is None:
            return []
        if occ.__class__ is int:
            occ = (occ,)
        starts = self._longest(ctx, slot, occ)
        return self._vote(ctx, starts, k) if starts else []

    # ------------------------------------------------------------------------------ internals
    def _longest(self, ctx: array, slot: int, occ: list[int]) -> list[tuple[array, int, bool]]:
        """(sequence, continuation start, own sequence?) of the occurrences agreeing longest with
        the end of ``ctx``, newest first."""
        L, best, out = len(ctx), 0, []
        for e in reversed(occ):
            s, p = e >> _POS_BITS, e & _POS_MASK
            own = s == slot
            if own and p == L - 1:
                continue                              # the context's own end
            seq = ctx if own else self._tokens[s]
            if p + 1 >= len(seq):
                continue                              # a sibling's end: nothing follows yet
            m = self._agreement(seq, p, ctx)
            if m > best:
                best, out = m, [(seq, p + 1, own)]
            elif m == best and m:
                out.append((seq, p + 1, own))
        return out

    def _agreement(self, seq: array, p: int, ctx: array) -> int:
        """How many tokens ending at ``seq[p]`` equal the end of ``ctx`` (0 below ``min_match``)."""
        L, n = len(ctx), self.min_match
        if seq[p + 1 - n:p + 1] != ctx[L - n:]:
            return 0                                  # a hash collision
        hi = min(self.max_match, p + 1, L)
        if seq[p + 1 - hi:p + 1] == ctx[L - hi:]:
            return hi
        lo = n                                        # agrees on lo tokens, not on hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if seq[p + 1 - mid:p + 1] == ctx[L - mid:]:
                lo = mid
            else:
                hi = mid
        return lo

    def _vote(self, ctx: array, starts: list[tuple[array, int, bool]], k: int) -> list[int]:
        """The draft: at each step the token most of the still-agreeing continuations take."""
        out: list[int] = []
        L, live = len(ctx), starts
        for j in range(k):
            if len(live) == 1 and not live[0][2]:
                seq, c, _ = live[0]
                out.extend(seq[c + j:c + k])          # one continuation left: copy it
                break
            votes: dict[int, int] = {}
            nxt = []
            for entry in live:
                seq, c, own = entry
                i = c + j
                if i < len(seq):
                    t = seq[i]
                elif own:
                    t = out[i - L]                    # through the context's end: the draft so far
                else:
                    continue
                votes[t] = votes.get(t, 0) + 1
                nxt.append((t, entry))
            if not votes:
                break
            tok = max(votes, key=votes.__getitem__)   # ties: the newest occurrence's token
            out.append(tok)
            live = [e for t, e in nxt if t == tok]
        return out

    def _evict(self, keep: object) -> None:
        """Back under the cap: the least recently extended sequences go first (not ``keep``);
        ``keep`` alone over the cap restarts from its last ``cap_tokens // 2`` tokens."""
        for sid in list(self._slot):
            if self.num_tokens <= self.cap_tokens:
                return
            if sid != keep:
                self.forget(sid)
        if self.num_tokens > self.cap_tokens:
            tail = self._tokens[self._slot[keep]][-(self.cap_tokens // 2):]
            self.forget(keep)
            self.extend(keep, tail)


class SuffixDrafter:
    """Drafts for many trajectories: one :class:`SuffixIndex` per group of siblings. A trajectory
    joins its group on its first :meth:`extend` (``group=None``: a group of its own) and is one of
    the group's live members until :meth:`release`; a released member's tokens stay in the index for
    its siblings (an ended GRPO response is what the others are most likely to repeat), and the
    group goes, whole, with its last live member."""

    def __init__(self, **index_kw) -> None:
        self._index_kw = index_kw
        SuffixIndex(**index_kw)                       # check the arguments once, here
        self.groups: dict[object, SuffixIndex] = {}
        self._group_of: dict[object, object] = {}     # every sequence held, live or released
        self._members: dict[object, set] = {}         # group -> every sequence held (live or released)
        self._live: dict[object, set] = {}            # group -> its live members

    def extend(self, seq_id: object, tokens: Iterable[int], *, group: object = None) -> None:
        g = self._group_of.get(seq_id)
        if g is None:
            g = seq_id if group is None else group
            self._group_of[seq_id] = g
            self._members.setdefault(g, set()).add(seq_id)
        elif group is not None and group != g:
            raise SpecInputError(f"sequence {seq_id!r} is in group {g!r}, not {group!r}")
        idx = self.groups.get(g)
        if idx is None:
            idx = self.groups[g] = SuffixIndex(**self._index_kw)
        live = self._live.setdefault(g, set())
        if seq_id not in live:
            if seq_id in idx:                         # a released id extended again: a new sequence
                idx.forget(seq_id)
            live.add(seq_id)
        idx.extend(seq_id, tokens)

    def release(self, seq_id: object) -> None:
        """The sequence's trajectory ended: it drafts no more, its tokens stay for its live siblings;
        with the group's last live member the whole group goes (nothing is filtered out of an index:
        a release costs O(1), the group's end O(members))."""
        g = self._group_of.get(seq_id)
        if g is None:
            return
        live = self._live.get(g)
        if live is not None:
            live.discard(seq_id)
        if not live:
            self.forget_group(g)

    def forget(self, seq_id: object) -> None:
        """Drop a sequence and its occurrences (a rolled-back sequence: its tokens are wrong); its
        siblings keep drafting from theirs; a group without live members goes."""
        g = self._group_of.pop(seq_id, None)
        if g is None:
            return
        idx = self.groups[g]
        idx.forget(seq_id)
        self._members[g].discard(seq_id)
        live = self._live.get(g)
        if live is not None:
            live.discard(seq_id)
        if not len(idx) or not live:
            self.forget_group(g)                      # (a member evicted from it starts it again)

    def forget_group(self, group: object) -> None:
        """Drop a whole group (all its siblings ended)."""
        self.groups.pop(group, None)
        self._live.pop(group, None)
        for sid in self._members.pop(group, ()):
            del self._group_of[sid]

    def draft(self, seq_id: object, k: int) -> list[int]:
        g = self._group_of.get(seq_id)
        return [] if g is None else self.groups[g].draft(seq_id, k)

    def draft_batch(self, seq_ids: list, ks: int | list[int]) -> list[list[int]]:
        """One draft per row (``ks``: one k for all, or one per row)."""
        if isinstance(ks, int):
            ks = [ks] * len(seq_ids)
        if len(ks) != len(seq_ids):
            raise SpecInputError(f"{len(seq_ids)} rows but {len(ks)} draft lengths")
        return [self.draft(s, k) for s, k in zip(seq_ids, ks)]

    @property
    def num_tokens(self) -> int:
        return sum(idx.num_tokens for idx in self.groups.values())


def _gram_keys(seq: array, first: int, n: int) -> Iterator[int]:
    """The index keys of the n-grams of ``seq`` ending at positions ``first`` .. ``len(seq) - 1``
    (``first >= n - 1``): ``hash`` of each n-gram's tuple, the tuples built by ``zip`` over n
    shifted slices (C loops: half the time of slicing one tuple per position, which was most of a
    first probe's indexing of a row's context)."""
    if len(seq) - first <= _BULK:          # a few tokens (a decode step's): one slice each
        return [hash(tuple(seq[p - n + 1:p + 1])) for p in range(first, len(seq))]
    end = len(seq) - n + 1
    return map(hash, zip(*(seq[first - n + 1 + j:end + j] for j in range(n))))


def _common_prefix(a: array, b: array) -> int:
    """How many first tokens ``a`` and ``b`` share (array slice compares: C loops, log steps)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _checked(tokens: Iterable[int]) -> array:
    try:
        out = array("i", tokens)
    except (TypeError, OverflowError) as e:
        raise SpecInputError(f"token ids must be integers in [0, 2**31): {e}") from None
    if out and min(out) < 0:
        raise SpecInputError(f"token ids must be non-negative, got {min(out)}")
    return out
