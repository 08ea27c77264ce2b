"""Speculative decoding (``spec.method: suffix``) on several ranks (issue 38), real gloo processes on
the CPU: greedy tokens on EP2 with attention DP (ADP2), on attention TP (ATP2) and on the crossed
ATP2 x ADP2 equal world size 1 without speculation, with drafts verified and accepted on the replica
leaders; a seeded sampled request is unchanged by speculation; an abort mid-verify leaves no KV
block held on any rank while the other trajectories finish. Plus the pure parts: the step's verify
flag, the verify shape's agreement and counters, the world's cost table. (MTP on several ranks:
tests/test_spec_mtp.py, ADP2 x EP2; tests/test_spec_mtp_atp.py, attention TP.)"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.sched.step import StepInputs, decide_step
from ainfer_pd.sched.epoch_mode import policy_traits
from ainfer_pd.spec.adaptive import VerifyCosts, choose
from ainfer_pd.spec.verify_shape import DraftOffer, positions_at, verify_counts, world_k
from tests._dist_util import run_ranks
from tests._spec_helpers import spy_ks

ROOT = Path(__file__).resolve().parents[1] / "ainfer_pd" / "configs"
SPEC = {"spec.method": "suffix", "spec.adaptive": False, "spec.num_draft_tokens": 4,
        "mux.activation_threshold": 1}          # every epoch beside decode rows is gated
GREEDY = dict(temperature=0.0, ignore_eos=True)
N = 32
# prompts that repeat: the tiny random model falls into loops on them, so suffix drafts hit
PROMPTS = [[5, 6, 7, 8, 9] * 8, [40, 41, 42, 43, 44, 45] * 5, [50, 51, 52] * 9, [100, 101, 102, 103, 104] * 6]
REQUESTS = [(p, dict(max_new_tokens=N, **GREEDY)) for p in PROMPTS] + [
    (PROMPTS[0], dict(max_new_tokens=N, temperature=0.5, seed=11, ignore_eos=True)),
    (PROMPTS[1], dict(max_new_tokens=N, temperature=0.9, top_k=40, seed=12, ignore_eos=True))]
LATE = [([7, 8, 9] * 12, dict(max_new_tokens=N // 2, **GREEDY)), ([60, 61, 62] * 7, dict(max_new_tokens=N // 2, **GREEDY))]
"""Submitted once D has run a few iterations: their P epoch is multiplexed with the verifies."""
ALL = REQUESTS + LATE
COUNTERS = ("spec_verifies", "spec_drafted", "spec_accepted", "spec_verify_rounds", "spec_verify_joined",
            "spec_verify_pad_positions", "verify_sync_s_count", "spec_verify_k")


def _cfg(name: str, **over) -> WorkerConfig:
    return WorkerConfig.from_yaml(ROOT / name).replace(**{"parallel.rendezvous_timeout_s": 60.0, **over})


async def _generate_all(w, requests):
    outs = await asyncio.gather(*(w.generate(p, SamplingParams(**kw)) for p, kw in requests))
    for o in outs:
        await w.release(o.trajectory_id)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    """World size 1 without speculation: every request's tokens."""
    async def go():
        async with RolloutWorker(_cfg("tiny-cpu.yaml")) as w:
            return await _generate_all(w, ALL)
    return asyncio.run(go())


def _spy_rounds(d) -> dict:
    """Count the verify iterations (their shape agreed over the ranks) that are a turnstile round's
    D launch (beside a gated epoch), and those in which this rank's own rows verify drafts."""
    seen, iteration, plain = {"verify_in_round": 0, "own_verify_in_round": 0, "flag": False}, d.iteration, d._plain

    async def spy_iteration(*, limit=None, verify=False):
        seen["flag"] = verify
        return await iteration(limit=limit, verify=verify)

    async def spy_plain(rows, rnd, t_ready, batch=None):
        seen["verify_in_round"] += rnd is not None and seen["flag"]
        seen["own_verify_in_round"] += rnd is not None and batch is not None
        return await plain(rows, rnd, t_ready, batch)
    d.iteration, d._plain = spy_iteration, spy_plain
    return seen


