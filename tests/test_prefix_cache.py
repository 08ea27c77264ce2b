"""Prefix sharing across trajectories (issue 15): content-addressed KV blocks, reference counts,
LRU of unreferenced blocks. The cache under a stateful property test with a shadow of the KV
content (what every slot holds, by the prefix that produced it), then the engine: GRPO siblings
prefill their prompt once, outputs equal a run without sharing, eviction under pressure loses
nothing and leaks nothing."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.kv.block_hash import ROOT, best_tail, block_hash, chain_hashes, release_order
from ainfer_pd.engine.kv import prefix
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import CapacityError, LifetimeError
from ainfer_pd.sched.planner import fits
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

BS = 4
NB = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


# ====================================================================== policy (pure)
def test_block_hashes_chain_over_the_prefix():
    a = list(range(10))
    b = a[:4] + [99] + a[5:]
    ha, hb = chain_hashes(a, 4, 10), chain_hashes(b, 4, 10)
    assert len(ha) == 2 and ha[0] == hb[0] and ha[1] != hb[1]        # same first block, then diverged
    assert ha[1] == block_hash(ha[0], a[4:8]) and ha[0] == block_hash(ROOT, a[:4])
    assert chain_hashes(a, 4, 7) == ha[:1]                          # only full blocks within the limit
    # same tokens after a different prefix: a different address
    assert block_hash(ha[0], a[4:8]) != block_hash(ROOT, a[4:8])


def test_the_tail_choice_takes_the_longest_common_prefix_and_the_release_order_frees_tails_first():
    assert best_tail([(5, (1, 2)), (3, (1, 2, 3)), (9, (7,))], [1, 2, 3, 4]) == (3, 3)
    assert best_tail([(5, (1, 2)), (3, (1, 2))], [1, 2]) == (3, 2)  # ties: the lower block id
    assert best_tail([(5, (2,))], [1]) is None
    assert release_order([4, 8, 1]) == [1, 8, 4]


# ====================================================================== the cache, stateful
_FAMILY = [[(13 * f + 7 * i) % 97 + 2 for i in range(64)] for f in range(3)]


def _content(tokens, p: int) -> int:
    """What the KV at position ``p`` of a sequence depends on: every token up to it."""
    return hash(tuple(tokens[:p + 1]))


class CacheMachine(RuleBasedStateMachine):
    """Random reservations (prompts of 3 families with forks: shared prefixes), passes that write
    KV, decode steps that extend a sequence, finishes, aborts, weight changes, drops, on a cache
    of 16 blocks of 4 tokens (eviction all the time). A shadow "device" records what each slot
    holds; the invariants: the reused prefix of every reservation holds exactly its tokens' KV,
    a held block is never handed out again (its content never changes under its holders), the
    admission rule is exact, the accounting is consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NB, BS)
        self.shadow: dict[int, int] = {}       # slot -> content written there
        self.seqs: dict[str, dict] = {}         # tid -> {"tokens", "lifetime", "written"}
        self.n = 0

    def _slot(self, tid: str, p: int) -> int:
        return self.kv.slot_of(tid, p)

    def _write(self, tid: str, upto: int) -> None:
        s = self.seqs[tid]
        kvs = self.kv.trajectories[tid]
        for p in range(s["written"], upto):
            b = kvs.blocks[p // BS]
            # NOTE: a pass only ever writes into the sequence's private blocks, never a shared one
            assert self.kv.alloc.owner[b] == s["lifetime"] and b not in self.kv.alloc.hash_of
            self.shadow[self._slot(tid, p)] = _content(s["tokens"], p)
        s["written"] = max(s["written"], upto)
        self.kv.mark_written(tid, s["lifetime"], upto)

    @rule(fam=st.integers(0, 2), n=st.integers(2, 40), fork=st.integers(0, 9), extra=st.integers(1, 12))
    def reserve(self, fam: int, n: int, fork: int, extra: int) -> None:
        toks = list(_FAMILY[fam][:n])
        if fork and BS * fork < n:
            toks[BS * fork] = 1
        tid = f"s{self.n}"
        self.n += 1
        total = n + extra
        demand, pool = self.kv.admission_demand(tid, total, toks), self.kv.pool_blocks()
        try:
            lt = self.kv.reserve(tid, total, toks, now=float(self.n))
        except CapacityError:
            assert not fits(demand, pool)
            return
        assert fits(demand, pool)
        kept = self.kv.trajectories[tid].num_tokens
        assert kept <= n - 1
        assert kept == self.kv.cached_prefix(toks) or True      # (the cache changed: the reservation took it)
        for p in range(kept):                                    # the reused KV is exactly this prefix's
            assert self.shadow.get(self._slot(tid, p)) == _content(toks, p), (tid, p, kept)
        self.seqs[tid] = {"tokens": toks, "lifetime": lt, "written": kept}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0.0, 1.0))
    def prefill(self, data, frac: float) -> None:
        tid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[tid]
        n = len(s["tokens"])
        upto = s["written"] + int((n - s["written"]) * frac)
        self._write(tid, upto)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tok=st.integers(2, 98))
    def decode(self, data, tok: int) -> None:
        tid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[tid]
        kvs = self.kv.trajectories[tid]
        if s["written"] < len(s["tokens"]) - 1 or len(s["tokens"]) >= len(kvs.blocks) * BS:
            return
        self._write(tid, len(s["tokens"]))        # feed the last token
        s["tokens"].append(tok)                   # the sampled one (the manager sees the same list)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), abort=st.booleans(), complete=st.booleans())
    def end(self, data, abort: bool, complete: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.seqs)))
        if complete and not abort:              # a finished turn: its prompt was all prefilled
            self._write(tid, len(self.seqs[tid]["tokens"]) - 1)
        s = self.seqs.pop(tid)
        (self.kv.abort_turn if abort else self.kv.finish_turn)(tid, s["lifetime"], s["written"], 0.0)

    @rule(roll=st.integers(0, 15))
    def weights_changed(self, roll: int) -> None:
        if roll == 0:                # rare: it empties the cache
            self.kv.invalidate()
            self.shadow.clear()      # every slot's content is now of the old weights: never reusable

    @rule(roll=st.integers(0, 15))
    def drop(self, roll: int) -> None:
        if roll == 0:
            self.kv.drop_cached()

    @invariant()
    def consistent(self) -> None:
        assert self.kv.check_no_leak(), self.kv.audit()
        assert self.kv.num_free_blocks + sum(1 for b in range(NB) if self.kv.alloc.ref[b]) == NB
        for tid, s in self.seqs.items():             # held content never changes under its holders
            kvs = self.kv.trajectories[tid]
            for p in range(s["written"]):
                if not kvs.stale:
                    assert self.shadow.get(self._slot(tid, p)) == _content(s["tokens"], p), (tid, p)

    def teardown(self) -> None:
        for tid, s in list(self.seqs.items()):
            self.kv.finish_turn(tid, s["lifetime"], s["written"], 0.0)
        assert self.kv.check_no_leak() and self.kv.num_free_blocks == NB


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None, derandomize=True,
                                     database=None, suppress_health_check=[HealthCheck.too_slow])


