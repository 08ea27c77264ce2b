"""MTP draft heads (``spec.method: mtp``, glm4_moe; issue 38) on a tiny glm4_moe whose MTP layer is
written here (``tests/_mtp_model.py``: transformers' own decoder layer plus the MTP norms and
projection) and fitted to the target's greedy rollouts of the test prompts, so its first drafts
are accepted often and its chained ones not always: the engine's drafts equal the reference chain
recomputed with transformers' modules (overlapped iterations and a second turn included); greedy
and seeded outputs and logprobs equal plain decoding under every policy; no KV leak, an abort
mid-verify included; a weight sync updates the MTP layer and a set without it is refused; the
refusals without an MTP layer."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.attention import DecodeMeta
from ainfer_pd.errors import CheckpointError, UnsupportedOptionError, WeightUpdateError
from tests import _hf_models, _mtp_model
from tests._spec_helpers import abort_mid_verify_then_resume, record_offers, spy_ks
from tests.conftest import hf_worker_cfg

K = 3
SPEC = {"method": "mtp", "adaptive": False, "num_draft_tokens": K}
PROMPTS = [list(range(5, 25)), [9, 200, 31, 77, 12, 140, 66, 3, 250, 18, 42]]
OBS = [7, 8, 9, 101]
N = 24
GREEDY = dict(temperature=0.0, ignore_eos=True)
L = _hf_models.SPECS["glm4_moe"][2]["num_hidden_layers"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(checkpoint dir, transformers model, MTP layer): the layer fitted to the greedy two-turn
    rollouts of PROMPTS, with its own head and embedding."""
    model, mtp = _mtp_model.make(0)
    seqs = []
    for p in PROMPTS:
        c = _hf_models.hf_greedy(model, p, N)[0]
        seqs.append(p + c + OBS + _hf_models.hf_greedy(model, p + c + OBS, N)[0])
    _mtp_model.fit(model, mtp, seqs, steps=15)
    return _mtp_model.save(model, mtp, tmp_path_factory.mktemp("mtp") / "fitted"), model, mtp


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A random MTP layer without its own head and embedding (the main ones serve)."""
    model, mtp = _mtp_model.make(1, own_head=False, own_embed=False)
    return _mtp_model.save(model, mtp, tmp_path_factory.mktemp("mtp") / "shared"), model, mtp


def _record(w) -> list[tuple[list[int], list[int], int]]:
    """Every planned row's (sequence, the drafts it got, its cap), as the speculator planned it."""
    sp, rec = w.engine.spec, []
    plan = sp.plan

    def recording(rows):
        batch = plan(rows)
        rec.extend((t.context + t.out_tokens, sp.drafter.draft(t.tid, sp.cap(t)), sp.cap(t)) for t in rows)
        return batch
    sp.plan = recording
    return rec


def _check_drafts(rec, model, mtp) -> None:
    """Each recorded row drafted its whole cap, equal to the reference chain."""
    assert rec
    for seq, drafts, cap in rec:
        assert drafts == _mtp_model.reference_drafts(model, mtp, seq, K)[:cap], len(seq)


async def _leak_free(w) -> None:
    for tid in list(w.trajectories):
        await w.release(tid)
    assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks
    d = w.engine.spec.drafter
    assert not d.stash and d.num_missing == 0


@pytest.mark.parametrize("layer", ["own head and embedding", "shared head and embedding"])
async def test_mtp_drafts_equal_the_reference_chain_over_two_turns(layer, fitted, shared):
    path, model, mtp = fitted if layer.startswith("own") else shared
    async with RolloutWorker(hf_worker_cfg(path, spec=SPEC)) as w:
        held = w.engine.runner.model.mtp
        assert (held.head is not None, held.embed is not None) == ((True, True) if mtp.head is not None
                                                                   else (False, False))
        rec = _record(w)
        outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=N, **GREEDY)) for p in PROMPTS))
        await asyncio.gather(*(w.continue_(o.trajectory_id, OBS, SamplingParams(max_new_tokens=12, **GREEDY))
                               for o in outs))
        assert w.engine.runner.kv_cache.shape[0] == L + 1            # the MTP layer's own KV layer
        await _leak_free(w)
    _check_drafts(rec, model, mtp)
    assert sum(len(d) for _, d, _ in rec) >= 2 * N


