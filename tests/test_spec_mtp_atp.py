"""MTP drafts (``spec.method: mtp``) under attention TP, real gloo processes on the CPU, on the tiny
glm4_moe whose MTP layer is fitted to its rollouts (tests/test_spec_mtp.py's ``fitted``): ATP2 (two
ranks, one replica) and the crossed ATP2 x ADP2 (four ranks). Each TP follower runs its leader's
catch-ups and draft chains as they come (``engine/runtime/mtp_wire.py``), on a mirror of the
leader's stashes: its chains give the leader's drafts, the stash rows it reads are the leader's;
the leaders' drafts equal the reference chain (world size 1's), their tokens transformers' greedy
ones, every rank agrees each round's K; after an abort mid-verify, the resume and the releases no
KV block is held and no stash is left on any rank (the followers' dropped at a step)."""
from __future__ import annotations

import asyncio

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.comm.ordering import P_ATP_ALL_REDUCE
from tests import _hf_models
from tests._dist_util import run_ranks
from tests._spec_helpers import abort_mid_verify_then_resume, record_offers, spy_ks
from tests.conftest import hf_worker_cfg
from tests.test_spec_mtp import GREEDY, N, OBS, PROMPTS, SPEC, _check_drafts, fitted  # noqa: F401 (a fixture)

BASE = {"expert_backend": "torch", "rendezvous_timeout_s": 60.0}
ATP2 = {**BASE, "world_size": 2, "attn_dp": 1, "expert_parallel": 2}
CROSSED = {**BASE, "world_size": 4, "attn_dp": 2, "expert_parallel": 4}


def _spy_stash_reads(d) -> list:
    """(position, checksum) of every stash row this rank's drafter reads (catch-ups' first rows,
    chains' first steps), in order: a follower's mirror must give its leader's rows."""
    reads, row = [], d._stash_row

    def spy(key, p):
        r = row(key, p)
        reads.append((p, round(float(r.double().sum()), 6)))
        return r
    d._stash_row = spy
    return reads


def _spy_chains(d) -> list:
    """The drafts of every chain this rank's drafter ran, in order."""
    chains, run = [], d.run_chain

    async def spy(steps, refs):
        host = await run(steps, refs)
        chains.append(host.tolist())
        return host
    d.run_chain = spy
    return chains


async def _serve(w, prompts: list[list[int]], abort: bool) -> dict:
    """A leader's rollout: every prompt's two turns, then (``abort``) an abort mid-verify and its
    resume, then every trajectory released."""
    outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=N, **GREEDY)) for p in prompts))
    nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, OBS, SamplingParams(max_new_tokens=12, **GREEDY))
                                 for o in outs))
    if abort:
        await abort_mid_verify_then_resume(w, prompts[0], N, GREEDY, min_out=4, timeout=60)
    m = w.metrics()
    for tid in list(w.trajectories):
        await w.release(tid)
    kv = w.engine.kv
    return {"turns": [(list(o.token_ids), list(x.token_ids)) for o, x in zip(outs, nxt)],
            "counters": {k: m[k] for k in ("spec_verifies", "spec_accepted", "spec_drafted")},
            "kv_free": w.kv_leak_free() and kv.num_free_blocks == kv.alloc.num_blocks}


async def _rank(rank: int, world_size: int, path: str, parallel: dict, policy: str, spec: dict = SPEC):
    """Replica r's leader serves PROMPTS[r] (ATP2, one replica: both prompts); every rank records its
    drafter's chains and stash reads, each round's K and the world's cost table."""
    adp = parallel["attn_dp"]
    atp = world_size // adp
    leader, replica = rank % atp == 0, rank // atp
    async with RolloutWorker(hf_worker_cfg(path, policy, spec=spec, parallel=parallel)) as w:
        d = w.engine.runner.drafter
        reads, chains, ks = _spy_stash_reads(d), _spy_chains(d), spy_ks(w.engine.dist)
        p_all_reduces = _spy_p_all_reduces(w.engine.dist)
        out = {"leader": leader, "replica": replica, "has_spec": w.engine.spec is not None,
               "costs": w.engine.dist.spec_costs, "num_layers": w.engine.runner.num_layers}
        if leader:
            out["offers"] = record_offers(w.engine.spec)
            out.update(await _serve(w, PROMPTS if adp == 1 else [PROMPTS[replica]], abort=not spec["adaptive"]))
    # the loop has ended: every step ran, the stash drops of the last releases included
    out.update(reads=reads, chains=chains, ks=ks, stash=len(d.stash), missing=d.num_missing, p_all_reduces=p_all_reduces,
               keys=(len(d.keys), len(d.keys.dropped)))
    return out


