"""Weight sync through shared-tensor handles from another process (CPU: shared memory, the
stand-in of CUDA IPC on GPU hosts): the trainer process shares perturbed weights, the rollout
process opens them and syncs, the next turn equals the perturbed model's."""
import multiprocessing as mp
import random

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import WeightUpdateError
from ainfer_pd.weight_transfer import open_buckets, share_bucket
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _trainer(names_shapes, conn, done):
    """Another process: perturbed weights, shared in buckets of 5 handles; alive until told."""
    g = torch.Generator().manual_seed(3)
    named = [(n, torch.randn(s, generator=g) * 0.05) for n, s in names_shapes]
    conn.send([share_bucket(named[i:i + 5]) for i in range(0, len(named), 5)])
    conn.send([(n, t.clone()) for n, t in named])          # a plain copy, to compare against
    done.wait(60)


async def test_sync_from_shared_handles_of_another_process():
    prompt = rand_ids(random.Random(2), 40)
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as w:
        names_shapes = [(n, tuple(p.shape)) for n, p in w.model.named_parameters()]
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        done = ctx.Event()
        proc = ctx.Process(target=_trainer, args=(names_shapes, child, done), daemon=True)
        proc.start()
        try:
            buckets = parent.recv()
            plain = parent.recv()
            n = await w.update_weights(open_buckets(buckets))
            assert n == len(names_shapes)
            got = await w.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY))
        finally:
            done.set()
            proc.join(30)
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as ref:
        await ref.update_weights(plain)
        want = await ref.generate(prompt, SamplingParams(max_new_tokens=5, **GREEDY))
    assert got.token_ids == want.token_ids


async def test_a_foreign_handle_is_a_typed_error_and_writes_nothing():
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 64})) as w:
        before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
        named = [(n, p.detach().clone() + 1) for n, p in w.model.named_parameters()]
        bucket = share_bucket(named[:-1]) + [(named[-1][0], ("not a rebuild fn", ()))]
        with pytest.raises(WeightUpdateError, match="cannot open the shared tensor"):
            await w.update_weights(open_buckets([bucket]))
        assert all(torch.equal(p, before[n]) for n, p in w.model.named_parameters())