async def test_drafts_after_overlapped_iterations_equal_the_reference_chain(fitted):
    """Two rows decode overlapped (speculation costs too much at batch 2: the catch-up feeds on
    the device), then the longer one alone speculates from the MTP state those passes left."""
    path, model, mtp = fitted
    costs = {1: {1: 0.01, 2: 0.0101, 3: 0.0102, 4: 0.0103}, 2: {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}}
    spec = {**SPEC, "adaptive": True, "verify_costs": costs}
    async with RolloutWorker(hf_worker_cfg(path, spec=spec)) as w:
        assert w.engine.overlap_decode
        rec = _record(w)
        short, long_ = await asyncio.gather(w.generate(PROMPTS[1], SamplingParams(max_new_tokens=6, **GREEDY)),
                                            w.generate(PROMPTS[0], SamplingParams(max_new_tokens=N, **GREEDY)))
        assert w.metrics()["d_rows_fed"] > 0
        await _leak_free(w)
    assert long_.token_ids == _hf_models.hf_greedy(model, PROMPTS[0], N)[0]
    _check_drafts(rec, model, mtp)


def _params(stop: int | None) -> list[SamplingParams]:
    """Greedy siblings, a greedy one with a stop token inside an accepted run, an odd length
    limit and a repetition penalty (the seeded samples: :func:`_sampled`)."""
    out = [SamplingParams(max_new_tokens=N, **GREEDY), SamplingParams(max_new_tokens=N, **GREEDY),
           SamplingParams(max_new_tokens=7, **GREEDY),
           SamplingParams(max_new_tokens=N, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)]
    if stop is not None:
        out.append(SamplingParams(max_new_tokens=N, stop_token_ids=[stop], **GREEDY))
    return out


def _sampled() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=N, temperature=0.8, seed=11, ignore_eos=True),
            SamplingParams(max_new_tokens=N, temperature=0.7, top_k=20, top_p=0.9, seed=12, ignore_eos=True),
            SamplingParams(max_new_tokens=N, temperature=1.0, seed=13, ignore_eos=True)]


async def _rollout(cfg, params):
    """Every row's two turns on PROMPTS[0] (generate, then continue_ on its retained KV)."""
    async with RolloutWorker(cfg) as w:
        outs = await asyncio.gather(*(w.generate(PROMPTS[0], p) for p in params))
        nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, OBS, p) for o, p in zip(outs, params)))
        m = w.metrics()
        if w.engine.spec is not None:
            await _leak_free(w)
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs + nxt], m


def _same(a, b) -> None:
    assert [(t, r) for t, r, _ in a] == [(t, r) for t, r, _ in b]
    for (_, _, la), (_, _, lb) in zip(a, b):
        assert la == pytest.approx(lb, abs=1e-4)


@pytest.fixture(scope="module")
def plain(fitted):
    path = fitted[0]
    greedy = _hf_models.hf_greedy(fitted[1], PROMPTS[0], N)[0]
    params = _params(greedy[9])                          # the 10th greedy token: a stop inside a run
    return params, asyncio.run(_rollout(hf_worker_cfg(path), params))[0], \
        asyncio.run(_rollout(hf_worker_cfg(path), _sampled()))[0]


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "global-enqueue", "mixed-chunked"])
def test_mtp_speculation_gives_plain_decoding_s_greedy_tokens_and_logprobs(policy, fitted, plain):
    params, want, _ = plain
    got, m = asyncio.run(_rollout(hf_worker_cfg(fitted[0], policy, spec=SPEC), params))
    _same(got, want)
    assert any(r == "stop" for _, r, _ in got) and any(r == "length" and len(t) == 7 for t, r, _ in got)
    assert m["spec_verifies"] > 0 and 0 < m["spec_accepted"] < m["spec_drafted"]
    assert m["spec_tokens_per_row_pass"] > 1.2


