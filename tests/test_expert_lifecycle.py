"""Expert parallelism in the engine: counts-then-permit order, ownership audit, cancellation storms."""
import asyncio
import json
import random
from pathlib import Path

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import OwnershipAuditError
from ainfer_pd.comm.experts.ownership import rank_registry
from ainfer_pd.phase import Phase
from tests._dist_util import run_ranks
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _ep_cfg(world_size, **kw):
    return tiny_cfg(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                       "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
                       "parallel.rendezvous_timeout_s": 60.0, **kw})


async def _storm(worker, seed: int, n: int, cancel_p: float):
    """n trajectories of 3 turns; random turns are cancelled at a random moment."""
    rng = random.Random(seed)
    completed = []          # (context, tokens) of every turn that finished

    async def traj(i):
        r = random.Random(seed * 1000 + i)
        tid = f"s{seed}-{i}"
        ctx = rand_ids(r, r.randrange(20, 200))
        first = True
        for turn in range(3):
            sp = SamplingParams(max_new_tokens=r.randrange(4, 24), **GREEDY)
            if first:
                call = worker.generate(ctx, sp, trajectory_id=tid)
            else:
                obs = rand_ids(r, r.randrange(5, 80))
                call = worker.continue_(tid, obs, sp)
            task = asyncio.ensure_future(call)
            if r.random() < cancel_p:
                await asyncio.sleep(r.random() * 0.05)
                task.cancel()
            try:
                out = await task
            except asyncio.CancelledError:
                if tid not in worker.trajectories:
                    return
                continue
            prompt = worker.trajectories[tid].tokens[:out.num_prompt_tokens]
            completed.append((prompt, out.token_ids, sp.max_new_tokens))
            first = False
        if tid in worker.trajectories:
            await worker.release(tid)

    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(traj(i))
    for tid in list(worker.trajectories):
        await worker.release(tid)
    return completed


async def _check_against_fresh(completed):
    async with RolloutWorker(tiny_cfg()) as ref:
        for prompt, tokens, n in completed:
            out = await ref.generate(prompt, SamplingParams(max_new_tokens=n, **GREEDY))
            assert out.token_ids == tokens


async def test_cancellation_storm_never_writes_an_old_result_into_a_new_lifetime():
    cfg = tiny_cfg(**{"cache.num_blocks": 96, "scheduler.policy": "fine-grained",
                      "scheduler.max_prefill_tokens": 256})     # tiny cache: blocks are reused constantly
    async with RolloutWorker(cfg) as w:
        completed = await _storm(w, seed=1, n=24, cancel_p=0.4)
        m = w.metrics()
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == 96
    assert m["aborted"] > 0 and m["kv_evictions"] > 0
    assert len(completed) > 10
    await _check_against_fresh(completed)


async def _rank_storm(rank, world_size, trace_dir):
    cfg = _ep_cfg(world_size, **{"cache.num_blocks": 128, "scheduler.policy": "fine-grained",
                                 "scheduler.max_prefill_tokens": 256, "trace_dir": trace_dir,
                                 "mux.span": "1"})
    async with RolloutWorker(cfg) as w:
        report = w.audit()
        completed = await _storm(w, seed=10 + rank, n=10, cancel_p=0.4)
        leak_free = w.kv_leak_free() and w.engine.kv.num_free_blocks == 128
        planted = rank_registry(w.engine)
        planted.register("counters", "planted.shared_counter", Phase.PREFILL,
                         identity=id(w.engine.dist.dispatchers.decode._recv_counts))
        planted.register("counters", "planted.shared_counter", Phase.DECODE,
                         identity=id(w.engine.dist.dispatchers.decode._recv_counts))
        with pytest.raises(OwnershipAuditError):
            planted.audit(strict=True)
        aborted = w.metrics()["aborted"]
    return completed, leak_free, report.ok, report.phase_memory_bytes, aborted


def test_expert_parallel_storm_audit_and_counts_before_permit(tmp_path):
    res = run_ranks(_rank_storm, 2, str(tmp_path), timeout_s=240)
    completed = []
    for c, leak_free, audit_ok, mem, aborted in res:
        assert leak_free and audit_ok and mem > 0
        completed += c
    assert sum(r[4] for r in res) > 0
    asyncio.run(_check_against_fresh(completed))
    # The background P task waits for the receive counts, then for the permit, then moves data.
    for rank in range(2):
        events = [json.loads(l) for l in Path(tmp_path, f"rank{rank}.jsonl").read_text().splitlines()]
        seen = {}
        checked = 0
        for e in events:
            key = (e.get("epoch"), e.get("boundary"))
            if e["ev"] == "p_counts":
                seen[key] = "counts"
            elif e["ev"] == "p_permit" and key in seen:
                assert seen[key] == "counts"
                seen[key] = "permit"
                checked += 1
        assert checked > 5
        kinds = [e["ev"] for e in events]
        assert "ownership_audit" in kinds