async def _rank_generate(rank: int, world_size: int, name: str, over: dict):
    """Replica ``rank // ATP``'s requests (request i goes to replica i % ADP), on its leader; the
    late ones once D has run a few iterations."""
    cfg = _cfg(name, **over)
    atp = world_size // cfg.parallel.attn_dp
    leader, replica = rank % atp == 0, rank // atp
    mine = [i for i in range(len(ALL)) if leader and i % cfg.parallel.attn_dp == replica]
    measured = _spy_measurement()
    async with RolloutWorker(cfg) as w:
        seen = _spy_rounds(w.engine.d)
        plans = seen["plans"] = []                   # (its rows, the world's rows drafting is costed at)
        if w.engine.spec is not None:
            worth = w.engine.spec.worth_drafting

            def spy_worth(rows, world_rows=0):
                plans.append((len(rows), world_rows))
                return worth(rows, world_rows)
            w.engine.spec.worth_drafting = spy_worth
        seen["world_costs"] = w.engine.dist.spec_costs
        seen["ks"] = spy_ks(w.engine.dist)

        async def late():
            while w.engine.d.num_iters < 4:
                await asyncio.sleep(0.001)
            return await _generate_all(w, [ALL[i] for i in mine if i >= len(REQUESTS)])
        toks = await asyncio.gather(_generate_all(w, [ALL[i] for i in mine if i < len(REQUESTS)]), late())
        m = w.metrics()
        free = w.engine.kv.num_free_blocks == cfg.cache.num_blocks and w.kv_leak_free()
        has_spec = w.engine.spec is not None
        seen.update(measured=measured, costs=w.engine.spec.costs if has_spec else None)
    return dict(zip(mine, toks[0] + toks[1])), {**{k: m.get(k, 0) for k in COUNTERS}, **seen}, free, leader, has_spec


def _spy_measurement() -> list:
    """The verify cost tables this rank measures at start (none when the config gives one), as
    the speculator gets them: each batch size's measured plain time, its widths made 1% dearer a
    draft. Every pass still runs (padded, its collectives paired across ranks) and every rank's
    table differs (its own timings): only whether speculating pays no longer rests on timings
    that, on two shared CPU cores, put the tiny model's wider passes anywhere in 0.7-3x."""
    from ainfer_pd.engine.runtime import verify_costs
    measured, real = [], verify_costs.measure_verify_costs

    def spy(*args, **kw):
        times = real(*args, **kw)
        measured.append({B: {w: row[1] * (1 + 0.01 * (w - 1)) for w in row} for B, row in times.items()})
        return measured[-1]
    verify_costs.measure_verify_costs = spy
    return measured


def _run(world_size: int, name: str, over: dict, reference, timeout_s: float = 120):
    res = run_ranks(_rank_generate, world_size, name, {**SPEC, **over}, timeout_s=timeout_s)
    got = {}
    for toks, _, free, leader, has_spec in res:
        got.update(toks)
        assert free                                   # every KV block back, on every rank
        assert has_spec is leader                     # a TP follower never drafts
    assert [got[i] for i in range(len(ALL))] == reference
    leaders = [m for _, m, _, leader, _ in res if leader]
    for m in leaders:                                 # every leader verified drafts and kept some
        assert m["spec_verifies"] > 0 and 0 < m["spec_accepted"] <= m["spec_drafted"], m
        assert m["spec_verify_rounds"] >= m["spec_verifies"]
        assert m["verify_sync_s_count"] == m["spec_verify_rounds"]       # one rendezvous per agreed shape
        # drafting is costed at the rows the world runs (the step's most), never below the leader's own
        assert any(n for n, _ in m["plans"]) and all(world >= n for n, world in m["plans"]), m["plans"]
    # one K a round, the world's, on every rank (a rank done with its own requests reads its
    # record while the others may still run rounds: the rounds both saw)
    ks = [m["ks"] for _, m, _, _, _ in res]
    n = min(len(k) for k in ks)
    assert n > 0 and all(k[:n] == ks[0][:n] for k in ks) and any(ks[0][:n]), ks
    # every rank (TP followers too) holds the world's cost table K is chosen from
    assert len({repr(m["world_costs"]) for _, m, _, _, _ in res}) == 1
    # the late requests' P epoch ran gated beside verify iterations: one was a turnstile round's D launch
    # on every rank (the round and the verify shape agreed alike)
    assert len({m["verify_in_round"] for _, m, _, _, _ in res}) == 1 and res[0][1]["verify_in_round"] > 0, \
        [m for _, m, _, _, _ in res]
    return leaders, [m for _, m, _, _, _ in res]


