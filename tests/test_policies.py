"""The policy ladder on the tiny model: D wait order, makespan, identical outputs, activation."""
import asyncio
import functools
import random
import time

import pytest

from ainfer_pd import RolloutWorker
from ainfer_pd.tools.replay import replay
from ainfer_pd.tools.trace import decode_only_trace, p_heavy_trace
from tests.conftest import tiny_cfg

LADDER = ("normal", "global-complete", "global-enqueue", "fine-grained", "mixed-chunked")


async def _run(policy: str, trace, **overrides):
    cfg = tiny_cfg(**{"scheduler.policy": policy, **overrides})
    async with RolloutWorker(cfg) as w:
        t0 = time.perf_counter()
        res = await replay(w, trace, cell="trace", seed=0, raise_errors=True)
        makespan = time.perf_counter() - t0
        m = w.metrics()
        assert w.kv_leak_free()
    return makespan, m, res.outputs


@pytest.mark.slow
def test_p_heavy_trace_orders_d_wait_and_never_changes_outputs():
    # Two layers: an epoch's tail after its last boundary (last experts + head) is a large part of
    # it, so "D enters at enqueue" and "D enters at completion" differ measurably.
    trace = p_heavy_trace(12, 3, prompt_tokens=1200, observation_tokens=600, gen_tokens=24, tool_wait_s=0.01)
    over = {"model.num_layers": 2, "mux.activation_threshold": 1}
    # The full D-wait order is a property of the plain D loop, where D waits at the turnstile's
    # boundaries. On the overlapped loop (the default), iteration n+1 is launched before n is read.
    # D wait there is how long a ready row waits for its launch: every turnstile policy still waits
    # less than normal, but which global policy waits least is within the noise (CPU VM: global-
    # enqueue 8.2-9.8 ms against fine-grained 8.7-9.0; H200 s7: 1.0 against 0.8-1.6 ms). The makespan
    # is checked on the default loop, which users run.
    # NOTE: the D-wait order and the makespan are wall-clock properties of a 2-core machine: a set
    # of runs that another process slowed gets up to two more tries (the outputs are checked on
    # every run; one try in eight missed one of the three on an idle VM). The plain loop's five runs
    # and the overlapped loop's three are separate measurements, so each set is retried alone.
    ref = None
    ordered = ordered_dflt = faster = False
    for attempt in range(3):
        if not ordered:
            res = {p: asyncio.run(_run(p, trace, **over, **{"scheduler.overlap_decode": False})) for p in LADDER}
            outs = {p: r[2] for p, r in res.items()}
            ref = outs["normal"] if ref is None else ref
            for p in LADDER:
                assert outs[p] == ref, f"{p} changed greedy outputs"
            fg = res["fine-grained"][1]
            assert fg["rendezvous"] > 0 and fg["p_wait_permit_s_count"] > 0 and fg["d_boundary_wait_s_count"] > 0
            d_wait = {p: res[p][1]["d_wait_s_mean"] for p in LADDER[:4]}
            w = d_wait
            # fine-grained waits least, every turnstile policy less than normal; global-enqueue's edge
            # over global-complete (the epoch's tail) is a few ms, of the order of the loaded 2-core
            # VM's run-to-run noise (CI: 16.8 vs 15.5 ms once): global-enqueue held within 15% of it
            ordered = (w["fine-grained"] < min(w["global-enqueue"], w["global-complete"])
                       and max(w["global-enqueue"], w["global-complete"]) < w["normal"]
                       and w["global-enqueue"] <= 1.15 * w["global-complete"])
        if not (ordered_dflt and faster):
            dflt = {p: asyncio.run(_run(p, trace, **over)) for p in ("normal", "global-enqueue", "fine-grained")}
            for p in dflt:
                assert dflt[p][2] == ref, f"{p} on the overlapped loop changed greedy outputs"
            dw = {p: r[1]["d_wait_s_mean"] for p, r in dflt.items()}
            ordered_dflt = max(dw["global-enqueue"], dw["fine-grained"]) < dw["normal"]
            # fine-grained is not slower than normal beyond the loaded VM's run-to-run noise (CI, two
            # test files at once: 2.59 s against 2.52, three tries in a row): what this catches is a
            # turnstile whose own cost (rendezvous, segment waits) outgrows what the overlap saves
            faster = dflt["fine-grained"][0] <= 1.08 * dflt["normal"][0]
        if ordered and ordered_dflt and faster:
            break
    assert ordered, d_wait
    assert ordered_dflt, dw
    assert faster, (dflt["fine-grained"][0], dflt["normal"][0])


def test_decode_only_workload_adds_no_rendezvous_and_no_segmenting(tmp_path):
    trace = decode_only_trace(16, gen_tokens=48, prompt_tokens=8, turns=2)
    mk, m, _ = asyncio.run(_run("fine-grained", trace, **{"trace_dir": str(tmp_path)}))
    assert m.get("rendezvous", 0) == 0
    events = (tmp_path / "rank0.jsonl").read_text()
    assert '"ev": "publish"' not in events and '"ev": "p_permit"' not in events
    assert '"gated": true' not in events
    # D iterations with no P epoch beside them: the optimistic bound's chain counts one per token
    assert 0 < m["d_iter_alone_s"] <= m["d_iter_s_mean"] and m["d_iter_alone_s_count"] <= m["d_iter_s_count"]



