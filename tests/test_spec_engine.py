"""Speculative decoding inside the D iteration (issue 38), on the committed small real model (its
rollouts repeat themselves and their siblings, so drafts are accepted and rejected): greedy and
seeded outputs and logprobs equal decoding without speculation under every policy, stop tokens
and length limits inside an accepted run, aborts mid-verify and a partial-rollout resume, no KV
leak, the adaptive choice from the verify cost table, and the refusals."""
from __future__ import annotations

import asyncio

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import ConfigError, UnsupportedOptionError
from tests._spec_helpers import abort_mid_verify_then_resume
from tests.conftest import hf_worker_cfg, tiny_cfg
from tests.test_small_model import DIR, OBSERVATION, PROMPT

SPEC = {"method": "suffix", "adaptive": False, "num_draft_tokens": 4}
N = 48


@pytest.fixture(scope="module")
def ids():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DIR)
    return tok(PROMPT)["input_ids"], tok(OBSERVATION)["input_ids"]


def _params(stop_at: list[int] | None = None) -> list[SamplingParams]:
    """Two greedy siblings, a greedy one with a stop token, one with an odd length limit, and
    seeded samples (temperature, top-k / top-p, repetition penalty)."""
    g = dict(temperature=0.0, ignore_eos=True)
    out = [SamplingParams(max_new_tokens=N, **g), SamplingParams(max_new_tokens=N, **g),
           SamplingParams(max_new_tokens=7, **g)]
    if stop_at:
        out.append(SamplingParams(max_new_tokens=N, stop_token_ids=stop_at, **g))
    out += [SamplingParams(max_new_tokens=N, temperature=0.8, seed=11, ignore_eos=True),
            SamplingParams(max_new_tokens=N, temperature=0.7, top_k=20, top_p=0.9, seed=12, ignore_eos=True),
            SamplingParams(max_new_tokens=N, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)]
    return out


async def _rollout(cfg, prompt, obs, params):
    """Every row's two turns (generate, then continue_ on its retained KV), then release."""
    async with RolloutWorker(cfg) as w:
        outs = await asyncio.gather(*(w.generate(prompt, p) for p in params))
        nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, obs, p) for o, p in zip(outs, params)))
        res = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs + nxt]
        for o in nxt:
            await w.release(o.trajectory_id)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks
        if w.engine.spec is not None:
            sp = w.engine.spec
            assert not (sp.drafter.groups or sp.held or sp.backoff or sp.pending or sp.pending_group)   # released: forgotten
        return res, w.metrics()


def _same(a, b) -> None:
    assert [(t, r) for t, r, _ in a] == [(t, r) for t, r, _ in b]
    for (_, _, la), (_, _, lb) in zip(a, b):
        assert la == pytest.approx(lb, abs=1e-4)


@pytest.fixture(scope="module")
def plain(ids):
    prompt, obs = ids
    probe, _ = asyncio.run(_rollout(hf_worker_cfg(DIR), prompt, obs, _params()))
    stop = [probe[0][0][12]]                       # the 13th greedy token: a stop inside a run
    params = _params(stop)
    res, _ = asyncio.run(_rollout(hf_worker_cfg(DIR), prompt, obs, params))
    return params, res


@pytest.mark.parametrize("policy", ["normal", "global-enqueue", "fine-grained", "mixed-chunked"])
def test_speculation_gives_plain_decoding_s_tokens_and_logprobs(ids, plain, policy):
    prompt, obs = ids
    params, want = plain
    got, m = asyncio.run(_rollout(hf_worker_cfg(DIR, policy, spec=SPEC), prompt, obs, params))
    _same(got, want)
    assert any(r == "stop" for _, r, _ in got) and any(r == "length" and len(t) == 7 for t, r, _ in got)
    # drafts were verified, some accepted, some rejected
    assert m["spec_verifies"] > 0 and 0 < m["spec_accepted"] < m["spec_drafted"]
    assert m["spec_tokens_per_row_pass"] > 1.2
    assert m["spec_host_ms"] > 0                # drafting iterations measured their host time


