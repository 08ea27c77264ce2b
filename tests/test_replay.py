"""Closed-loop replay against a fake worker (and the real one when it exists); bench + CLI wiring."""
import asyncio
import json
import time
from pathlib import Path

import pytest

from ainfer_pd.config import WorkerConfig
from ainfer_pd.errors import InvalidRequestError, UnknownTrajectoryError
from ainfer_pd.request import SamplingParams, TurnOutput
from ainfer_pd.tools.replay import conversation_token_ids, replay
from ainfer_pd.tools.trace import Conversation, Trace, Turn, make_trace


class FakeWorker:
    """Async stand-in with the RolloutWorker API: greedy output = f(context), latency ~ tokens."""

    def __init__(self, cfg=None, *, per_token_s=0.0005, fail=None, hang=False):
        self.cfg = cfg
        self.per_token_s = per_token_s
        self.fail = fail or set()          # {(trajectory_id, turn)} that raise InvalidRequestError
        self.hang = hang
        self.ctx: dict[str, list[int]] = {}
        self.turn: dict[str, int] = {}
        self.calls: list[tuple[str, str, float]] = []
        self.released: list[str] = []
        self.in_flight = 0
        self.cancelled = 0
        self._n = 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def _run(self, tid, new_ids, params):
        assert isinstance(params, SamplingParams) and params.temperature == 0.0 and params.ignore_eos
        if (tid, self.turn.get(tid, 0)) in self.fail:
            raise InvalidRequestError(f"injected failure {tid}")
        self.in_flight += 1
        t0 = time.perf_counter()
        try:
            if self.hang and self.turn[tid] >= 1:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.per_token_s * len(new_ids))
            ttft = time.perf_counter() - t0
            await asyncio.sleep(self.per_token_s * params.max_new_tokens)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        cached = len(self.ctx[tid])
        self.ctx[tid] = self.ctx[tid] + list(new_ids)
        out = [(sum(self.ctx[tid]) * 31 + i) % 509 + 2 for i in range(params.max_new_tokens)]
        self.ctx[tid] += out
        self.turn[tid] += 1
        return TurnOutput(trajectory_id=tid, token_ids=out, logprobs=[0.0] * len(out), finish_reason="length",
                          num_prompt_tokens=cached + len(new_ids), num_cached_tokens=cached,
                          ttft_s=ttft, latency_s=time.perf_counter() - t0)

    async def generate(self, prompt_ids, params, trajectory_id=None):
        tid = trajectory_id or f"t{self._n}"
        self._n += 1
        self.ctx[tid], self.turn[tid] = [], 0
        self.calls.append(("generate", tid, time.perf_counter()))
        return await self._run(tid, prompt_ids, params)

    async def continue_(self, tid, obs, params):
        if tid not in self.ctx:
            raise UnknownTrajectoryError(tid)
        self.calls.append(("continue", tid, time.perf_counter()))
        return await self._run(tid, obs, params)

    async def release(self, tid):
        self.released.append(tid)
        self.ctx.pop(tid, None)

    def metrics(self):
        return {"d_wait_s_mean": 0.004, "d_wait_s_count": 10, "rendezvous": 7, "rendezvous_s_mean": 0.001,
                "p_wait_permit_s_sum": 0.1, "d_boundary_wait_s_sum": 0.2, "p_enqueue_s_sum": 0.05,
                "busy_fraction": 0.9, "concurrent_fraction": 0.5, "failures": 0,
                "d_wait_s_samples": [0.001, 0.004, 0.007]}

    def timeline(self):
        return [("prefill_segment", "P", 0.0, 0.01, {}), ("decode", "D", 0.005, 0.008, {}),
                ("rendezvous", "R", 0.008, 0.0085, {})]


def small_trace():
    convs = [Conversation([Turn(20, 5, 0.0), Turn(8, 4, 0.05), Turn(6, 3, 0.02)], conv_id=0),
             Conversation([Turn(30, 6, 0.0), Turn(4, 2, 0.01)], conv_id=1),
             Conversation([Turn(10, 3, 0.0)], conv_id=2)]
    return Trace(conversations=convs)