def _spy_p_all_reduces(dist) -> list:
    """(epoch, stream) of every P attention all-reduce the walk launches through the ordering."""
    seen, launch = [], dist.colls.P.launch

    def spy(kind, tensor, **kw):
        if kind == P_ATP_ALL_REDUCE:
            seen.append((kw["epoch"], kw["stream"]))
        return launch(kind, tensor, **kw)
    dist.colls.P.launch = spy
    return seen


def _check_tokens(res: list[dict], model, prompts_of) -> None:
    """Every leader's greedy tokens are transformers'; no KV block or stash is left on any rank."""
    for r in res:
        assert r["has_spec"] is r["leader"]                # a TP follower has no speculator: it follows
        assert r["stash"] == 0 and r["missing"] == 0 and r["keys"] == (0, 0), r
    for lead in (r for r in res if r["leader"]):
        assert lead["kv_free"]
        for p, (t1, t2) in zip(prompts_of(lead["replica"]), lead["turns"]):
            assert t1 == _hf_models.hf_greedy(model, p, N)[0]
            assert t2 == _hf_models.hf_greedy(model, p + t1 + OBS, 12)[0]


def _check(res: list[dict], model, mtp, prompts_of) -> None:
    _check_tokens(res, model, prompts_of)
    for lead in (r for r in res if r["leader"]):
        c = lead["counters"]
        assert c["spec_verifies"] > 0 and 0 < c["spec_accepted"] < c["spec_drafted"], c
        _check_drafts(lead["offers"], model, mtp)
        followers = [r for r in res if r["replica"] == lead["replica"] and not r["leader"]]
        assert followers and lead["chains"] and any(any(x >= 0 for x in row) for ch in lead["chains"] for row in ch)
        for f in followers:                                # the same chains over the same stash rows
            assert f["chains"] == lead["chains"]
            assert f["reads"] == lead["reads"] and lead["reads"]
    ks = [r["ks"] for r in res]                            # one K a round, the world's (the rounds all saw)
    n = min(len(k) for k in ks)
    assert n > 0 and all(k[:n] == ks[0][:n] for k in ks) and any(ks[0][:n]), ks


@pytest.mark.parametrize("policy", ["fine-grained", "normal"])
def test_mtp_on_atp2_followers_run_the_leaders_chains_and_drafts_equal_the_reference(fitted, policy):  # noqa: F811
    path, model, mtp = fitted
    res = run_ranks(_rank, 2, str(path), ATP2, policy, timeout_s=180)
    _check(res, model, mtp, lambda replica: PROMPTS)