@pytest.mark.parametrize("policy", ["normal", "fine-grained"])
def test_speculation_beside_preemption_gives_plain_decoding_s_tokens(ids, policy):
    """Output blocks taken as rows decode (``cache.reserve_output: estimate``) on a pool too small for
    every row's turn: a verify pass's draft positions are grown before it, and preempted rows resume
    with the tokens and logprobs of plain decoding on a pool that holds everything (the rows run to
    their length: no stop token, so the pool fills)."""
    prompt, obs = ids
    params = _params()
    want, _ = asyncio.run(_rollout(hf_worker_cfg(DIR), prompt, obs, params))
    cache = {"reserve_output": "estimate", "num_blocks": 18}
    got, m = asyncio.run(_rollout(hf_worker_cfg(DIR, policy, spec=SPEC, cache=cache), prompt, obs, params))
    _same(got, want)
    assert m["kv_preemptions"] > 0 and m["spec_verifies"] > 0


def test_abort_mid_verify_keeps_committed_tokens_and_resume_equals_the_whole_run(ids):
    prompt, _ = ids
    greedy = dict(temperature=0.0, ignore_eos=True)

    async def go():
        async with RolloutWorker(hf_worker_cfg(DIR, spec=SPEC)) as w:
            # abort while a verify pass of A is on the device
            k, rest = await abort_mid_verify_then_resume(w, prompt, N, greedy, min_out=6, timeout=30)
            assert rest.num_cached_tokens == len(prompt) + k - 1       # only committed KV was kept
            for tid in ("A", "F"):
                await w.release(tid)
            assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks

    asyncio.run(go())


def test_the_adaptive_choice_follows_the_verify_cost_table(ids, plain):
    """Widths that cost as much as their tokens: never speculate (and the output is the same);
    nearly free widths: speculate."""
    prompt, obs = ids
    params, want = plain
    dear = {B: {1: 0.01, 2: 0.02, 3: 0.03, 5: 0.05} for B in (1, 4, 16)}
    cheap = {B: {1: 0.01, 2: 0.0101, 3: 0.0102, 5: 0.0104} for B in (1, 4, 16)}
    for table, speculates in ((dear, False), (cheap, True)):
        spec = {**SPEC, "adaptive": True, "verify_costs": table}
        got, m = asyncio.run(_rollout(hf_worker_cfg(DIR, spec=spec), prompt, obs, params))
        _same(got, want)
        assert (m.get("spec_verifies", 0) > 0) is speculates


def _count(obj, name: str, calls: dict) -> None:
    """Count the calls of ``obj.name`` in ``calls[name]``."""
    f = getattr(obj, name)

    def spy(*a, **kw):
        calls[name] += 1
        return f(*a, **kw)
    setattr(obj, name, spy)


def test_a_table_that_never_pays_costs_the_d_loop_no_per_row_work(ids, plain):
    """Widths that cost as much as their tokens: each D iteration is decided from the table alone
    (no row's cap or backoff read, nothing drafted), every iteration is overlapped, and no token is
    indexed into the drafter (sequences are given lazily, when a row of their group is drafted;
    indexing every ended row's tokens and forgetting them at release made such a rollout ~30%
    slower than spec off on the H200), so the release has nothing to forget."""
    prompt, obs = ids
    params, want = plain
    dear = {B: {1: 0.01, 2: 0.02, 3: 0.03, 5: 0.05} for B in (1, 4, 16)}

    async def go():
        cfg = hf_worker_cfg(DIR, spec={**SPEC, "adaptive": True, "verify_costs": dear})
        async with RolloutWorker(cfg) as w:
            sp, d = w.engine.spec, w.engine.d
            calls = {"cap": 0, "probes": 0, "extend": 0, "_plain": 0}
            _count(sp, "cap", calls), _count(sp, "probes", calls), _count(sp.drafter, "extend", calls)
            _count(d, "_plain", calls)
            outs = await asyncio.gather(*(w.generate(prompt, p) for p in params))
            nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, obs, p) for o, p in zip(outs, params)))
            assert calls == {"cap": 0, "probes": 0, "extend": 0, "_plain": 0}
            assert d.overlap and d.num_iters > 0 and sp.pending
            assert sp.metrics()["spec_empty_plans"] == 0 and not sp.drafter.groups
            for o in nxt:
                await w.release(o.trajectory_id)
            assert not (sp.pending or sp.pending_group or sp.held)
            return [(o.token_ids, o.finish_reason, o.logprobs) for o in outs + nxt]
    _same(asyncio.run(go()), want)