CHEAP = {B: {1: 0.01, 2: 0.0101, 3: 0.0102, 5: 0.0104} for B in (1, 4, 16)}
"""A verify cost table under which speculating pays (spec.adaptive on several ranks needs one)."""


@pytest.mark.parametrize("over", [{}, {"spec.adaptive": True, "spec.verify_costs": CHEAP}], ids=["all", "adaptive"])
def test_suffix_on_adp2_ep2_gives_world_size_one_tokens_with_drafts_accepted(reference, over):
    leaders, _ = _run(2, "tiny-2rank-cpu.yaml", over, reference)
    # the two replicas draft at different iterations: one pads to the other's verify positions
    assert sum(m["spec_verify_pad_positions"] for m in leaders) > 0


def test_suffix_on_atp2_gives_world_size_one_tokens_with_drafts_accepted(reference):
    _run(2, "tiny-2rank-cpu.yaml", {"parallel.attn_dp": 1}, reference)


MEASURED = {"spec.adaptive": True, "scheduler.max_decode_batch": 16, "model.max_context_len": 256}
"""The default spec.adaptive without a table: measured at start (a small grid: B 1, 4, 16, at 128
keys: a short start)."""


@pytest.mark.parametrize("over", [{}, {"parallel.attn_dp": 1}], ids=["adp2", "atp2"])
def test_adaptive_without_a_table_measures_one_world_table_on_every_rank(reference, over):
    leaders, ranks = _run(2, "tiny-2rank-cpu.yaml", {**MEASURED, **over}, reference)
    assert all(len(m["measured"]) == 1 for m in ranks)          # every rank ran the grid, TP followers too
    tables = [m["measured"][0] for m in ranks]
    grid = {B: sorted(row) for B, row in tables[0].items()}
    assert sorted(grid) == [1, 4, 16] and grid[16] == [1, 2, 3, 5]
    world = VerifyCosts.from_times({B: {w: max(t[B][w] for t in tables) for w in ws} for B, ws in grid.items()})
    assert all(m["costs"] == world for m in leaders)            # one table on every leader: the world's


@pytest.mark.slow
def test_suffix_on_crossed_atp2_adp2_gives_world_size_one_tokens(reference):
    _run(4, "tiny-crossed-cpu.yaml", {}, reference, timeout_s=200)


