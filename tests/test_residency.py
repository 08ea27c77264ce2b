"""sleep / wake_up give device memory back and restore it (CPU: the same mechanism on host
tensors; the H200 figures come from benchmarks/sleep_wake_bench.py): outputs after wake_up equal
those before sleep, turns are refused while asleep, dropped weights come back by a complete sync."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.kv.residency import kv_blocks_for_budget
from ainfer_pd.errors import ConfigError, InvalidRequestError, WorkerAsleepError
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _greedy(w, prompts):
    outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=5, **GREEDY)) for p in prompts))
    for o in outs:
        await w.release(o.trajectory_id)
    return [o.token_ids for o in outs]


def _param_elems(w) -> int:
    return sum(p.numel() for p in w.model.parameters())


@pytest.mark.parametrize("level,keep", [(1, True), (2, True)])
async def test_sleep_frees_and_wake_restores_same_outputs(level, keep):
    rng = random.Random(level)
    prompts = [rand_ids(rng, 30 + 7 * i) for i in range(3)]
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as w:
        before = await _greedy(w, prompts)
        elems = _param_elems(w)
        await w.sleep(level, keep_weights=keep)
        assert w.engine.runner.kv_cache is None                      # the pool is gone
        assert (_param_elems(w) == 0) == (level == 2)                # level 2: the weights too
        with pytest.raises(WorkerAsleepError):
            await w.generate(prompts[0], SamplingParams(max_new_tokens=2))
        if level == 2:
            await w.wake_up(["weights"])                            # verl's order: weights, sync, then KV
            assert _param_elems(w) == elems and w.engine.runner.kv_cache is None
            with pytest.raises(WorkerAsleepError):
                await w.generate(prompts[0], SamplingParams(max_new_tokens=2))
            await w.wake_up(["kv_cache"])
        else:
            await w.wake_up()
        assert await _greedy(w, prompts) == before
        assert w.kv_leak_free()


async def test_dropped_weights_come_back_by_a_complete_sync():
    prompts = [rand_ids(random.Random(5), 40)]
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as w:
        before = await _greedy(w, prompts)
        state = [(n, p.detach().clone()) for n, p in w.model.named_parameters()]
        await w.sleep(2, keep_weights=False)
        with pytest.raises(WorkerAsleepError):                       # storage is off the device
            await w.update_weights(state)
        await w.wake_up()
        with pytest.raises(WorkerAsleepError):                       # storage back, values not yet
            await w.generate(prompts[0], SamplingParams(max_new_tokens=2))
        await w.update_weights(state[:3], partial=True)               # a subset does not make it valid
        with pytest.raises(WorkerAsleepError):
            await w.generate(prompts[0], SamplingParams(max_new_tokens=2))
        await w.update_weights(state)
        assert await _greedy(w, prompts) == before


async def test_sleep_aborts_in_flight_turns_and_leaks_nothing():
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as w:
        t = asyncio.ensure_future(w.generate(rand_ids(random.Random(1), 60), SamplingParams(max_new_tokens=200, **GREEDY)))
        await asyncio.sleep(0.05)
        await w.sleep(1)
        out = await asyncio.wait_for(t, 10)
        assert out.finish_reason == "abort"
        await w.wake_up()
        assert w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()


async def test_bad_levels_and_tags_are_typed():
    async with RolloutWorker(tiny_cfg()) as w:
        for bad in (3, -1, True, "1"):
            with pytest.raises(InvalidRequestError):
                await w.sleep(bad)
        with pytest.raises(InvalidRequestError):
            await w.wake_up(["weights", "optimizer"])
        with pytest.raises(InvalidRequestError):
            await w.wake_up("weights")
        await w.sleep(0)                                                 # level 0 keeps the pool
        assert w.engine.runner.kv_cache is not None
        assert len(await _greedy(w, [[5, 6, 7]])) == 1


def test_kv_blocks_for_budget():
    GiB = 1 << 30
    # 141 GiB card, 0.9 of it, 61 GiB of weights, 2 GiB reserve, 1.5 MiB blocks
    assert kv_blocks_for_budget(141 * GiB, 0.9, 61 * GiB, 3 << 19, 2 * GiB) == int((0.9 * 141 - 63) * GiB) // (3 << 19)
    assert kv_blocks_for_budget(80 * GiB, 0.5, 61 * GiB, 1 << 20, 2 * GiB) == 16       # never below 16


def test_kv_sizing_counts_what_a_closed_worker_left_in_reference_cycles(monkeypatch):
    """A released worker's runner <-> graph objects are a cycle; until it is collected, its device
    memory counts as in use. The pool is sized after the collection (CPU stand-in: the free bytes
    the driver reports depend on whether the cycle's object is still alive)."""
    import gc
    import weakref

    import torch

    from ainfer_pd.engine.kv import residency

    class Held:                       # a closed worker's runner and graphs, holding each other
        pass

    a, b = Held(), Held()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    del a, b
    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)     # no synchronize / empty_cache here
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: ((20 if alive() is None else 12) * GiB, 80 * GiB))
    cfg = tiny_cfg(**{"cache.num_blocks": 0, "cache.gpu_memory_fraction": 0.5})
    was = gc.isenabled()
    gc.disable()                      # only the sizing's own collection may free the cycle
    try:
        assert alive() is not None
        blocks = residency.kv_blocks_from_memory(cfg)
    finally:
        if was:
            gc.enable()
    weights = cfg.model.rank_weight_bytes(cfg.parallel.expert_parallel)
    assert alive() is None
    assert blocks == int((20 * GiB - weights) * 0.5) // residency.kv_block_bytes(cfg)


async def test_an_unset_pool_is_sized_from_the_device(monkeypatch):
    """``cache.num_blocks`` left at its default (0): a CUDA worker sizes the pool from the card's
    memory (a Hugging Face checkpoint's config no longer gets a fixed 32K-token pool on any card);
    the CPU stand-in takes CPU_KV_BLOCKS."""
    from ainfer_pd import WorkerConfig
    from ainfer_pd.engine.kv import residency

    assert WorkerConfig.from_dict({}).cache.num_blocks == 0
    cfg = tiny_cfg(**{"cache.num_blocks": 0})
    monkeypatch.setattr(residency, "kv_blocks_from_memory", lambda c: 777 if c is cfg else -1)
    assert residency.kv_blocks_for_device(cfg, "cuda") == 777
    assert residency.kv_blocks_for_device(cfg, "cpu") == residency.CPU_KV_BLOCKS
    assert residency.kv_blocks_for_device(tiny_cfg(**{"cache.num_blocks": 96}), "cuda") == 96
    short = -(-cfg.model.max_context_len // cfg.cache.block_size) - 1      # one block short of a full trajectory
    monkeypatch.setattr(residency, "kv_blocks_from_memory", lambda c: short)
    with pytest.raises(ConfigError, match="max_context_len"):        # refused at start, not turn by turn
        residency.kv_blocks_for_device(cfg, "cuda")
    monkeypatch.setattr(residency, "kv_blocks_from_memory", lambda c: 777 if c is cfg else -1)
    async with RolloutWorker(cfg) as w:
        assert w.engine.kv.alloc.num_blocks == residency.CPU_KV_BLOCKS
        out = await w.generate(rand_ids(random.Random(0), 12), SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(out.token_ids) == 4
        await w.release(out.trajectory_id)
        assert w.kv_leak_free()