def test_rows_with_no_draft_keep_the_d_loop_overlapped():
    """Seeded samples at temperature 1.5 rarely repeat a 3-gram: with speculation on (not
    adaptive: every probing row would be drafted) the overlapped D loop reads the iteration in
    flight only for a row whose known tokens give a draft (:meth:`~ainfer_pd.spec.speculator.
    Speculator.stale_hit`); the rows with none back off on those probes, so most iterations stay
    overlapped (before, each one with a probing row gave its overlap up), and the tokens equal
    spec off."""
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, seed=100 + i, ignore_eos=True) for i in range(6)]
    prompts = [[1000 + 37 * i + j for j in range(12)] for i in range(6)]

    async def go(spec: bool):
        cfg = hf_worker_cfg(DIR, **({"spec": {**SPEC}} if spec else {}))
        async with RolloutWorker(cfg) as w:
            calls = {"stale_hit": 0, "prepare": 0}
            if spec:
                _count(w.engine.spec, "stale_hit", calls), _count(w.engine.spec, "prepare", calls)
            outs = await asyncio.gather(*(w.generate(p, sp) for p, sp in zip(prompts, params)))
            m = w.metrics()
            assert w.engine.d.overlap
            return [o.token_ids for o in outs], m, calls
    off, m_off, _ = asyncio.run(go(False))
    on, m_on, calls = asyncio.run(go(True))
    assert on == off
    assert calls["stale_hit"] > 0 and calls["prepare"] < 0.25 * m_on["d_iter_s_count"], (calls, m_on["d_iter_s_count"])
    assert m_on["d_rows_fed"] > 0.5 * m_off["d_rows_fed"], (m_on["d_rows_fed"], m_off["d_rows_fed"])


def test_measured_verify_costs_at_start(ids):
    """Adaptive without a table: the engine measures one at start (width 1 included)."""
    async def go():
        async with RolloutWorker(tiny_cfg(**{"spec.method": "suffix", "spec.num_draft_tokens": 2,
                                             "scheduler.max_decode_batch": 4, "model.num_layers": 1})) as w:
            costs = w.engine.spec.costs
            assert costs.batches == (1, 4) and all(set(r) == {1, 2, 3} and r[1] == 1.0 for r in costs.ratios)
            out = await w.generate([1, 2, 3], SamplingParams(max_new_tokens=5, temperature=0.0))
            assert len(out.token_ids) == 5
    asyncio.run(go())


def test_refusals():
    with pytest.raises(UnsupportedOptionError, match="mtp"):
        tiny_cfg(**{"spec.method": "mtp"})
    with pytest.raises(UnsupportedOptionError, match="overlap_decode"):
        tiny_cfg(**{"spec.method": "suffix", "scheduler.overlap_decode": True})
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        tiny_cfg(**{"spec.method": "suffix", "spec.num_draft_tokens": 9})
    with pytest.raises(ConfigError, match="verify_costs"):
        tiny_cfg(**{"spec.method": "suffix", "spec.verify_costs": {4: {2: 0.1}}})


