"""The P walk submits the segments it passes without a wait as one stream item (``COALESCE_MAX``
at most), and everything pending before it waits: fine-grained epochs beside D pass every
boundary, in order, with fewer hand-offs to the launcher, and the same greedy tokens."""
import asyncio
import random

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.loop import p_walk
from tests.conftest import rand_ids, tiny_cfg

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _rollout(cfg):
    rng = random.Random(7)
    async with RolloutWorker(cfg) as w:
        first = [await w.generate(rand_ids(rng, rng.randrange(20, 120)), SamplingParams(max_new_tokens=24, **GREEDY))
                 for _ in range(3)]
        outs = await asyncio.gather(
            *(w.generate(rand_ids(rng, rng.randrange(20, 300)), SamplingParams(max_new_tokens=10, **GREEDY))
              for _ in range(8)),
            *(w.continue_(o.trajectory_id, rand_ids(rng, 60), SamplingParams(max_new_tokens=12, **GREEDY)) for o in first))
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()
        return [o.token_ids for o in outs]


async def test_segments_passed_without_a_wait_go_in_one_item_and_all_before_a_wait(monkeypatch):
    cfg = tiny_cfg(**{"scheduler.policy": "fine-grained", "mux.activation_threshold": 1,
                      "mux.p_host_pacing": "epoch", "scheduler.max_prefill_tokens": 256})
    walks: list = []                       # (submitted runs, waits) of each per-layer walk
    enqueue = p_walk.EpochWalk.enqueue

    async def spy_enqueue(self, segments, mode, counts):
        runs: list[tuple[int, ...]] = []           # the boundaries of each item's segments
        waits: list[tuple[int, int]] = []          # (boundary waited at, segments submitted by then)
        submit, permit = self.ctx.stream.submit, self.ep.permit

        def sub(fn, *a, **kw):
            if getattr(fn, "__name__", "") == "_body":
                runs.append(tuple(s.boundary if s.boundary is not None else -1 for s, _ in a[0]))
            return submit(fn, *a, **kw)

        async def perm(b):
            if not self.ep.passes(b):
                waits.append((b, sum(len(r) for r in runs)))
            return await permit(b)
        self.ctx.stream.submit, self.ep.permit = sub, perm
        try:
            await enqueue(self, segments, mode, counts)
        finally:
            del self.ctx.stream.submit, self.ep.permit
        if mode.per_layer:
            walks.append((runs, waits, [s.boundary for s, _ in segments[:-1]]))
    monkeypatch.setattr(p_walk.EpochWalk, "enqueue", spy_enqueue)
    on = await _rollout(cfg)
    assert walks, "no fine-grained epoch ran beside D"
    coalesced = waited = 0
    for runs, waits, order in walks:
        assert [b for r in runs for b in r] == [b if b is not None else -1 for b in order]   # each segment once, in order
        assert all(len(r) <= p_walk.COALESCE_MAX for r in runs) and len(runs[0]) == 1    # the embed goes at once
        coalesced += sum(len(r) > 1 for r in runs)
        for b, done in waits:                      # at a wait, every segment before its boundary was submitted
            waited += 1
            assert done == order.index(b), (b, done)
    assert coalesced > 0 and waited > 0, (coalesced, waited)
    monkeypatch.setattr(p_walk, "COALESCE_MAX", 1)  # one item a segment: the walk as before
    assert await _rollout(cfg) == on