async def test_replay_records_order_and_waits():
    w = FakeWorker()
    tr = small_trace()
    res = await replay(w, tr, cell="trace", seed=1, vocab_size=512)
    assert res.failures == 0 and res.completed == res.num_requests == res.planned_requests == 6
    assert sorted(res.outputs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
    by = {(r.conversation, r.turn): r for r in res.records}
    for (c, t), r in by.items():
        assert r.ok and r.finish_reason == "length"
        assert r.num_output_tokens == r.gen_tokens == tr.conversations[c].turns[t].gen_tokens
        assert r.latency_s >= r.ttft_s >= 0
        if t > 0:
            prev = by[(c, t - 1)]
            assert r.wait_s == pytest.approx(tr.conversations[c].turns[t].tool_wait_s)
            assert r.submit_s >= prev.done_s + r.wait_s - 1e-3          # tool wait respected
            assert r.num_cached_tokens == prev.num_prompt_tokens + prev.num_output_tokens
    # every trajectory: generate, then continues, then release
    assert sorted(w.released) == ["t0", "t1", "t2"]
    assert [k for k, tid, _ in w.calls if tid == "t0"] == ["generate", "continue", "continue"]
    ends = {t.conversation: t.end_s for t in res.trajectories}
    assert res.makespan_s >= max(ends.values())
    assert ends[0] >= 0.07                                          # two waits on conversation 0
    assert res.metrics["rendezvous"] == 7 and res.timeline
    # P1: no waits at all
    res1 = await replay(FakeWorker(), tr, cell="P1", seed=1, vocab_size=512)
    assert all(r.wait_s == 0 for r in res1.records)
    assert res1.outputs == res.outputs                          # same seed -> same prompts -> same greedy outputs


async def test_prompt_ids_seeded_and_in_vocab():
    tr = make_trace(4, 3, token_scale=0.05, seed=0)
    a = conversation_token_ids(tr, 2, seed=7, vocab_size=64)
    assert a == conversation_token_ids(tr, 2, seed=7, vocab_size=64)
    assert a != conversation_token_ids(tr, 2, seed=8, vocab_size=64)
    assert [len(x) for x in a] == [t.new_tokens for t in tr.conversations[2].turns]
    assert all(2 <= i < 64 for x in a for i in x)


async def test_failures_counted_not_raised():
    w = FakeWorker(fail={("t0", 1)})
    res = await replay(w, small_trace(), cell="P1", vocab_size=512)
    assert res.failures == 1
    assert res.completed == 4                       # conv 0 stops after its failed turn (turn 2 never sent)
    assert res.planned_requests == 6 and res.num_requests == 5
    assert any("injected" in e for e in res.errors)
    assert next(t for t in res.trajectories if t.conversation == 0).failed
    assert "t0" in w.released                       # still released
    with pytest.raises(InvalidRequestError):
        await replay(FakeWorker(fail={("t1", 1)}), small_trace(), cell="P1", vocab_size=512, raise_errors=True)


async def test_cancelling_replay_cancels_in_flight_requests():
    w = FakeWorker(hang=True)
    task = asyncio.create_task(replay(w, small_trace(), cell="P1", vocab_size=512))
    for _ in range(50):
        await asyncio.sleep(0.01)
        if sum(k == "continue" for k, _, _ in w.calls) == 2 and w.in_flight == 2:
            break
    assert w.in_flight == 2                          # conversations 0 and 1 hang in their turn 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert w.in_flight == 0 and w.cancelled == 2
    assert sorted(w.released) == ["t0", "t1", "t2"]
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not [t for t in others if "run_conversation" in repr(t.get_coro())]


async def test_progress_bar_and_concurrency_limit():
    res = await replay(FakeWorker(), small_trace(), cell="P2", progress=True, vocab_size=512, max_concurrency=1)
    assert res.completed == 6


# ---------------------------------------------------------------------------------- bench / CLI
async def test_run_bench_with_fake_worker(tmp_path):
    from ainfer_pd.tools import bench
    cfg = WorkerConfig()
    variants = bench.make_variants(["normal", "fine-grained"], spans=["1", "auto"])
    assert [v.name for v in variants] == ["normal", "fine-grained", "fine-grained/K=1", "fine-grained/K=auto"]
    seen = []

    def factory(c):
        seen.append((c.scheduler.policy, c.mux.span))
        return FakeWorker(c)

    res = await bench.run_bench(cfg, small_trace(), variants=variants, cells=["P1", "P3"], repeats=2,
                                out_dir=tmp_path, worker_factory=factory, log=lambda s: None)
    assert len(seen) == 2 * 2 * 4
    assert ("fine-grained", "1") in seen and ("normal", cfg.mux.span) in seen
    assert res.output_mismatches["P1"] == {n: 0 for n in res.variants}
    agg = res.aggregates["P1"]["normal"]
    assert agg["makespan_s"]["n"] == 2 and agg["requests"]["median"] == 6
    tables = res.tables()
    assert "fine-grained/K=1" in tables["P3"] and "x)" in tables["P3"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["baseline"] == "normal" and set(data["aggregates"]) == {"P1", "P3"}
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 16
    for name in ("P1_makespan.png", "P1_ttft_cdf.png", "P1_d_wait_cdf.png", "P1_timeline_normal.png"):
        assert (tmp_path / name).stat().st_size > 0
    with pytest.raises(Exception):
        bench.make_variants(["bogus"])


def test_cli_replay_with_fake_worker(monkeypatch, capsys, tmp_path):
    from ainfer_pd.tools import bench, cli
    monkeypatch.setattr(bench, "default_worker_factory", lambda cfg: FakeWorker(cfg, per_token_s=0.0001))
    rc = cli.main(["replay", "--conversations", "3", "--max-turns", "2", "--no-progress",
                   "--time-scale", "0.001", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "normal" in out and "fine-grained" in out and "makespan" in out
    assert "fine-grained+critical-path" in out          # the main job reports both priorities
    assert (tmp_path / "r" / "results.json").exists()
    rc = cli.main(["bench", "--policies", "normal,global-enqueue", "--cells", "P1,P2", "--repeats", "1",
                   "--conversations", "2", "--max-turns", "2", "--no-progress", "--workload", "p-heavy",
                   "--token-scale", "0.01", "--json"])
    out = capsys.readouterr().out
    assert rc == 0 and "== cell P2 ==" in out and '"aggregates"' in out
    assert cli.main(["replay", "--decode-only", "--conversations", "2", "--token-scale", "0.01",
                     "--no-progress", "--policy", "normal"]) == 0


def test_cli_misc(capsys, tmp_path, monkeypatch):
    import sys
    from ainfer_pd.tools import cli
    assert cli.main(["trace", "--conversations", "8", "--max-turns", "3", "--out", str(tmp_path / "t.jsonl")]) == 0
    assert (tmp_path / "t.jsonl").exists() and "new_tokens" in capsys.readouterr().out
    # the multi-rank replay: two real rank processes (lockstep engine, EP=2) serve the conversations
    assert cli.main(["replay", "--world-size", "2", "--conversations", "2", "--max-turns", "2",
                     "--policies", "fine-grained", "--priorities", "fifo", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "world size 2" in out.out and "fine-grained" in out.out
    monkeypatch.setitem(sys.modules, "ainfer_pd.tools.selftest", None)
    assert cli.main(["selftest", "--help"]) == 2
    assert "not available" in capsys.readouterr().err
    assert cli.main(["replay", "--policy", "nope", "--no-progress"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert cli.main(["replay", "--config", str(tmp_path / "missing.yaml")]) == 2
    with pytest.raises(SystemExit):
        cli.main(["replay", "--cell", "P9"])
    parser = cli.build_parser()
    assert {"replay", "bench", "trace", "trace-check", "selftest"} <= set(
        parser._subparsers._group_actions[0].choices)


# ---------------------------------------------------------------------------------- real worker
def _real_worker():
    try:
        from ainfer_pd import RolloutWorker
    except ImportError:
        return None
    return RolloutWorker


@pytest.mark.skipif(_real_worker() is None, reason="ainfer_pd.RolloutWorker not available yet")
async def test_real_worker_tiny_replay():
    from ainfer_pd.tools.report import summarize
    RolloutWorker = _real_worker()
    cfg = WorkerConfig.from_yaml(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    tr = make_trace(4, 3, token_scale=0.03, max_context=cfg.model.max_context_len, seed=0)
    outs = {}
    for policy in ("normal", "fine-grained"):
        async with RolloutWorker(cfg.replace(**{"scheduler.policy": policy})) as w:
            res = await replay(w, tr, cell="P3", seed=0, time_scale=0.1, raise_errors=True)
        assert res.failures == 0 and res.completed == tr.num_requests
        for r in res.records:
            assert r.num_output_tokens == r.gen_tokens and r.finish_reason == "length"
            if r.turn > 0:
                assert r.num_cached_tokens > 0
        s = summarize(res)
        assert s["makespan_s"] > 0 and s["requests_per_s"] > 0
        outs[policy] = res.outputs
    assert outs["normal"] == outs["fine-grained"]


def test_a_ranks_share_of_a_trace_draws_the_same_token_ids_as_the_whole_trace():
    # the multi-rank replay gives each rank every world_size-th conversation: their prompts must be
    # the ones world size 1 replays, or the greedy tokens of the two cannot be compared
    from ainfer_pd.tools.replay import conversation_token_ids, turn_params
    from ainfer_pd.tools.trace import Trace, make_trace
    for trace in (make_trace(6, 3, token_scale=0.02, seed=1), make_trace(3, 2, token_scale=0.02, seed=1).with_samples_per_prompt(2)):
        share = Trace(conversations=trace.conversations[1::2], meta=dict(trace.meta))
        for j, ci in enumerate(range(1, len(trace.conversations), 2)):
            assert conversation_token_ids(share, j, seed=3, vocab_size=100) == \
                conversation_token_ids(trace, ci, seed=3, vocab_size=100)
            assert turn_params(share, j, 0, 4, seed=3) == turn_params(trace, ci, 0, 4, seed=3)


async def test_bench_runs_every_policy_on_the_first_runs_pool(tmp_path):
    """A pool sized from the device is sized once a bench: the later workers of one process would
    see less free memory (what the process keeps after its first worker), so they get the first's."""
    from ainfer_pd.tools import bench
    cfg = WorkerConfig()
    assert cfg.cache.num_blocks == 0
    seen = []

    class Sized(FakeWorker):
        def metrics(self):
            return {**super().metrics(), "kv_total_blocks": 7874 - 400 * len(seen)}

    def factory(c):
        seen.append(c.cache.num_blocks)
        return Sized(c)
    logs = []
    await bench.run_bench(cfg, small_trace(), variants=bench.make_variants(["normal", "fine-grained"]),
                          repeats=2, worker_factory=factory, log=logs.append, plots=False)
    assert seen == [0, 7474, 7474, 7474]                 # the first run's pool (its worker saw seen == [0])
    assert any("KV pool 7474 blocks" in ln for ln in logs)
    run = bench._BenchRun(trace=small_trace(), variants=[], cfgs={}, repeats=1, seed=0, time_scale=1.0,
                          progress=False, worker_factory=None, total=0, log=lambda s: None)
    run.pin(cfg, 5000)
    assert run.pinned(cfg).cache.num_blocks == 5000
    fp8 = cfg.replace(**{"cache.kv_dtype": "fp8_e4m3"})           # other block bytes: sized for itself
    assert run.pinned(fp8).cache.num_blocks == 0
    assert run.pinned(cfg.replace(**{"cache.num_blocks": 64})).cache.num_blocks == 64   # set: kept