def test_the_stale_probe_and_its_read_happen_outside_the_turnstile_round(ids):
    """Fine-grained, rows decoding while prompts arrive: a D iteration decides whether it drafts,
    and reads the iteration in flight for the stale probe's hit, before its turnstile round, so P
    (stopped at its boundary through the round, until the launch's ACK) never waits for that read
    or that host work. Tokens equal speculation off."""
    prompt, obs = ids
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(4)]
    late = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True) for _ in range(6)]

    async def go(spec: bool):
        cfg = hf_worker_cfg(DIR, "fine-grained", **({"spec": {**SPEC}} if spec else {}))
        async with RolloutWorker(cfg) as w:
            seen = {"in_round": 0, "settles": 0, "rounds": 0}
            ts, d = w.engine.turnstile, w.engine.d
            before, after, settle = ts.before_decode, ts.after_decode, d.settle
            state = {"open": False}

            async def before_decode():
                rnd = await before()
                state["open"] = rnd is not None
                seen["rounds"] += rnd is not None
                return rnd

            async def after_decode(rnd):
                state["open"] = False
                return await after(rnd)

            async def spy_settle():
                if d.prev is not None:
                    seen["settles"] += 1
                    seen["in_round"] += state["open"]
                return await settle()
            ts.before_decode, ts.after_decode, d.settle = before_decode, after_decode, spy_settle

            async def arrive(i, p):
                await asyncio.sleep(0.05 * (i + 1))
                return await w.generate(obs[: 24 + 8 * i], p)
            outs = await asyncio.gather(*(w.generate(prompt, p) for p in params),
                                        *(arrive(i, p) for i, p in enumerate(late)))
            return [o.token_ids for o in outs], seen
    off, _ = asyncio.run(go(False))
    on, seen = asyncio.run(go(True))
    assert on == off
    assert seen["rounds"] > 0 and seen["settles"] > 0, seen
    assert seen["in_round"] == 0, seen


def test_the_overlap_a_draft_gives_up_is_charged_to_the_speculator(ids, monkeypatch):
    """Overlapped D loop (normal): when a stale hit reads the iteration in flight early, or a
    verify is read before the next launch is built, the launch after it waits for the host; the
    speculator is charged that device idle (``lost_s``, counted against drafting with its host
    time), measured from the device end of the iteration read before to the launch's device start.
    Tokens equal speculation off."""
    from ainfer_pd.spec.overhead import DraftOverhead
    prompt, _ = ids
    params = [SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(4)]
    charged: list[tuple[float, float, float]] = []       # (lost, the launch's device start, the end before)

    async def go(spec: bool):
        cfg = hf_worker_cfg(DIR, "normal", **({"spec": {**SPEC}} if spec else {}))   # overlap_decode auto
        async with RolloutWorker(cfg) as w:
            d = w.engine.d
            charge = d._charge_gap

            def spy(work):
                before, gap = d._last_end, work is d._gap_launch
                charge(work)
                if gap and before is not None and work.interval is not None:
                    charged.append((d.spec.overhead.lost_s, work.interval[0], before))
            monkeypatch.setattr(d, "_charge_gap", spy)
            outs = await asyncio.gather(*(w.generate(prompt, p) for p in params))
            return [o.token_ids for o in outs], (d.spec.overhead.lost_s if d.spec is not None else None)
    off, _ = asyncio.run(go(False))
    seen: list[float] = []
    real = DraftOverhead.observe_lost
    monkeypatch.setattr(DraftOverhead, "observe_lost", lambda self, s: (seen.append(s), real(self, s))[1])
    on, lost = asyncio.run(go(True))
    assert on == off
    assert seen and len(seen) == len(charged), (seen, charged)
    for s, (_, start, end) in zip(seen, charged):
        assert s == pytest.approx(max(0.0, start - end))         # the idle between the two device intervals
    assert lost > 0.0


def test_only_the_launch_after_a_break_is_charged_its_device_idle():
    """The charge itself: the launch marked as following a break is charged the idle from the
    device end of the iteration read before it to its device start, once; any other launch, or
    one without a recorded interval, is charged nothing. (The driver marks no launch when a P
    epoch began since the break, P is running, or D's next iteration started later than one D
    iteration's time after a verify's read.)"""
    from types import SimpleNamespace
    from ainfer_pd.engine.loop.d_driver import DDriver
    lost = []
    d = DDriver.__new__(DDriver)
    d.spec = SimpleNamespace(overhead=SimpleNamespace(observe_lost=lost.append))
    d._last_end, d._gap_launch = 1.0, None
    w = SimpleNamespace(interval=(1.25, 2.0))
    d._gap_launch = w
    d._charge_gap(w)
    assert lost == [0.25] and d._last_end == 2.0 and d._gap_launch is None
    d._charge_gap(SimpleNamespace(interval=(2.5, 3.0)))             # not the launch after a break
    assert lost == [0.25] and d._last_end == 3.0
    d._gap_launch = w2 = SimpleNamespace(interval=None)              # no device interval: nothing
    d._charge_gap(w2)
    assert lost == [0.25]