@pytest.mark.parametrize("policy", ["normal", "mixed-chunked"])
def test_seeded_sampling_with_mtp_drafts_equals_plain_sampling(policy, fitted, plain):
    _, _, want = plain
    got, m = asyncio.run(_rollout(hf_worker_cfg(fitted[0], policy, spec=SPEC), _sampled()))
    _same(got, want)
    assert m["spec_drafted"] > 0 and m["spec_accepted"] > 0


async def test_abort_mid_verify_leaks_no_kv_and_the_resume_equals_the_whole_run(fitted):
    path = fitted[0]
    async with RolloutWorker(hf_worker_cfg(path, spec=SPEC)) as w:
        await abort_mid_verify_then_resume(w, PROMPTS[0], N, GREEDY, min_out=4, timeout=60)
        await _leak_free(w)


def _trainer_tensors(model) -> list:
    """What a transformers trainer sends (named_parameters and glm's router bias buffers)."""
    out = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    return out + [(n, b.clone()) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]


async def test_weight_sync_updates_the_mtp_layer_and_refuses_a_set_without_it(fitted):
    path, model, mtp = fitted
    new = _mtp_model.MtpReference(model.config).float().eval()     # another MTP layer, the same target
    _hf_models.randomize(new, 2024)
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    async with RolloutWorker(hf_worker_cfg(path, spec=SPEC)) as w:
        rec = _record(w)
        before = await w.generate(PROMPTS[0], params)
        n_before = len(rec)
        await w.update_weights(_trainer_tensors(model) + list(new.checkpoint_tensors(L).items()))
        after = await w.generate(PROMPTS[0], params)
        assert after.token_ids == before.token_ids                  # the target is the same
        with pytest.raises(WeightUpdateError, match=rf"MTP.*model\.layers\.{L}\."):
            await w.update_weights(_trainer_tensors(model))          # the other weights, not the MTP layer
        again = await w.generate(PROMPTS[0], params)
        assert again.token_ids == before.token_ids
        await _leak_free(w)
    old_rec, new_rec = rec[:n_before], rec[n_before:]
    _check_drafts(old_rec, model, mtp)
    _check_drafts(new_rec, model, new)                              # nothing of the refused set was written
    assert any(d != _mtp_model.reference_drafts(model, mtp, seq, K)[:cap] for seq, d, cap in new_rec)


async def test_mtp_needs_a_checkpoint_with_an_mtp_layer(fitted, hf_model_dir, tmp_path):
    with pytest.raises(UnsupportedOptionError, match="num_mtp_layers=0"):
        hf_worker_cfg(hf_model_dir("glm4_moe"), spec=SPEC)        # num_nextn_predict_layers 0
    model, _ = _mtp_model.make(0)
    bare = _mtp_model.save(model, None, tmp_path / "bare")         # says 1 MTP layer, holds none
    with pytest.raises(CheckpointError, match=rf"lacks model\.layers\.{L}\."):
        async with RolloutWorker(hf_worker_cfg(bare, spec=SPEC)):
            pass
    async with RolloutWorker(hf_worker_cfg(fitted[0])) as w:       # without mtp: the layer stays skipped
        m = w.engine.runner.model
        assert m.mtp is None and len(m.layers) == L and w.engine.runner.kv_cache.shape[0] == L
        assert any(n.startswith(f"model.layers.{L}.") for n in m.load_report.tensors_skipped)