def test_the_d_iteration_split_adds_up_to_launch_to_done():
    """pickup + to start + device + resume is launch -> done, iteration by iteration (the sums
    agree), every part but the CPU's to-start is positive, and the breakdown line shows them."""
    from ainfer_pd.tools.report import breakdown
    trace = decode_only_trace(4, gen_tokens=12, prompt_tokens=8, turns=1)
    _, m, _ = asyncio.run(_run("fine-grained", trace))
    n = m["d_iter_s_count"]
    assert n > 0 and all(m[f"{k}_count"] == n for k in ("d_pickup_s", "d_to_start_s", "d_device_s", "d_resume_s"))
    parts = sum(m[f"{k}_sum"] for k in ("d_pickup_s", "d_to_start_s", "d_device_s", "d_resume_s"))
    assert parts == pytest.approx(m["d_iter_s_sum"], rel=1e-9, abs=1e-9)
    assert m["d_to_start_s_sum"] == 0.0                  # CPU: the item starts when its launcher does
    assert m["d_device_s_sum"] > 0 and m["d_pickup_s_sum"] >= 0 and m["d_resume_s_sum"] >= 0
    assert m["d_launch_call_s_sum"] == pytest.approx(m["d_device_s_sum"])  # CPU: the launch call is the work
    assert "(pickup " in breakdown(m) and "resume " in breakdown(m)

# ---------------------------------------------------------------- policies as data (issue 14)
def test_epoch_mode_is_a_pure_table_of_the_policies():
    from ainfer_pd.errors import ConfigError
    from ainfer_pd.sched.epoch_mode import TURNSTILE_POLICIES, epoch_mode
    assert TURNSTILE_POLICIES == ("global-complete", "global-enqueue", "fine-grained")
    # normal: never gated, always exclusive
    for has_d in (False, True):
        for active in (False, True):
            m = epoch_mode("normal", has_d, active)
            assert not m.gated and m.exclusive and m.final is None
    # turnstile policies: gated only with D present and the activation on
    for p, final in (("global-complete", "complete"), ("global-enqueue", "enqueue"), ("fine-grained", "layer")):
        m = epoch_mode(p, True, True)
        assert m.gated and not m.exclusive and m.final == final and m.per_layer == (p == "fine-grained")
        m = epoch_mode(p, True, False)                     # D present, multiplexing off: D waits (P priority)
        assert not m.gated and m.exclusive and not m.per_layer and m.final is None
        m = epoch_mode(p, False, True)                     # no D: nothing to multiplex, nothing waits
        assert not m.gated and not m.exclusive
    with pytest.raises(ConfigError):
        epoch_mode("fastest", True, True)


@pytest.mark.parametrize("cost,backlog,wait", [("none", 0, 0.0), ("measured", 0, 0.0), ("none", 500, 0.0),
                                               ("none", 0, 0.05)])
def test_activation_cost_runs_a_burst_of_first_turns_beside_few_rows_exclusively(cost, backlog, wait):
    """Two rows decode; a burst of 12 first turns arrives. none: every epoch beside the rows is
    gated. measured (initial slowdown 2): 2 rows < 12 turns x (2 - 1), so the burst's epochs are
    declined and run exclusively. mux.exclusive_backlog_tokens 500: the epochs run exclusively
    while more than 500 of the burst's 1,440 prompt tokens are left, then its tail is gated.
    mux.exclusive_wait_s 0.05: once a waiting turn has waited 50 ms, the epochs run exclusively.
    The greedy outputs do not change."""
    from ainfer_pd import SamplingParams
    from tests.conftest import rand_ids

    async def run():
        cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "mux.activation_threshold": 1,
                          "mux.activation_cost": cost, "scheduler.max_prefill_tokens": 256,
                          "mux.exclusive_backlog_tokens": backlog, "mux.exclusive_wait_s": wait})
        rng = random.Random(4)
        async with RolloutWorker(cfg) as w:
            sp = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
            longs = [asyncio.create_task(w.generate(rand_ids(rng, 16), sp)) for _ in range(2)]
            while len(w.engine.book.decoding) < 2:
                await asyncio.sleep(0.005)
            burst = [asyncio.create_task(w.generate(rand_ids(rng, 120), SamplingParams(max_new_tokens=4, temperature=0.0)))
                     for _ in range(12)]
            outs = [o.token_ids for o in await asyncio.gather(*longs, *burst)]
            m = w.metrics()
            assert w.kv_leak_free()
        return outs, m

    outs, m = asyncio.run(run())
    assert outs == _reference_outputs()
    if wait:
        assert m["wait_exclusive"] > 0 and m.get("backlog_exclusive", 0) == 0   # the late epochs exclusive
    elif backlog:
        assert m["backlog_exclusive"] > 0 and m.get("rendezvous", 0) > 0     # the head exclusive, the tail gated
    elif cost == "none":
        assert m.get("activation_declined", 0) == 0 and m.get("rendezvous", 0) > 0
        assert m.get("backlog_exclusive", 0) == 0 and m.get("wait_exclusive", 0) == 0
    else:
        assert m["activation_declined"] > 0


@functools.lru_cache(maxsize=None)
def _reference_outputs() -> list:
    """The burst's greedy tokens, one request at a time under normal (computed once per module: the
    same deterministic reference for every case above)."""
    from ainfer_pd import SamplingParams
    from tests.conftest import rand_ids

    async def run():
        rng = random.Random(4)
        async with RolloutWorker(tiny_cfg(**{"scheduler.policy": "normal"})) as w:
            sp = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
            prompts = [rand_ids(rng, 16) for _ in range(2)] + [rand_ids(rng, 120) for _ in range(12)]
            return [(await w.generate(p, sp if i < 2 else SamplingParams(max_new_tokens=4, temperature=0.0))).token_ids
                    for i, p in enumerate(prompts)]
    return asyncio.run(run())