def test_adaptive_mtp_on_atp2_measures_one_world_table_of_verify_and_chain(fitted):  # noqa: F811
    """Without tables both TP ranks measure the verify and the MTP chain (padded to an ATP multiple:
    the layer's reduce-scatter splits the rows) and keep the world's tables; tokens stay greedy."""
    path, model, _ = fitted
    res = run_ranks(_rank, 2, str(path), ATP2, "fine-grained", {**SPEC, "adaptive": True}, timeout_s=180)
    assert res[0]["costs"] == res[1]["costs"] and res[0]["costs"].drafting is not None
    _check_tokens(res, model, lambda replica: PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fine-grained", "normal"])
def test_mtp_on_crossed_atp2_adp2_gives_the_reference_drafts_and_greedy_tokens(fitted, policy):  # noqa: F811
    path, model, mtp = fitted
    res = run_ranks(_rank, 4, str(path), CROSSED, policy, timeout_s=240)
    _check(res, model, mtp, lambda replica: [PROMPTS[replica]])
    # the groups cross, so `selective` routes P's attention all-reduces behind D's launches: the
    # MTP catch-up's too (one more a P epoch than the layers), never issued on the P stream
    for r in res:
        per_epoch = {}
        for epoch, stream in r["p_all_reduces"]:
            per_epoch[epoch] = per_epoch.get(epoch, 0) + 1
            assert stream == "D", r["p_all_reduces"]
        assert per_epoch and set(per_epoch.values()) == {r["num_layers"] + 1}, per_epoch


# ---------------------------------------------------------------- the wire (pure)
def _same_fb(a, b) -> None:
    for name in ("input_ids", "positions", "write_slots"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert [(s.q_start, s.q_len, s.ctx_len, s.block_ids.tolist()) for s in a.prefill] == \
        [(s.q_start, s.q_len, s.ctx_len, s.block_ids.tolist()) for s in b.prefill]
    assert (a.decode is None) == (b.decode is None)
    if a.decode is not None:
        assert a.decode.ctx_lens.tolist() == b.decode.ctx_lens.tolist()
        assert a.decode.block_table.tolist() == b.decode.block_table.tolist()


def test_the_wire_gives_a_follower_the_leaders_catch_ups_and_chain_under_stash_keys():
    """What a TP follower receives equals what its leader built, each trajectory named by its
    stash key: a D batch's catch-up (padded to the agreed rows), a P batch's (rows, or a pass of
    none), a verify round's world chain."""
    import types

    import torch

    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime import mtp_wire as wire
    from ainfer_pd.spec.mtp_batch import catch_up_batch, decode_catch_up, world_chain_batches
    from ainfer_pd.spec.stash_keys import StashKeys
    kv, keys = KVCacheManager(16, 4), StashKeys()
    for tid, n in (("a", 10), ("b", 7)):
        kv.reserve(tid, 20, list(range(n)))
    turns = [types.SimpleNamespace(tid="a", context=list(range(10)), prompt=list(range(10)), seq_len=10),
             types.SimpleNamespace(tid="b", context=list(range(7)), prompt=list(range(7)), seq_len=7)]
    turns[0].out_tokens = turns[1].out_tokens = [3]
    covered = {("a", 8)}                                   # a's stash holds position 8, b's nothing
    d = decode_catch_up(kv, "cpu", turns, None, [[5, 6], []], lambda tid, p: (tid, p) in covered, 64)
    got = wire.unpack_decode_catch_up(wire.pack_decode_catch_up(d, keys.of, 8), 8, torch.device("cpu"))
    assert got.first.tolist() == d.first.tolist() and got.first_write.tolist() == d.first_write.tolist()
    assert got.refs == [(0, keys.of("a"), 8)] and got.ref_rows.tolist() == [0]
    assert got.keeps == [(keys.of(t), a, b, p) for t, a, b, p in d.keeps]
    p = catch_up_batch(kv, "cpu", 12, [(turns[0], 4, 6), (turns[1], 0, 6)], [], None, None,
                       lambda tid, q: tid == "a")
    got = wire.unpack_prefill_catch_up(wire.pack_prefill_catch_up(p, keys.of), torch.device("cpu"), 4)
    _same_fb(p.fb, got.fb)
    for name in ("tok_idx", "extra", "hid_idx", "keep_idx"):
        assert getattr(p, name).tolist() == getattr(got, name).tolist(), name
    assert got.refs == [(keys.of(t), q) for t, q in p.refs] and got.drops == [keys.of(t) for t in p.drops]
    assert got.keeps == [(keys.of(t), a, b, q) for t, a, b, q in p.keeps] and p.refs and p.drops and p.keeps
    empty = decode_catch_up(kv, "cpu", [], None, None, lambda tid, q: False, 64)        # a P pass of no rows
    got = wire.unpack_prefill_catch_up(wire.pack_prefill_catch_up(empty, keys.of), torch.device("cpu"), 4)
    assert type(got) is type(empty) and got.first.numel() == 0 and not got.refs
    steps = world_chain_batches(kv, "cpu", [("a", 10, 77, 3), ("b", 7, 88, 1)], 4, 3, 64, 16)
    refs = [("a", 8), ("b", 5)]
    back, got_refs = wire.unpack_chain(wire.pack_chain(steps, refs, keys.of, 4, 6), 4, 3, 6, torch.device("cpu"), 4)
    assert got_refs == [(keys.of("a"), 8), (keys.of("b"), 5)] and len(back) == 3
    for a, b in zip(steps, back):
        _same_fb(a, b)
    keys.forget("a")
    assert keys.take(5) == [0] and keys.of("a") == 2 and len(keys) == 2       # a new key: never reused