async def test_an_fp8_model_s_mtp_layer_is_fp8_keeps_fp8_decoding_and_exports(fitted, tmp_path):
    """``model.quantization: fp8``: the MTP layer's routed experts are FP8 like the main layers';
    speculation leaves the FP8 model's greedy tokens and logprobs as they are; ``save_pretrained``
    writes the layer (e4m3 experts + scales, its bf16 Linears listed unconverted) and it loads
    back bit-exact."""
    from ainfer_pd.hf.export import save_pretrained
    path = fitted[0]
    fp8 = {"dtype": "bfloat16", "quantization": "fp8"}
    params = SamplingParams(max_new_tokens=N, **GREEDY)
    async with RolloutWorker(hf_worker_cfg(path, model=fp8)) as w:
        want = await w.generate(PROMPTS[0], params)
    async with RolloutWorker(hf_worker_cfg(path, model=fp8, spec=SPEC)) as w:
        m = w.engine.runner.model
        assert m.layers[L].w13 is None and m.layers[L].w13_fp8 is not None
        got = await w.generate(PROMPTS[0], params)
        assert w.metrics()["spec_verifies"] > 0
        await _leak_free(w)
        out = save_pretrained(m, tmp_path / "fp8")
        held = {n: t.clone() for n, t in m.state_dict().items()}
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    cj = json.loads((out / "config.json").read_text())
    assert cj["num_nextn_predict_layers"] == 1
    assert {f"model.layers.{L}.eh_proj", f"model.layers.{L}.shared_head.head", f"model.layers.{L}.mlp.gate"} \
        <= set(cj["quantization_config"]["modules_to_not_convert"])
    async with RolloutWorker(hf_worker_cfg(out, model=fp8, spec=SPEC)) as w:
        back = w.engine.runner.model.state_dict()
        assert set(back) == set(held) and all(torch.equal(back[n], t) for n, t in held.items())


async def test_routing_replay_under_mtp_records_the_target_s_layers_as_plain_decoding_does(fitted):
    """``cache.routed_experts``: the MTP layer's router is not recorded; the turn's expert ids are
    those of plain decoding (rejected drafts' rows overwritten by the tokens fed after them)."""
    path = fitted[0]
    params = SamplingParams(max_new_tokens=N, return_routed_experts=True, **GREEDY)
    outs = []
    for spec in ({}, {"spec": SPEC}):
        async with RolloutWorker(hf_worker_cfg(path, cache={"routed_experts": True}, **spec)) as w:
            o = await w.generate(PROMPTS[0], params)
            outs.append(o)
            if spec:
                assert w.metrics()["spec_accepted"] > 0
                await _leak_free(w)
    plain, mtp = outs
    assert mtp.token_ids == plain.token_ids
    assert mtp.routed_experts.shape == plain.routed_experts.shape == (len(PROMPTS[0]) + N - 1, L - 1, 3)
    assert (mtp.routed_experts == plain.routed_experts).all()


async def test_adaptive_mtp_measures_the_chain_and_counts_it(fitted):
    """Without cost tables the engine measures the verify and the MTP chain on the D stream; the
    chain's table covers every K at every batch size, and greedy outputs stay plain decoding's."""
    path, model, mtp = fitted
    cfg = hf_worker_cfg(path, spec={**SPEC, "adaptive": True})
    async with RolloutWorker(cfg) as w:
        costs = w.engine.spec.costs
        assert costs is not None and costs.drafting is not None
        assert len(costs.drafting) == len(costs.batches)
        assert all(set(row) == set(range(1, K + 1)) and all(v > 0 for v in row.values()) for row in costs.drafting)
        # a longer chain costs more (one more MTP pass a draft), over the batch sizes (one size's
        # median of 3 can flip on a loaded 2-core machine: the suite's other process)
        assert sum(row[K] for row in costs.drafting) > sum(row[1] for row in costs.drafting)
        out = await w.generate(PROMPTS[0], SamplingParams(max_new_tokens=N, **GREEDY))
        await _leak_free(w)
    assert out.token_ids == _hf_models.hf_greedy(model, PROMPTS[0], N)[0]