# ====================================================================== the engine
async def _siblings(cfg, prompt: list[int], n: int, params: list[SamplingParams]):
    async with RolloutWorker(cfg) as w:
        outs = await asyncio.wait_for(asyncio.gather(*[
            w.generate(prompt, p, trajectory_id=f"g{i}") for i, p in enumerate(params)]), 60)
        m = w.metrics()
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks
    return outs, m


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "mixed-chunked"])
async def test_grpo_siblings_prefill_the_prompt_once_and_equal_a_run_without_sharing(policy):
    """n = 8 samples of one prompt, submitted together (as verl's GRPO rollout does): the first
    prefills the prompt, the other 7 wait for it and share its blocks; seeded sampling gives
    the same tokens as 8 unshared prefills."""
    prompt = rand_ids(random.Random(21), 203)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(8)]
    shared, m = await _siblings(tiny_cfg(**{"scheduler.policy": policy}), prompt, 8, params)
    alone, m0 = await _siblings(tiny_cfg(**{"scheduler.policy": policy, "cache.prefix_sharing": False}),
                                prompt, 8, params)
    assert [o.token_ids for o in shared] == [o.token_ids for o in alone]
    bs = 16
    full = (len(prompt) - 1) // bs * bs                                # 192: every full block but the last token's
    cached = sorted(o.num_cached_tokens for o in shared)
    assert cached == [0] + [full] * 7, cached
    assert [o.num_cached_tokens for o in alone] == [0] * 8
    assert m["prefix_reused_tokens"] == 7 * full and m0["prefix_reused_tokens"] == 0
    # prefill work: the prompt once, plus 7 tails of 11 tokens
    assert m["prefill_tokens"] == len(prompt) + 7 * (len(prompt) - full)
    assert m0["prefill_tokens"] == 8 * len(prompt)


async def test_a_new_request_id_for_the_same_context_reuses_it_and_greedy_outputs_match():
    cfg = tiny_cfg()
    model = build_model(cfg.model)
    rng = random.Random(22)
    prompt = rand_ids(rng, 70)
    async with RolloutWorker(cfg) as w:
        a = await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        ctx = prompt + a.token_ids + rand_ids(rng, 9)       # verl's router: a new id every turn
        b = await w.generate(ctx, SamplingParams(max_new_tokens=6, **GREEDY))
        assert b.trajectory_id != a.trajectory_id
        assert b.num_cached_tokens == len(prompt) + len(a.token_ids) - 1
        assert b.token_ids == recompute_greedy(model, cfg, ctx, 6)[0]
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()


