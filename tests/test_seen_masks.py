"""The D loop's repetition-penalty masks kept on the device (``engine.model.seen_masks``): a pool's
mask of each row is the mask of its history prefix, whatever the order of steps, new turns,
shorter histories, evictions and growth; sampling through it equals sampling from the histories;
the overlapped D loop uploads each history once plus the tokens read since (CPU device)."""
import asyncio
import random
from array import array

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.model.sampler import SampleRow, read_sample, sample_on_device
from ainfer_pd.engine.model.seen_masks import SeenMasks
from tests.conftest import tiny_cfg


def _to(t):
    return t


def _mask(ids, vocab):
    m = torch.zeros(vocab, dtype=torch.bool)
    m[list(ids)] = True
    return m


def test_masks_follow_the_histories_through_turns_rollbacks_evictions_and_growth():
    rng = random.Random(7)
    V = 50
    pool = SeenMasks()
    hists = {f"t{i}": array("q", [rng.randrange(V) for _ in range(rng.randrange(1, 30))]) for i in range(40)}
    lengths = {k: len(h) for k, h in hists.items()}
    for step in range(300):
        keys = rng.sample(sorted(hists), rng.randrange(1, 36))     # up to 35 rows: the pool grows past 16
        for k in keys:
            r = rng.random()
            if r < 0.05:                                        # a new turn: another history object
                hists[k] = array("q", list(hists[k][:lengths[k]]) + [rng.randrange(V) for _ in range(5)])
                lengths[k] = len(hists[k])
            elif r < 0.08:                                      # a shorter history (a rollback)
                hists[k] = array("q", hists[k][:max(1, lengths[k] // 2)])
                lengths[k] = len(hists[k])
            else:                                               # decoded tokens appended
                hists[k].extend(rng.randrange(V) for _ in range(rng.randrange(0, 3)))
                lengths[k] = len(hists[k]) - rng.randrange(0, 2) if len(hists[k]) > 1 else 1
                lengths[k] = max(lengths[k], 1)
        got = pool.gather(keys, [hists[k] for k in keys], [lengths[k] for k in keys], V, torch.device("cpu"), _to)
        want = torch.stack([_mask(hists[k][:lengths[k]], V) for k in keys])
        assert torch.equal(got, want), step
    assert pool.masks.shape[0] >= 35 and pool.num_restarts > 40      # grew, and evicted / restarted slots
    total = sum(len(h) for h in hists.values())
    assert pool.num_uploaded < 300 * total / 4                        # incremental, not every history a step


def test_a_vocabulary_change_or_a_release_starts_every_slot_again():
    pool = SeenMasks()
    h = array("q", [1, 2, 3])
    assert pool.gather(["a"], [h], [3], 8, torch.device("cpu"), _to)[0].nonzero().flatten().tolist() == [1, 2, 3]
    h.append(9)
    out = pool.gather(["a"], [h], [4], 12, torch.device("cpu"), _to)
    assert out.shape == (1, 12) and out[0].nonzero().flatten().tolist() == [1, 2, 3, 9]
    pool.release()
    assert pool.masks is None and not pool.slots
    assert pool.gather(["a"], [h], [2], 12, torch.device("cpu"), _to)[0].nonzero().flatten().tolist() == [1, 2]


@pytest.mark.parametrize("seen_ids", [False, True])
def test_sampling_through_the_pool_equals_sampling_from_the_histories(seen_ids):
    """Keyed live rows through a pool (over several steps, the histories growing) and snapshot rows
    without one: the same tokens and logprobs, with and without the token fed on the device."""
    rng = random.Random(3)
    V, R = 64, 6
    pool = SeenMasks()
    hists = [array("q", [rng.randrange(V) for _ in range(rng.randrange(1, 40))]) for _ in range(R)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.9), SamplingParams(temperature=1.0, seed=4,
              repetition_penalty=0.7), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=2,
              repetition_penalty=1.3, top_k=10), SamplingParams(temperature=0.0, repetition_penalty=2.5),
              SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.1, top_p=0.8)]
    for step in range(12):
        logits = torch.randn(R, V) * 4
        fed = torch.tensor([rng.randrange(V) for _ in range(R)]) if seen_ids else None
        live = [SampleRow(p, 1, step, h, f"k{i}", len(h)) for i, (p, h) in enumerate(zip(params, hists))]
        snap = [SampleRow(p, 1, step, array("q", h)) for p, h in zip(params, hists)]
        a = read_sample(sample_on_device(logits, live, seen_ids=fed, masks=pool))
        b = read_sample(sample_on_device(logits, snap, seen_ids=fed))
        assert a == b
        for h in hists:
            h.extend(rng.randrange(V) for _ in range(rng.randrange(1, 4)))


def test_the_d_loops_upload_each_history_once_and_then_the_new_tokens():
    """Penalized rows over two turns each, overlapped and plain: the pool restarts a slot per turn
    (its history is new) and uploads what the turns' histories hold, not a history per step; the
    greedy tokens are the same in both loops."""
    async def run(overlap):
        cfg = tiny_cfg(**{"scheduler.overlap_decode": overlap, "model.num_layers": 2})
        prompts = [[5, 6, 7, 8, 9] * 6, [9, 8, 7] * 5, [5, 5, 5, 5] * 4]
        p = [SamplingParams(max_new_tokens=24, temperature=0.0, repetition_penalty=1.6, ignore_eos=True)] * 3
        async with RolloutWorker(cfg) as w:
            outs = await asyncio.gather(*(w.generate(x, sp) for x, sp in zip(prompts, p)))
            nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, [7, 8, 9], p[0]) for o in outs))
            for o in nxt:
                await w.release(o.trajectory_id)
            assert w.kv_leak_free()
            pool = w.engine.runner.seen_masks
            return [o.token_ids for o in outs + nxt], pool.num_uploaded, pool.num_restarts, \
                sum(len(x) for x in prompts)
    over, uploaded, restarts, prompt_tokens = asyncio.run(run(True))
    plain, plain_uploaded, plain_restarts, _ = asyncio.run(run(False))
    assert over == plain
    turn_tokens = 2 * prompt_tokens + 3 * 3 * 24 + 3 * 3    # turn 1 uploads its context and output, turn 2 all again
    assert restarts == plain_restarts == 6 and 0 < uploaded <= turn_tokens and 0 < plain_uploaded <= turn_tokens


def test_a_live_row_is_read_at_its_length():
    """A live row's history may have grown since the row was made (the D loop books tokens while
    the row is sampled on the D stream): the sampler and a verify's positions see its first
    ``length`` ids only."""
    from ainfer_pd.engine.model.sampler import history_len, row_history
    from ainfer_pd.spec.verify import expand_rows
    h = array("q", [4, 5, 6])
    r = SampleRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), 1, 0, h, "a", 3)
    h.extend([7, 8])
    assert list(row_history(r)) == [4, 5, 6] and history_len(r) == 3
    assert [list(x.history) for x in expand_rows([r], [[9]], 2)] == [[4, 5, 6], [4, 5, 6, 9]]
    logits = torch.zeros(1, 10)
    logits[0, 7] = 1.0                  # 7 is past the row's length: not penalized, so it is drawn
    logits[0, 4] = 1.5                  # 4 is seen: 1.5 / 2 < 1
    for pool in (None, SeenMasks()):
        assert read_sample(sample_on_device(logits, [r], masks=pool))[0] == [7]