class _Unresolved(DecodeMeta):
    """The static batch's metadata of a :class:`_Rerun` graph: the CPU reference attention derives
    the key slots from the block table at every pass (as a captured graph recomputes them at
    every replay), not once at capture."""

    def resolve(self) -> None:
        self.key_slots = None
        DecodeMeta.resolve(self)


class _Rerun:
    """A CPU stand-in for a captured CUDA graph (the GPU path is ``torch.cuda.CUDAGraph``, run by
    the GPU gate's ``spec`` section): a replay runs the captured function again over the static
    inputs and writes its results into the outputs it gave at capture, as a replay writes a
    graph's static outputs."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for static, now in zip(self.out, self.fn()):
            static.copy_(now)


def _stand_in_graphs(w, sizes: tuple[int, ...], context: int):
    """The worker's MTP decode graphs at ``sizes`` over ``context`` keys, each "captured" by
    :class:`_Rerun` (the static buffers, padding, catch-up inputs and stash copies are the CUDA
    path's own code)."""
    from ainfer_pd.engine.runtime.mtp_graphs import MtpDecodeGraphs

    class StandIn(MtpDecodeGraphs):
        def _record(self, fn, dev):
            out = fn()
            return _Rerun(fn, out), out

        def _fb(self, s, verify=False):
            fb = super()._fb(s, verify)
            fb.decode = _Unresolved(*(getattr(fb.decode, f.name) for f in dataclasses.fields(DecodeMeta)))
            return fb

    r = w.engine.runner
    g = StandIn(r, sizes, (context,), r.scratch_slot, w.engine.decode_ctx, None)    # records no CUDA graph: no stream
    with torch.inference_mode():
        for B in sizes:                  # both sets where the runner verifies in turn groups
            g._capture(B, g.max_context, r.device)
            if g.width > 1:
                g._capture(B, g.max_context, r.device, verify=True)
    r.graphs = g
    r.decode_paths = {k: 0 for k in r.decode_paths}
    return g


async def test_mtp_decode_graphs_replay_the_pass_and_its_catch_up(fitted):
    """Every D iteration (verifies and overlapped ones) replays an MTP decode graph, padded to its
    bucket (sizes 5 and 12: most batches are padded): the drafts still equal the reference chain
    and the tokens transformers' greedy ones, the stashes come from the graph's hidden-state
    output; a cost measurement's batch (no catch-up) replays the same graph and leaves every stash
    and the MTP KV of the rows alone."""
    from ainfer_pd.engine.runtime.runner import BatchPlan
    from ainfer_pd.engine.runtime.verify_costs import _decode_batch
    path, model, mtp = fitted
    async with RolloutWorker(hf_worker_cfg(path, spec=SPEC)) as w:
        g = _stand_in_graphs(w, (5, 12), 128)
        r = w.engine.runner
        rec = _record(w)
        outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=N, **GREEDY)) for p in PROMPTS))
        await asyncio.gather(*(w.continue_(o.trajectory_id, OBS, SamplingParams(max_new_tokens=12, **GREEDY))
                               for o in outs))
        assert r.decode_paths["graph"] == g.num_replays > N // (K + 1)
        assert r.decode_paths["eager-past-graphs"] == r.decode_paths["eager-no-graphs"] == 0
        assert w.metrics()["spec_verifies"] > 0
        assert g.width > 1 and 0 < g.num_verify_replays <= w.metrics()["spec_verifies"]    # verifies: their own set
        stash = {tid: (st.p0, st.h.clone()) for tid, st in r.drafter.stash.items()}
        kv = r.drafter.mtp_kv()[:, :r.scratch_slot].clone()
        with torch.inference_mode():
            r.decode(BatchPlan(_decode_batch(r, 2, 3, 40), [], [], []), w.engine.decode_ctx)
        assert g.num_replays == r.decode_paths["graph"]
        assert {tid: st.p0 for tid, st in r.drafter.stash.items()} == {tid: p0 for tid, (p0, _) in stash.items()}
        assert all(torch.equal(r.drafter.stash[tid].h, h) for tid, (_, h) in stash.items())
        assert torch.equal(r.drafter.mtp_kv()[:, :r.scratch_slot], kv)
        await _leak_free(w)
    _check_drafts(rec, model, mtp)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == _hf_models.hf_greedy(model, p, N)[0]