async def _rank_abort(rank: int, world_size: int):
    """Rank 0: "A" aborted while a verify pass in which it drafts is on the device, then resumed;
    its tokens equal "F"'s, run whole. Rank 1: other trajectories run to their end meanwhile."""
    cfg = _cfg("tiny-2rank-cpu.yaml", **SPEC)
    empty = {"rounds": 0}
    async with RolloutWorker(cfg) as w:
        initial = w.engine.kv.num_free_blocks
        if rank == 1:
            agree = w.engine.dist.agree_verify

            async def spying(offer, epoch):
                empty["rounds"] += offer.positions[-1] == offer.rows       # no drafts of its own
                return await agree(offer, epoch)
            w.engine.dist.agree_verify = spying
            toks = await _generate_all(w, REQUESTS[1:4])
            assert all(len(t) == N for t in toks)
        else:
            d, seen = w.engine.d, {"verifying": False}
            plain = d._plain

            async def spying(rows, rnd, t_ready, batch=None):
                seen["verifying"] = batch is not None and any(
                    t.tid == "A" and dr for t, dr in zip(batch.rows, batch.drafts))
                try:
                    return await plain(rows, rnd, t_ready, batch)
                finally:
                    seen["verifying"] = False
            d._plain = spying
            p = PROMPTS[0]
            full = await w.generate(p, SamplingParams(max_new_tokens=N, **GREEDY), trajectory_id="F")
            task = asyncio.ensure_future(w.generate(p, SamplingParams(max_new_tokens=N, **GREEDY), trajectory_id="A"))
            async with asyncio.timeout(60):
                while not (seen["verifying"] and d.in_flight):
                    await asyncio.sleep(0)
            assert await w.abort("A") is True
            part = await task
            k = len(part.token_ids)
            assert part.finish_reason == "abort" and k < N and part.token_ids == full.token_ids[:k]
            async with asyncio.timeout(60):
                while w.trajectories["A"].draining is not None:
                    await asyncio.sleep(0.001)
            rest = await w.continue_("A", [], SamplingParams(max_new_tokens=N - k, **GREEDY))
            assert part.token_ids + rest.token_ids == full.token_ids
            for tid in ("A", "F"):
                await w.release(tid)
        free = w.engine.kv.num_free_blocks
        assert w.kv_leak_free()
    return initial, free, empty["rounds"]


def test_abort_mid_verify_on_two_ranks_holds_no_kv_block_and_the_others_finish():
    res = run_ranks(_rank_abort, 2, timeout_s=120)
    for initial, free, _ in res:
        assert free == initial
    assert res[1][2] > 0            # rank 1, its rows done, joined rank 0's verifies with none


# ---------------------------------------------------------------- the pure parts
def _inputs(d_rows: int, drafting: bool) -> StepInputs:
    return StepInputs(d_rows=d_rows, p_tokens=0, p_running=False, clock_ms=0, closing=False, waiting_turns=0,
                      slowdown_milli=0, backlog_tokens=0, oldest_wait_ms=0, device_ready=True, d_drafting=drafting)


def test_the_step_makes_a_verify_iteration_when_any_rank_would_draft():
    from ainfer_pd.config_sections import MuxConfig
    traits, mux = policy_traits("fine-grained"), MuxConfig()
    dec = lambda *s: decide_step(list(s), traits, mux, activation_on=True, exclusive_running=False)  # noqa: E731
    assert dec(_inputs(3, False), _inputs(0, True)).verify             # a leader with rows of its own drafts
    assert not dec(_inputs(3, False), _inputs(2, False)).verify
    assert not dec(_inputs(0, True), _inputs(0, True)).verify          # no D iteration at all
    assert StepInputs.from_payload(_inputs(1, True).to_payload()).d_drafting is True


def test_an_offer_gives_each_k_s_positions_and_expected_tokens_and_travels_as_ints():
    a = DraftOffer.of([0.5, 0.0, 1.0], [3, 0, 1], 4, host_s=0.0012)
    assert a.rows == 3 and a.host_us == 1200
    assert a.positions == (3, 5, 6, 7, 7)                       # rows + min(K, draft) per row
    assert a.milli_tokens[0] == 3000 and a.milli_tokens[1] == 1500 + 1000 + 2000
    assert a.milli_tokens[3] == 1875 + 1000 + 2000 == a.milli_tokens[4]
    assert DraftOffer.from_payload(a.to_payload(), 4) == a
    assert DraftOffer.plain(2, 4).positions == (2,) * 5 and DraftOffer.plain(0, 4).milli_tokens == (0,) * 5
    from ainfer_pd.errors import SpecInputError
    with pytest.raises(SpecInputError, match="num_draft_tokens differ"):
        DraftOffer.from_payload(a.to_payload(), 3)


