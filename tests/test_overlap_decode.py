"""The overlapped D loop (``scheduler.overlap_decode``): same tokens as the plain loop, no KV leak,
stop tokens, length limits, aborts, continuations and repetition penalties (CPU device)."""
import asyncio

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.loop.d_overlap import InFlightD, ends_at, rows_after
from ainfer_pd.errors import ConfigError
from ainfer_pd.tools.replay import replay
from ainfer_pd.tools.trace import p_heavy_trace
from tests.conftest import tiny_cfg

POLICIES = ("normal", "global-enqueue", "fine-grained")


async def _replay(policy: str, overlap: bool, trace):
    cfg = tiny_cfg(**{"scheduler.policy": policy, "scheduler.overlap_decode": overlap, "model.num_layers": 2})
    async with RolloutWorker(cfg) as w:
        res = await replay(w, trace, cell="trace", seed=0, raise_errors=True)
        m = w.metrics()
        assert w.kv_leak_free()
    return res.outputs, m


@pytest.mark.parametrize("policy", POLICIES)
def test_overlapped_decode_gives_the_plain_loop_s_tokens(policy):
    """A multi-turn trace (continuations on retained KV, P beside D): every output equal."""
    trace = p_heavy_trace(6, 3, prompt_tokens=200, observation_tokens=60, gen_tokens=20, tool_wait_s=0.005)
    plain, _ = asyncio.run(_replay(policy, False, trace))
    over, m = asyncio.run(_replay(policy, True, trace))
    assert over == plain
    assert m["d_rows_fed"] > 0.5 * m["d_iter_s_count"]        # it did overlap: rows fed on the device


async def _generate_all(overlap: bool, prompts, params):
    cfg = tiny_cfg(**{"scheduler.overlap_decode": overlap, "model.num_layers": 2})
    async with RolloutWorker(cfg) as w:
        outs = await asyncio.gather(*(w.generate(p, sp) for p, sp in zip(prompts, params)))
        # the next turn of every trajectory reuses the KV its first turn left (a stop token's
        # unused pass wrote one slot past the end: the continuation must not see it)
        nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, [7, 8, 9], SamplingParams(max_new_tokens=6,
                                                                                            temperature=0.0))
                                     for o in outs))
        for o in outs:
            await w.release(o.trajectory_id)
        assert w.kv_leak_free()
        m = w.metrics()
    return [(o.token_ids, o.finish_reason) for o in outs], [(o.token_ids, o.finish_reason) for o in nxt], m


def test_stop_tokens_seeds_and_length_limits_match_the_plain_loop():
    """Rows that end by a stop token (the next pass already launched), by max_new_tokens (known
    ahead) and seeded temperature / top-k / top-p rows: the same tokens, then the same
    continuations on their retained KV."""
    prompts = [[11 + i, 40 + i, 3, 5 + i] for i in range(8)]
    probe = asyncio.run(_generate_all(False, prompts, [SamplingParams(max_new_tokens=12, temperature=0.0)] * 8))[:2]
    # stop on the 4th token the greedy run produced for half the rows: they end mid-batch
    params = []
    for i, (toks, _) in enumerate(probe[0]):
        if i % 2 == 0:
            params.append(SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[toks[3]]))
        elif i % 4 == 1:
            params.append(SamplingParams(max_new_tokens=3 + i, temperature=0.0))
        else:
            params.append(SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i))
    *plain, _ = asyncio.run(_generate_all(False, prompts, params))
    *over, m = asyncio.run(_generate_all(True, prompts, params))
    assert over == plain
    assert any(r == "stop" for _, r in over[0]) and any(r == "length" for _, r in over[0])
    assert m["d_rows_fed"] > 0 and m["d_rows_unused"] > 0      # stop-token rows ran one unused pass


def test_repetition_penalty_rows_overlap_and_count_the_token_fed_on_the_device():
    """A penalized row's history lacks the token the iteration in flight sampled: the penalty takes
    it from the pass's input ids on the device, so penalized rows are fed and overlapped like the
    others, and greedy outputs (the penalty changing them) equal the plain loop's."""
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7], [5, 5, 5, 5]]
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=10, temperature=0.0),
              SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=3.0, ignore_eos=True)]
    *over, m = asyncio.run(_generate_all(True, prompts, params))
    *plain, _ = asyncio.run(_generate_all(False, prompts, params))
    *unpenalized, _ = asyncio.run(_generate_all(False, prompts, [SamplingParams(max_new_tokens=p.max_new_tokens,
                                                                               temperature=0.0,
                                                                               ignore_eos=p.ignore_eos)
                                                                for p in params]))
    assert over == plain
    assert over[0][2] != unpenalized[0][2]                    # the penalty changed what it decodes
    assert m["d_rows_fed"] > m["d_iter_s_count"]              # most iterations fed several rows, penalized ones too


def test_an_abort_mid_decode_leaves_no_kv_and_the_others_run_on():
    async def main():
        cfg = tiny_cfg(**{"scheduler.overlap_decode": True, "model.num_layers": 2})
        async with RolloutWorker(cfg) as w:
            long = asyncio.create_task(w.generate([1, 2, 3], SamplingParams(max_new_tokens=400, temperature=0.0,
                                                                            ignore_eos=True)))
            other = asyncio.create_task(w.generate([4, 5, 6], SamplingParams(max_new_tokens=30, temperature=0.0)))
            while not w.engine.book.decoding:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            await w.abort(long_tid := next(t.tid for t in w.engine.book.decoding if t.params.max_new_tokens == 400))
            out = await long
            assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 400
            assert (await other).finish_reason in ("stop", "length")
            await w.release(long_tid)
            await w.release((await other).trajectory_id)
            assert w.kv_leak_free()
    asyncio.run(main())