async def test_mtp_decode_graphs_under_the_overlapped_d_loop_keep_the_reference_chain(fitted):
    """The overlapped D loop on the stand-in graphs: rows fed on the device (their first MTP row's
    stash written by the iteration in flight, copied from its graph's hidden-state output after
    that replay), then the long row speculates from that state: its drafts are the reference
    chain's, its tokens transformers' greedy ones."""
    path, model, mtp = fitted
    costs = {1: {1: 0.01, 2: 0.0101, 3: 0.0102, 4: 0.0103}, 2: {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}}
    async with RolloutWorker(hf_worker_cfg(path, spec={**SPEC, "adaptive": True, "verify_costs": costs})) as w:
        assert w.engine.overlap_decode
        g = _stand_in_graphs(w, (2, 5), 128)
        rec = _record(w)
        short, long_ = await asyncio.gather(w.generate(PROMPTS[1], SamplingParams(max_new_tokens=6, **GREEDY)),
                                            w.generate(PROMPTS[0], SamplingParams(max_new_tokens=N, **GREEDY)))
        r = w.engine.runner
        assert w.metrics()["d_rows_fed"] > 0 and w.metrics()["spec_verifies"] > 0
        assert r.decode_paths["graph"] == g.num_replays > 0 and r.decode_paths["eager-past-graphs"] == 0
        await _leak_free(w)
    assert long_.token_ids == _hf_models.hf_greedy(model, PROMPTS[0], N)[0]
    assert short.token_ids == _hf_models.hf_greedy(model, PROMPTS[1], 6)[0]
    _check_drafts(rec, model, mtp)

PARALLEL = {"world_size": 2, "attn_dp": 2, "expert_parallel": 2, "expert_backend": "torch", "rendezvous_timeout_s": 60.0}
RANK_KEYS = ("spec_verifies", "spec_accepted", "spec_drafted")


async def _rank_mtp(rank: int, world_size: int, path: str, spec: dict = SPEC, policy: str = "fine-grained"):
    """Rank ``rank`` serves PROMPTS[rank] (two turns) on attention DP 2 x EP 2, MTP drafting: its
    tokens, the drafts each row was offered (before the world's K), counters, leak-free, each
    verify round's K."""
    async with RolloutWorker(hf_worker_cfg(path, policy, spec=spec, parallel=PARALLEL)) as w:
        sp = w.engine.spec
        costs = w.engine.dist.spec_costs
        rec = record_offers(sp)
        ks = spy_ks(w.engine.dist)
        o = await w.generate(PROMPTS[rank], SamplingParams(max_new_tokens=N, **GREEDY))
        o2 = await w.continue_(o.trajectory_id, OBS, SamplingParams(max_new_tokens=12, **GREEDY))
        m = w.metrics()
        await w.release(o.trajectory_id)
        free = w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks and not sp.drafter.stash
    return list(o.token_ids), list(o2.token_ids), rec, {k: m.get(k, 0) for k in RANK_KEYS}, free, ks, costs