def test_a_later_prompt_keeps_the_hashes_of_the_blocks_an_earlier_one_had():
    """``prompt_hashes(known=)``: the blocks repeating the known prompt keep its hashes, only the
    rest are hashed, and the result is the full computation's; a known prompt whose tokens differ
    is not used (the whole prompt hashed)."""
    import ainfer_pd.engine.kv.block_hash as bh
    kv = KVCacheManager(NB, BS)
    first = list(range(30))
    known = (first[:28], kv.prompt_hashes(first))                      # 7 full blocks within 29 tokens
    later = first + [7] * 21
    calls, real = [], bh.block_hash
    bh.block_hash = lambda parent, toks: calls.append(1) or real(parent, toks)
    try:
        got = kv.prompt_hashes(later, known=known)
        assert len(calls) == 12 - 7                                    # blocks 7 .. 11 of 50 tokens only
        assert got == kv.prompt_hashes(later)
        other = [1] + later[1:]
        assert kv.prompt_hashes(other, known=known) == kv.prompt_hashes(other) != got
        assert kv.prompt_hashes(later, tid="t", known=known) == kv.prompt_hashes(later, tid="t")
    finally:
        bh.block_hash = real
    solo = KVCacheManager(NB, BS, sharing=False)                       # the root is the trajectory's
    own = (first[:28], solo.prompt_hashes(first, tid="t"))
    assert solo.prompt_hashes(later, tid="t", known=own) == solo.prompt_hashes(later, tid="t")


async def test_a_continuation_hashes_only_its_new_blocks():
    """The worker keeps a trajectory's last prompt hashes: a continuation of a 200-token context
    hashes the blocks past it, once (the turn carries them to admission and its reservation, whose
    written blocks take them), and reuses as before."""
    import ainfer_pd.engine.kv.block_hash as bh
    cfg = tiny_cfg()
    rng = random.Random(24)
    prompt, obs = rand_ids(rng, 200), rand_ids(rng, 40)
    async with RolloutWorker(cfg) as w:
        a = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY), trajectory_id="t")
        calls, real = [], bh.block_hash
        bh.block_hash = lambda parent, toks: calls.append(1) or real(parent, toks)
        try:
            b = await w.continue_("t", obs, SamplingParams(max_new_tokens=1, **GREEDY))
        finally:
            bh.block_hash = real
        bs = cfg.cache.block_size
        ctx = prompt + a.token_ids + obs
        full = (len(ctx) - 1) // bs
        assert b.num_cached_tokens == len(prompt) + len(a.token_ids) - 1
        assert w.trajectories["t"].block_hashes[1] == w.engine.kv.prompt_hashes(ctx, tid="t")
        # the new prompt blocks (those past the first prompt's) once: the pass that writes them
        # takes their hashes from the turn (at most one more: a block its decoded token completes)
        new = full - (len(prompt) - 1) // bs
        assert new >= 2 and len(calls) <= new + 1, (len(calls), full)
        await w.release("t")
        assert w.kv_leak_free()


async def test_without_sharing_a_trajectory_still_reuses_its_own_kv():
    cfg = tiny_cfg(**{"cache.prefix_sharing": False})
    rng = random.Random(23)
    prompt = rand_ids(rng, 50)
    async with RolloutWorker(cfg) as w:
        a = await w.generate(prompt, SamplingParams(max_new_tokens=4, **GREEDY), trajectory_id="own")
        other = await w.generate(prompt + a.token_ids + [5], SamplingParams(max_new_tokens=4, **GREEDY))
        b = await w.continue_("own", [5], SamplingParams(max_new_tokens=4, **GREEDY))
        assert other.num_cached_tokens == 0 and b.num_cached_tokens == len(prompt) + 3
        assert other.token_ids == b.token_ids
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()


