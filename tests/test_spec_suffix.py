"""The suffix drafter (ainfer_pd.spec.suffix): drafts from repeats of a trajectory's own context and
from its GRPO siblings' outputs, the longest match first and the most frequent continuation, a
brute-force reference on random sequences, the memory bound (eviction) and forget."""
from __future__ import annotations

import random

import pytest

from ainfer_pd.errors import SpecInputError
from ainfer_pd.spec.suffix import SuffixDrafter, SuffixIndex


def test_a_repeat_in_the_own_context_is_drafted():
    ix = SuffixIndex()
    ix.extend("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert ix.draft("a", 4) == [4, 5, 6, 7]
    assert ix.draft("a", 20) == [4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5]
    assert ix.draft("a", 0) == [] and ix.draft("unknown", 4) == []


def test_a_periodic_context_drafts_through_its_period():
    ix = SuffixIndex()
    ix.extend("p", [9, 8, 5, 6, 7, 5, 6, 7])
    assert ix.draft("p", 8) == [5, 6, 7, 5, 6, 7, 5, 6]


def test_no_earlier_match_no_draft():
    ix = SuffixIndex(min_match=3)
    ix.extend("a", [1, 2, 3, 4, 5, 6])
    assert ix.draft("a", 4) == []
    ix.extend("b", [1, 2])                       # shorter than the key
    assert ix.draft("b", 4) == []


def test_siblings_outputs_are_drafted_and_groups_do_not_mix():
    prompt = [11, 12, 13, 14, 15]
    d = SuffixDrafter()
    d.extend("s1", prompt + [20, 21, 22, 23, 24], group="g")
    d.extend("s2", prompt, group="g")
    d.extend("x", prompt + [30, 31, 32], group="other")
    assert d.draft("s2", 4) == [20, 21, 22, 23]
    d.extend("x2", prompt, group="other")
    assert d.draft("x2", 4) == [30, 31, 32]      # its own group's sibling, to its end
    assert d.draft_batch(["s2", "x2", "none"], [2, 1, 3]) == [[20, 21], [30], []]
    with pytest.raises(SpecInputError, match="group"):
        d.extend("s2", [1], group="other")
    with pytest.raises(SpecInputError, match="draft lengths"):
        d.draft_batch(["s2"], [1, 2])


def test_the_longest_match_wins_then_the_most_frequent_continuation():
    ix = SuffixIndex(min_match=2)
    # "7 8" is followed by 1 three times, but "5 6 7 8" (a longer match) by 2
    ix.extend("a", [7, 8, 1, 0, 7, 8, 1, 0, 7, 8, 1, 0, 5, 6, 7, 8, 2, 3])
    ix.extend("b", [4, 4, 5, 6, 7, 8])
    assert ix.draft("b", 2) == [2, 3]
    # equal matches: the continuation seen most often (two siblings against one)
    ix2 = SuffixIndex()
    ix2.extend("a", [1, 2, 3, 40])
    ix2.extend("b", [1, 2, 3, 50])
    ix2.extend("c", [1, 2, 3, 50])
    ix2.extend("d", [1, 2, 3])
    assert ix2.draft("d", 1) == [50]
    # a tie: the most recent occurrence
    ix3 = SuffixIndex()
    ix3.extend("a", [1, 2, 3, 40])
    ix3.extend("b", [1, 2, 3, 50])
    ix3.extend("d", [1, 2, 3])
    assert ix3.draft("d", 1) == [50]


def _reference_check(seqs: dict, me: str, draft: list[int], k: int, n: int, cap: int) -> None:
    """Brute force: the draft's match is the longest (capped) and each token has the most votes."""
    ctx = seqs[me]
    occ = []
    for sid, s in seqs.items():
        for p in range(n - 1, len(s)):
            own = sid == me
            if (own and p == len(ctx) - 1) or (not own and p + 1 >= len(s)):
                continue
            m = 0
            while m < min(cap, p + 1, len(ctx)) and s[p - m] == ctx[len(ctx) - 1 - m]:
                m += 1
            if m >= n:
                occ.append((m, s, p + 1, own))
    if not occ:
        assert draft == []
        return
    best = max(o[0] for o in occ)
    live = [o[1:] for o in occ if o[0] == best]
    for j in range(k):
        votes = {}
        for s, c, own in live:
            i = c + j
            t = s[i] if i < len(s) else (draft[i - len(ctx)] if own else None)
            if t is not None:
                votes[t] = votes.get(t, 0) + 1
        if not votes:
            assert len(draft) == j
            return
        assert draft[j] in votes and votes[draft[j]] == max(votes.values()), (j, votes, draft)
        live = [(s, c, own) for s, c, own in live
                if (s[c + j] if c + j < len(s) else (draft[c + j - len(ctx)] if own else None)) == draft[j]]
    assert len(draft) == k


def test_drafts_agree_with_a_brute_force_reference():
    rng = random.Random(1)
    for trial in range(60):
        vocab = rng.choice([3, 4, 6])
        ix = SuffixIndex(min_match=2, max_match=6, max_candidates=10_000)
        seqs = {}
        for _ in range(rng.randrange(1, 5)):
            sid = f"s{len(seqs)}"
            seqs[sid] = [rng.randrange(vocab) for _ in range(rng.randrange(2, 40))]
        for sid, s in seqs.items():                           # extended in pieces, interleaved
            cut = rng.randrange(len(s) + 1)
            ix.extend(sid, s[:cut])
            ix.extend(sid, s[cut:])
        for sid in seqs:
            k = rng.randrange(1, 9)
            _reference_check(seqs, sid, ix.draft(sid, k), k, 2, 6)


def test_memory_is_bounded_the_least_recently_extended_go_first():
    ix = SuffixIndex(cap_tokens=256, max_match=8)
    rng = random.Random(2)
    for i in range(40):
        ix.extend(f"s{i}", [rng.randrange(50) for _ in range(30)])
        assert ix.num_tokens <= 256 and ix.occurrences <= ix.num_tokens
    assert "s39" in ix and "s0" not in ix and len(ix) == 256 // 30
    ix.extend("s33", [1, 2, 3])                  # touched: now the last to go
    ix.extend("new", [rng.randrange(50) for _ in range(60)])
    assert "s33" in ix and "s34" not in ix and ix.num_tokens <= 256


def test_one_sequence_over_the_cap_keeps_its_tail():
    ix = SuffixIndex(cap_tokens=128, max_match=8)
    seq = list(range(1000))
    for i in range(0, 1000, 7):
        ix.extend("long", seq[i:i + 7])
        assert ix.num_tokens <= 128 and len(ix.tokens("long")) >= min(i + 7, 64)
    held = ix.tokens("long")
    assert held == seq[-len(held):] and len(held) >= 64
    ix.extend("long", [held[-5], held[-4], held[-3]])   # a repeat inside the tail it kept
    assert ix.draft("long", 2) == [held[-2], held[-1]]


def test_forget_drops_a_sibling_and_its_occurrences():
    d = SuffixDrafter()
    d.extend("a", [1, 2, 3, 4, 5], group="g")
    d.extend("b", [1, 2, 3], group="g")
    assert d.draft("b", 2) == [4, 5]
    before = d.groups["g"].occurrences
    d.forget("a")
    assert d.draft("b", 2) == [] and d.groups["g"].occurrences == before - 3
    d.forget("a")                                 # unknown: a no-op
    d.forget("b")
    assert "g" not in d.groups and d.num_tokens == 0
    d.extend("c", [1, 2, 3, 1, 2], group="h")
    d.forget_group("h")
    assert d.draft("c", 2) == [] and not d.groups


def test_a_released_sibling_drafts_for_the_live_ones_and_the_group_goes_with_the_last(monkeypatch):
    """A GRPO response that ended is what its siblings most likely repeat: its tokens stay in the
    group's index after its release, at no cost (nothing is filtered out of the index), and the
    whole group goes with its last live member."""
    d = SuffixDrafter()
    d.extend("a", [1, 2, 3, 4, 5], group="g")
    d.extend("b", [1, 2, 3], group="g")
    monkeypatch.setattr(SuffixIndex, "forget", lambda self, seq_id: pytest.fail("a release filtered the index"))
    d.release("a")
    assert d.draft("b", 2) == [4, 5]                 # from the released sibling
    d.release("a")                                   # twice: a no-op
    d.release("b")
    assert not d.groups and d.num_tokens == 0 and not (d._group_of or d._live or d._members)
    d.extend("solo", [1, 2, 1, 2])                   # a group of its own goes at its release
    d.release("solo")
    assert not d.groups and not d._group_of
    monkeypatch.undo()
    d.extend("a", [1, 2, 3, 4, 5], group="g")
    d.extend("b", [9, 9], group="g")
    d.release("a")
    d.extend("a", [7, 8], group="g")                 # a released id extended again: a new sequence
    assert d.groups["g"].tokens("a") == [7, 8]
    d.forget("b")                                    # a rollback's forget: a is the live member left
    assert d.groups["g"].tokens("a") == [7, 8] and "b" not in d.groups["g"]
    d.forget("a")
    assert not d.groups and not (d._group_of or d._live or d._members)


def test_bad_tokens_and_arguments_are_refused():
    ix = SuffixIndex()
    with pytest.raises(SpecInputError, match="non-negative"):
        ix.extend("a", [1, -2])
    with pytest.raises(SpecInputError, match="integers"):
        ix.extend("a", [1, 2.5])
    with pytest.raises(SpecInputError, match="integers"):
        ix.extend("a", [1 << 40])
    with pytest.raises(SpecInputError, match="min_match"):
        SuffixIndex(min_match=5, max_match=4)
    with pytest.raises(SpecInputError, match="cap_tokens"):
        SuffixDrafter(cap_tokens=10)


@pytest.mark.parametrize("min_match", [1, 3, 5])
def test_a_bulk_extend_indexes_as_token_by_token_extends(min_match):
    """An extend of many tokens builds its keys in bulk (``_gram_keys``), a short one per position:
    the same index (keys, occurrences, their order and the per-key cap) either way, and forget
    removes every key the bulk path added."""
    rng = random.Random(min_match)
    seq = [rng.randrange(6) for _ in range(400)]            # a small vocabulary: keys repeat past the cap
    bulk, one, mixed = (SuffixIndex(min_match=min_match, max_candidates=8) for _ in range(3))
    bulk.extend("a", seq)
    for t in seq:
        one.extend("a", [t])
    for i in range(0, len(seq), 37):
        mixed.extend("a", seq[i:i + 37])
    assert bulk._index == one._index == mixed._index and bulk.occurrences == one.occurrences
    bulk.extend("b", seq[:50])
    bulk.forget("a")
    bulk.forget("b")
    assert not bulk._index and len(bulk) == 0


def test_an_n_gram_seen_once_holds_an_int_and_one_seen_again_a_list():
    """The index's occurrences: one int for an n-gram seen once (no list: no GC-tracked object a
    token), a list once it is seen again; drafting and forgetting read both."""
    ix = SuffixIndex(min_match=2)
    ix.extend("a", [1, 2, 3, 4, 1, 2])
    kinds = sorted(type(v).__name__ for v in ix._index.values())
    assert kinds == ["int", "int", "int", "list"] and ix.occurrences == 5
    assert ix.draft("a", 3) == [3, 4, 1]
    ix.extend("b", [3, 4, 9])
    assert ix.draft("b", 2) == [] and ix.occurrences == 7
    ix.forget("a")
    assert ix.occurrences == 2 and all(type(v) is int for v in ix._index.values())
    one = SuffixIndex(min_match=1, max_candidates=1)          # a cap of 1: the newest occurrence, an int
    one.extend("c", [5, 6, 5, 7, 5])
    assert all(type(v) is int for v in one._index.values())
    assert one.draft("c", 1) == []                           # (5,)'s newest occurrence is the context's own end
    one.extend("c", [8])
    assert one.draft("c", 1) == [] and one._index[hash((5,))] == 4


def test_siblings_sharing_a_prompt_index_it_once_and_draft_as_if_each_did(monkeypatch):
    """GRPO siblings start with the same prompt: the second and later index only what follows it
    (``SHARE_MIN``+ shared first tokens), the first's positions serve them, and their drafts are
    what indexing every copy gives. Forgetting the sibling that holds the prompt's positions hands
    them to the others (they index it themselves), drafts unchanged."""
    import ainfer_pd.spec.suffix as sx
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(300)]
    outs = {f"s{i}": [rng.randrange(1000) for _ in range(20)] + prompt[100:104] for i in range(4)}

    def build(share: bool) -> SuffixIndex:
        monkeypatch.setattr(sx, "SHARE_MIN", 64 if share else 10**9)
        ix = SuffixIndex()
        for sid, out in outs.items():
            ix.extend(sid, prompt)
            ix.extend(sid, out)
        return ix
    shared, full = build(True), build(False)
    assert full.occurrences - shared.occurrences == 3 * (len(prompt) - 2)     # 3 copies of the prompt not indexed
    for sid in outs:                                   # each output ends on a prompt 4-gram: its continuation
        assert shared.draft(sid, 5) == full.draft(sid, 5) == prompt[104:109]
    monkeypatch.setattr(sx, "SHARE_MIN", 64)
    shared.forget("s0")                                # held the prompt's positions for s1..s3
    full.forget("s0")
    assert full.occurrences - shared.occurrences == 2 * (len(prompt) - 2)     # s1 holds them now
    for sid in ("s1", "s2", "s3"):
        assert shared.draft(sid, 5) == full.draft(sid, 5) == prompt[104:109]
    assert not shared._base or all(of in shared._tokens for of, _ in shared._base.values())