@pytest.mark.parametrize("policy", ["fine-grained", "normal", "global-enqueue"])   # (mixed-chunked: one rank)
def test_mtp_on_adp2_ep2_drafts_the_reference_chain_and_gives_greedy_tokens(fitted, policy):
    """Two gloo ranks, attention DP with the experts (the MTP layer's too) split over them: every
    pass's catch-up and every verify round's chain run on both ranks (the MTP layer's expert
    exchange and D's DP-attention gather pair up; the chain at the world's depth over padded
    rows), the drafts equal the reference chain, the tokens transformers' greedy ones, K is the
    world's (the same sum on both), no KV block or stash is left."""
    from tests._dist_util import run_ranks
    path, model, mtp = fitted
    res = run_ranks(_rank_mtp, 2, str(path), SPEC, policy, timeout_s=180)
    for rank, (t1, t2, rec, m, free, _, _) in enumerate(res):
        p = PROMPTS[rank]
        assert t1 == _hf_models.hf_greedy(model, p, N)[0]
        assert t2 == _hf_models.hf_greedy(model, p + t1 + OBS, 12)[0]
        assert free
        assert m["spec_verifies"] > 0 and 0 < m["spec_accepted"] < m["spec_drafted"], m
        _check_drafts(rec, model, mtp)
    a, b = res[0][5], res[1][5]               # each round's K, as each rank agreed it (the rounds both saw)
    n = min(len(a), len(b))
    assert n > 0 and a[:n] == b[:n] and any(a[:n]), (a, b)


def test_adaptive_mtp_on_adp2_ep2_measures_one_world_table_of_verify_and_chain(fitted):
    """Without tables every rank measures the verify and the MTP chain (their collectives pair up
    across the ranks) and both keep the world's tables, the chain's included; tokens stay greedy."""
    from tests._dist_util import run_ranks
    path, model, _ = fitted
    res = run_ranks(_rank_mtp, 2, str(path), {**SPEC, "adaptive": True}, timeout_s=180)
    assert res[0][6] == res[1][6] and res[0][6] is not None and res[0][6].drafting is not None
    for rank, (t1, t2, _, _, free, _, _) in enumerate(res):
        assert t1 == _hf_models.hf_greedy(model, PROMPTS[rank], N)[0] and free
        assert t2 == _hf_models.hf_greedy(model, PROMPTS[rank] + t1 + OBS, 12)[0]


def test_a_world_chain_has_the_same_rows_at_every_step_and_pads_past_caps_and_jobs():
    """Several ranks: R rows at every step (the chain's collectives pair up across ranks), job r at
    n_r - 2 + j while its cap exceeds j, every other row padding (position 0, one key, the scratch
    slot and block); step 0 feeds the jobs' last tokens."""
    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.spec.mtp_batch import world_chain_batches
    kv = KVCacheManager(16, 4)
    kv.reserve("a", 20, list(range(10)))
    kv.reserve("b", 20, list(range(7)))
    scratch_block, scratch = 16, 16 * 4
    jobs = [("a", 10, 77, 3), ("b", 7, 88, 1)]                  # (tid, length, last token, cap), caps descending
    steps = world_chain_batches(kv, "cpu", jobs, 4, 3, scratch, scratch_block)
    assert len(steps) == 3 and all(fb.positions.shape[0] == 4 for fb in steps)
    assert steps[0].input_ids.tolist() == [77, 88, 0, 0]
    for j, fb in enumerate(steps):
        live = [r for r, job in enumerate(jobs) if job[3] > j]
        for r in range(4):
            p, slot, n = int(fb.positions[r]), int(fb.write_slots[r]), int(fb.decode.ctx_lens[r])
            if r in live:
                tid, length = jobs[r][:2]
                assert (p, n, slot) == (length - 2 + j, length - 1 + j, kv.slot_of(tid, length - 2 + j))
                assert fb.decode.block_table[r, :2].tolist() == kv.block_table([tid], 2)[0, :2].tolist()
            else:
                assert (p, n, slot) == (0, 1, scratch) and fb.decode.block_table[r, 0] == scratch_block
    with pytest.raises(ValueError, match="over a world chain of 1"):
        world_chain_batches(kv, "cpu", jobs, 1, 3, scratch, scratch_block)