async def test_eviction_under_pressure_with_shared_blocks_loses_nothing_and_leaks_nothing():
    """GRPO groups of 4 over 3 prompts, 2 turns each, random aborts, on a cache far smaller than
    the work (evictions all the time): every completed turn equals a recompute, every aborted
    one is a prefix of it, the accounting is consistent at every step and back to empty."""
    cfg = tiny_cfg(**{"cache.num_blocks": 28, "scheduler.max_prefill_tokens": 256})
    model = build_model(cfg.model)
    rng = random.Random(24)
    prompts = [rand_ids(rng, rng.randrange(90, 150)) for _ in range(3)]
    checks: list[tuple[list[int], list[int], bool]] = []
    bad: list[str] = []
    views: list[int] = []
    async with RolloutWorker(cfg) as w:
        async def audit_loop() -> None:
            while True:
                if not w.engine.kv.check_no_leak():
                    bad.append(str(w.engine.kv.audit()))
                # the engine's memoized view of the waiting turns equals one computed afresh
                turns = [t for t in w.engine.book.waiting if not (t.abort_requested or w.engine.book.behind_drain(t))]
                memo = prefix.pending_view(w.engine.kv, turns, w.engine.book.reserve, w.engine.book.ratio)
                kept = [t.prefix_view for t in turns]
                for t in turns:
                    t.prefix_view = None
                if prefix.pending_view(w.engine.kv, turns, w.engine.book.reserve, w.engine.book.ratio) != memo:
                    bad.append(f"stale pending view at kv version {w.engine.kv.version}")
                views.append(sum(m is not None and m[0] == w.engine.kv.version for m in kept))
                await asyncio.sleep(0.002)

        async def member(g: int, i: int) -> None:
            r = random.Random(g * 10 + i)
            tid = f"g{g}-{i}"
            ctx = list(prompts[g])
            for turn in range(2):
                task = asyncio.ensure_future(w.generate(ctx, SamplingParams(max_new_tokens=8, **GREEDY),
                                                        trajectory_id=tid))
                if r.random() < 0.3:
                    await asyncio.sleep(r.random() * 0.05)
                    await w.abort(tid)
                out = await task
                checks.append((list(ctx), out.token_ids, out.finish_reason == "abort"))
                ctx = ctx + out.token_ids + rand_ids(r, 5)
                while w.trajectories[tid].draining is not None:
                    await asyncio.sleep(0.002)

        auditor = asyncio.ensure_future(audit_loop())
        try:
            await asyncio.wait_for(asyncio.gather(*[member(g, i) for g in range(3) for i in range(4)]), 120)
        finally:
            auditor.cancel()
        m = w.metrics()
        for tid in list(w.trajectories):
            await w.release(tid)
        assert not bad, bad[:1]
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 28
    assert m["kv_evictions"] > 0 and m["prefix_reused_tokens"] > 0
    assert sum(views) > 0                          # memoized views were checked
    for ctx, toks, aborted in checks:
        ref = recompute_greedy(model, cfg, ctx, 8)[0]
        assert (ref[:len(toks)] if aborted else ref) == toks


async def test_siblings_below_the_wait_threshold_compute_their_prompt_in_the_same_epoch():
    """cache.prefix_wait_min_tokens above the shared prompt: no sibling waits for another's pass
    (each computes the prompt in the first epoch, nothing shared yet), outputs are unchanged; the
    threshold is the only difference (the default run above waits and shares)."""
    prompt = rand_ids(random.Random(21), 203)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "cache.prefix_wait_min_tokens": 193})
    outs, m = await _siblings(cfg, prompt, 4, params)
    ref, m0 = await _siblings(tiny_cfg(**{"scheduler.policy": "fine-grained"}), prompt, 4, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in outs] == [0] * 4 and m["prefill_tokens"] == 4 * len(prompt)
    assert sorted(o.num_cached_tokens for o in ref) == [0, 192, 192, 192]
    with pytest.raises(Exception, match="prefix_wait_min_tokens"):
        tiny_cfg(**{"cache.prefix_wait_min_tokens": -1})


# ====================================================================== host-path bookkeeping
def test_an_ownership_check_is_skipped_only_while_no_block_lost_its_writer():
    """``is_current`` / ``mark_written`` skip the block-by-block check while the pool's count of
    ownership losses has not moved; a block of the sequence let go of is still caught."""
    kv = KVCacheManager(NB, BS)
    la, lb = kv.reserve("a", 12), kv.reserve("b", 8)
    kv.mark_written("a", la, 4)
    assert kv.is_current("a", la) and kv.trajectories["a"].owner_checked == (la, kv.alloc.ownership_losses)
    kv.finish_turn("b", lb, 0, 0.0)                       # another sequence lets go: re-checked, still current
    assert kv.is_current("a", la)
    kv.alloc.release(kv.trajectories["a"].blocks[-1])     # a's own block loses its writer
    assert not kv.is_current("a", la)
    with pytest.raises(LifetimeError):
        kv.mark_written("a", la, 8)


def test_block_tables_equal_the_blocks_padded_with_block_zero():
    kv = KVCacheManager(64, BS)
    rng = random.Random(3)
    tids = [f"t{i}" for i in range(5)]
    for t in tids:
        kv.reserve(t, rng.randrange(1, 40))
    for nb in (1, 3, 10, 16):
        table = kv.block_table(tids, nb)
        ref = [(kv.trajectories[t].blocks[:nb] + [0] * nb)[:nb] for t in tids]
        assert table.dtype == torch.int64 and table.tolist() == ref
    assert kv.block_table([], 4).shape == (0, 4) and kv.block_table(tids, 0).shape == (5, 0)
