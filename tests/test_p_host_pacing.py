"""mux.p_host_pacing: P's host waits for its device per layer (receive counts) or once per epoch.

``epoch`` is what CUDA without expert parallelism runs (``auto``); here it runs on the CPU
stand-in so both paths are covered: same greedy outputs under every policy, a failing segment
still fails its epoch's turns (typed) and nothing else, no per-layer counts waits recorded.
"""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.config import WorkerConfig
from ainfer_pd.errors import ConfigError
from ainfer_pd.faults import InjectedFault
from tests.conftest import rand_ids, tiny_cfg

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _batch(w, seed: int, n: int = 8):
    rng = random.Random(seed)
    first = [await w.generate(rand_ids(rng, rng.randrange(20, 200)), SamplingParams(max_new_tokens=6, **GREEDY))
             for _ in range(2)]
    outs = await asyncio.gather(*(w.generate(rand_ids(rng, rng.randrange(20, 300)),
                                             SamplingParams(max_new_tokens=10, **GREEDY)) for _ in range(n)),
                                *(w.continue_(o.trajectory_id, rand_ids(rng, 40), SamplingParams(max_new_tokens=8, **GREEDY))
                                  for o in first), return_exceptions=True)
    return outs


@pytest.mark.parametrize("policy", ["normal", "global-enqueue", "fine-grained"])
async def test_epoch_pacing_changes_no_output_and_records_no_counts_waits(policy):
    got = {}
    for pacing in ("layer", "epoch"):
        cfg = tiny_cfg(**{"scheduler.policy": policy, "mux.p_host_pacing": pacing, "mux.activation_threshold": 1,
                          "scheduler.max_prefill_tokens": 256})
        async with RolloutWorker(cfg) as w:
            outs = await _batch(w, seed=4)
            assert not [o for o in outs if isinstance(o, BaseException)]
            got[pacing] = [o.token_ids for o in outs]
            counts = w.metrics().get("p_counts_wait_s_count", 0)
            assert (counts > 0) if pacing == "layer" else (counts == 0), (pacing, counts)
            for tid in list(w.trajectories):
                await w.release(tid)
            assert w.kv_leak_free() and w.engine.kv.num_free_blocks == cfg.cache.num_blocks
    assert got["epoch"] == got["layer"]


async def test_a_failing_segment_fails_its_epoch_under_epoch_pacing():
    # epochs 1-2: the two first turns of _batch; epoch 3 is inside the concurrent batch
    cfg = tiny_cfg(**{"faults": {"p_error_epoch": 3}, "scheduler.max_prefill_tokens": 256,
                      "scheduler.policy": "fine-grained", "mux.p_host_pacing": "epoch"})
    async with RolloutWorker(cfg) as w:
        outs = await _batch(w, seed=0, n=10)
        failed = [o for o in outs if isinstance(o, BaseException)]
        assert failed and all(isinstance(e, InjectedFault) for e in failed), failed
        assert [o for o in outs if not isinstance(o, BaseException)]
        again = await w.generate([5, 6, 7], SamplingParams(max_new_tokens=4, **GREEDY))
        assert len(again.token_ids) == 4
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == cfg.cache.num_blocks


def test_unknown_pacing_is_refused():
    with pytest.raises(ConfigError, match="p_host_pacing"):
        WorkerConfig.from_dict({"mux": {"p_host_pacing": "never"}})


async def test_gated_epochs_run_on_the_gated_lane_and_exclusive_ones_on_the_stream_itself(monkeypatch):
    """device.p_stream_sms puts the P stream's gated-lane items on a green context (CUDA); which
    items are on that lane is the walk's: every item of a gated epoch, none of an exclusive one."""
    from ainfer_pd.engine.runtime.device import Stream
    from ainfer_pd.engine.loop.p_driver import PDriver
    from ainfer_pd.engine.loop.p_walk import GATED_LANE
    lanes: list[tuple[str, str | None]] = []           # (label, lane) of every P item, in order
    gated: list[bool] = []                             # each epoch's mode, in order
    submit, run_epoch = Stream.submit, PDriver.run_epoch

    def spy_submit(self, fn, *args, **kw):
        if self.name == "P" and kw.get("label", "").startswith("P."):
            lanes.append((kw["label"], kw.get("lane")))
        return submit(self, fn, *args, **kw)

    async def spy_epoch(self, epoch, work, mode, **kw):
        gated.append(mode.gated)
        return await run_epoch(self, epoch, work, mode, **kw)

    monkeypatch.setattr(Stream, "submit", spy_submit)
    monkeypatch.setattr(PDriver, "run_epoch", spy_epoch)
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "mux.activation_threshold": 1,
                      "scheduler.max_prefill_tokens": 256})
    async with RolloutWorker(cfg) as w:
        outs = await _batch(w, seed=5)
        assert not [o for o in outs if isinstance(o, BaseException)]
        for tid in list(w.trajectories):
            await w.release(tid)
    starts = [i for i, (label, _) in enumerate(lanes) if label == "P.embed"]
    assert len(starts) == len(gated) and True in gated and False in gated, (len(starts), gated)
    for k, (i, g) in enumerate(zip(starts, gated)):
        epoch_lanes = {lane for _, lane in lanes[i:starts[k + 1] if k + 1 < len(starts) else None]}
        assert epoch_lanes == {GATED_LANE if g else None}, (k, g, epoch_lanes)