def test_the_world_k_counts_every_replica_s_rows_and_pads_to_the_most_positions_at_it():
    """One leader's row drafts well; beside a replica of 15 rows without drafts the verify's width
    costs all 16 rows: K pays for the leader alone (its local choice) but not for the world."""
    costs = VerifyCosts.from_times({16: {1: 0.010, 2: 0.0115, 3: 0.013, 5: 0.016}})
    lone = DraftOffer.of([0.9], [4], 4)
    assert choose(costs, [0.9], [4], world_rows=16).k == 4                       # the local choice
    assert world_k(costs, [lone, DraftOffer.plain(0, 4)], adaptive=True) == 4    # its TP follower adds no rows
    assert world_k(costs, [lone, DraftOffer.plain(15, 4)], adaptive=True) == 0   # the world's
    many = DraftOffer.of([0.9] * 15, [4] * 15, 4)
    assert world_k(costs, [lone, many], adaptive=True) == 4
    assert world_k(costs, [lone, DraftOffer.plain(15, 4)], adaptive=False) == 4  # not adaptive: the longest draft
    assert world_k(None, [lone], adaptive=True) == 0 and world_k(costs, [DraftOffer.plain(3, 4)], adaptive=True) == 0
    slow = DraftOffer.of([0.9], [4], 4, host_s=0.04)                             # drafting's host time counts
    assert world_k(costs, [slow, DraftOffer.plain(0, 4)], adaptive=True) == 0
    two = DraftOffer.of([0.9, 0.9], [1, 3], 4)
    assert positions_at([lone, two, DraftOffer.plain(0, 4)], 2) == 5 and positions_at([lone, two], 4) == 6
    assert verify_counts(DraftOffer.plain(2, 4), [lone, DraftOffer.plain(2, 4)], 4, 8) == {
        "spec_verify_rounds": 1, "spec_verify_joined": 1, "spec_verify_empty": 0, "spec_verify_pad_positions": 6,
        "spec_verify_k": 4}
    assert verify_counts(lone, [lone], 0, 1)["spec_verify_empty"] == 1


def test_k_is_chosen_at_the_cost_of_the_rows_the_world_runs():
    """A leader of 1 row beside a replica of 64: the lockstep pass costs B = 64's ratio, at which
    4 drafts at acceptance 0.5 do not pay; at its own B = 1 they would."""
    costs = VerifyCosts.from_times({1: {1: 0.010, 2: 0.0102, 3: 0.0104, 5: 0.011},
                                    64: {1: 0.020, 2: 0.038, 3: 0.056, 5: 0.092}})
    assert choose(costs, [0.5], [4]).k == 4                            # its own size: speculate
    assert choose(costs, [0.5], [4], world_rows=64).k == 0             # the world's: no
    assert choose(costs, [0.5] * 64, [4] * 64, world_rows=1).k == 0    # never below its own size
    assert choose(costs, [0.5], [4], world_rows=1) == choose(costs, [0.5], [4])


def test_the_world_cost_table_is_each_entrys_most_and_a_differing_grid_is_named():
    from ainfer_pd.errors import SpecInputError
    from ainfer_pd.spec.world_costs import world_times
    a, b = {1: {1: 0.01, 2: 0.03}, 4: {1: 0.02, 2: 0.02}}, {1: {1: 0.02, 2: 0.01}, 4: {1: 0.01, 2: 0.05}}
    assert world_times([a, b]) == {1: {1: 0.02, 2: 0.03}, 4: {1: 0.02, 2: 0.05}}
    with pytest.raises(SpecInputError, match="rank 1 measured"):
        world_times([a, {1: {1: 0.01}, 4: {1: 0.02, 2: 0.02}}])


def test_a_merged_world_sums_each_leaders_drafts_and_padding():
    from ainfer_pd.tools.world import merge_metrics
    a = {"spec_verifies": 3, "spec_accepted": 11, "spec_verify_pad_positions": 20, "spec_verify_rounds": 20}
    b = {"spec_verifies": 5, "spec_accepted": 15, "spec_verify_pad_positions": 14, "spec_verify_rounds": 20}
    m = merge_metrics([a, {}, b, {}])                  # two leaders, two TP followers (no speculator)
    assert (m["spec_verifies"], m["spec_accepted"], m["spec_verify_pad_positions"]) == (8, 26, 34)
    assert m["spec_verify_rounds"] == 20               # every leader joins every round: one rank's count