class _T:
    def __init__(self, out, max_new, ctx=4):
        self.out_tokens = [0] * out
        self.context = [0] * ctx
        self.params = SamplingParams(max_new_tokens=max_new)

    @property
    def seq_len(self):
        return len(self.context) + len(self.out_tokens)


def test_rows_after_leaves_out_rows_the_previous_iteration_ends_by_length():
    a, b, c = _T(1, 10), _T(9, 10), _T(2, 10)          # b draws its 10th token in prev: it ends there
    assert ends_at(b, 4096) and not ends_at(a, 4096)
    prev = InFlightD(None, None, [a, b], 0.0, {id(a): 0, id(b): 1})
    rows, ahead = rows_after([a, b, c], prev, 4096)
    assert rows == [a, c] and ahead == [1, 0]
    assert rows_after([a, b, c], None, 4096) == ([a, b, c], [0, 0, 0])
    assert ends_at(_T(1, 100, ctx=14), 16)             # the context limit counts too


def test_overlap_decode_is_refused_where_it_does_not_run():
    from ainfer_pd.engine.make import check_engine_support
    from ainfer_pd.errors import NotBuiltError
    for g in (1, 2):      # the lockstep engine (world size 1 with torch expert dispatch, or more ranks)
        with pytest.raises(NotBuiltError, match="overlap_decode"):
            check_engine_support(tiny_cfg(**{"scheduler.overlap_decode": True, "parallel.world_size": g,
                                             "parallel.expert_parallel": g, "parallel.expert_backend": "torch"}))
    with pytest.raises(ConfigError, match="mixed-chunked"):
        tiny_cfg(**{"scheduler.policy": "mixed-chunked", "scheduler.overlap_decode": True})
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ConfigError, match="true, false or auto"):
            tiny_cfg(**{"scheduler.overlap_decode": bad})


def test_overlap_decode_auto_runs_the_overlapped_loop_where_the_engine_has_one():
    """The default, ``auto``: the single-rank engine overlaps; mixed-chunked and the multi-rank
    engine run a plain D iteration, and no configuration is refused for it."""
    from ainfer_pd.engine.engine import Engine
    from ainfer_pd.engine.make import check_engine_support
    from ainfer_pd.metrics.recorder import Recorder
    assert tiny_cfg().scheduler.overlap_decode == "auto"
    for value, on in (("auto", True), (True, True), (False, False)):
        eng = Engine(tiny_cfg(**{"scheduler.overlap_decode": value}), Recorder())
        assert eng.overlap_decode is on and eng.d.overlap is on
        eng.shutdown()
    assert Engine(tiny_cfg(**{"scheduler.policy": "mixed-chunked"}), Recorder()).overlap_decode is False
    check_engine_support(tiny_cfg(**{"parallel.world_size": 2, "parallel.expert_parallel": 2,
                                     "parallel.expert_backend": "torch"}))    # auto: the lockstep plain loop


def test_overlap_decode_reads_true_false_and_auto_from_yaml(tmp_path):
    from ainfer_pd.config import WorkerConfig
    for text, want in (("true", True), ("false", False), ("auto", "auto")):
        path = tmp_path / f"{text}.yaml"
        path.write_text(f"scheduler:\n  overlap_decode: {text}\n")
        assert WorkerConfig.from_yaml(path).scheduler.overlap_decode == want


@pytest.mark.parametrize("policy", ("normal", "fine-grained"))
def test_a_row_whose_distribution_turns_nan_fails_alone_overlapped(policy, monkeypatch):
    """The sampling runs on the D stream (d_overlap.sample_on_device), overlapped or not: a row
    whose logits turn NaN mid-decode ends alone with SamplingError, the greedy rows batched with
    it finish with the same tokens in both loops, and nothing leaks."""
    import math

    from ainfer_pd.engine.loop import d_overlap
    from ainfer_pd.errors import SamplingError
    real = d_overlap.sample_on_device
    steps = {"n": 0}

    def poisoned(logits, rows, **kw):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.params.seed == 4242:
                steps["n"] += 1
                if steps["n"] > 3:
                    logits[i] = math.nan
        return real(logits, rows, **kw)

    monkeypatch.setattr(d_overlap, "sample_on_device", poisoned)
    prompts = [[3 + i, 9, 27 + i, 4] for i in range(3)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)

    async def main(overlap: bool):
        cfg = tiny_cfg(**{"scheduler.policy": policy, "scheduler.overlap_decode": overlap, "model.num_layers": 2})
        async with RolloutWorker(cfg) as w:
            bad = asyncio.ensure_future(w.generate([5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.7,
                                                                             seed=4242, ignore_eos=True)))
            good = await asyncio.gather(*(w.generate(p, greedy) for p in prompts))
            err = None
            try:
                await bad
            except SamplingError as exc:
                err = exc
            for tid in list(w.trajectories):
                await w.release(tid)
            m = w.metrics()
            assert w.kv_leak_free() and m["failures"] == 1 and m["aborted"] == 0
            if overlap:      # it failed with its next pass in flight: its KV went back after that pass
                assert m["d_rows_unused"] >= 1
        return [o.token_ids for o in good], err

    over, err = asyncio.run(main(True))
    plain, plain_err = asyncio.run(main(False))
    assert isinstance(err, SamplingError) and isinstance(plain_err, SamplingError) and over == plain
