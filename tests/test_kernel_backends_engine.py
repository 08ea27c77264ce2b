"""The whole worker on the Triton backends (paged attention + fused MoE; CPU interpreter) gives
the greedy tokens and logprobs of the torch reference path, over multi-turn trajectories with
KV reuse, mixed batches (mixed-chunked) and segmented P (fine-grained)."""
import asyncio
import random

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _run(cfg):
    outs = {}
    async with RolloutWorker(cfg) as w:
        async def conv(i):
            rng = random.Random(i)
            o = await w.generate(rand_ids(rng, 20 + 13 * i), SamplingParams(max_new_tokens=2, **GREEDY))
            o2 = await w.continue_(o.trajectory_id, rand_ids(rng, 7), SamplingParams(max_new_tokens=2, **GREEDY))
            outs[i] = (o.token_ids, o2.token_ids, o.logprobs + o2.logprobs, o2.num_cached_tokens)
            await w.release(o.trajectory_id)
        async with asyncio.TaskGroup() as tg:
            for i in range(2):
                tg.create_task(conv(i))
        assert w.kv_leak_free()
    return outs


@pytest.mark.parametrize("policy", ["fine-grained", "mixed-chunked"])
async def test_triton_backends_match_reference(policy):
    base = {"scheduler.policy": policy, "model.num_layers": 2, "cache.num_blocks": 256}
    ref = await _run(tiny_cfg(**base, **{"device.attention_backend": "torch", "device.moe_backend": "torch"}))
    tri = await _run(tiny_cfg(**base, **{"device.attention_backend": "triton", "device.moe_backend": "triton"}))
    for i in ref:
        assert tri[i][:2] == ref[i][:2]
        assert tri[i][3] == ref[i][3] > 0                      # the continuation reused its KV
        assert tri[i][2] == pytest.approx(ref[i][2], abs=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_triton_backends_match_reference_per_architecture(arch, hf_model_dir):
    """QK-norm, QKV bias, partial RoPE, dense layers, shared experts and every router through the
    Triton kernels: logits of a mixed batch (a first turn, a continuation, decode rows) equal the
    torch reference path's."""
    import torch

    from ainfer_pd import WorkerConfig
    from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq
    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
    from ainfer_pd.phase import Phase, PhaseContext
    logits = []
    for be in ("torch", "triton"):
        cfg = WorkerConfig.from_pretrained(hf_model_dir(arch), {"device": {"attention_backend": be, "moe_backend": be},
                                                                "cache": {"num_blocks": 64, "block_size": 4}})
        runner = ModelRunner(RunnerSections.from_config(cfg), torch.device("cpu"), KVCacheManager(64, 4))
        g = torch.Generator().manual_seed(0)
        runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g))
        V = cfg.model.vocab_size
        # seq A: 9 new tokens on nothing (blocks 0-2); seq B: 5 new on 7 cached (blocks 3-5);
        # decode rows of contexts 6 and 13 (blocks 6-7 and 8-11)
        ids = torch.randint(0, V, (16,), generator=g)
        pos = torch.tensor(list(range(9)) + list(range(7, 12)) + [5, 12])
        blocks = {"A": [0, 1, 2], "B": [3, 4, 5], "d0": [6, 7], "d1": [8, 9, 10, 11]}
        write = [blocks["A"][p // 4] * 4 + p % 4 for p in range(9)] + [blocks["B"][p // 4] * 4 + p % 4 for p in range(7, 12)]
        write += [blocks["d0"][5 // 4] * 4 + 1, blocks["d1"][12 // 4] * 4 + 0]
        fb = ForwardBatch(ids, pos, torch.tensor(write),
                          [PrefillSeq(0, 9, 9, block_ids=torch.tensor(blocks["A"])),
                           PrefillSeq(9, 5, 12, block_ids=torch.tensor(blocks["B"]))],
                          DecodeMeta(None, torch.tensor([6, 13]), block_table=torch.tensor([[6, 7, 0, 0], blocks["d1"]]),
                                     block_size=4),
                          torch.tensor([8, 13, 14, 15]), block_size=4)
        with torch.inference_mode():
            logits.append(runner.forward_fb(fb, PhaseContext(Phase.PREFILL, None)))
    assert torch.allclose(logits[0], logits[1], atol=2e-4, rtol=1e-4), (logits[0] - logits[1]).abs().max()


def test_padding_rows_cost_no_expert_and_leave_the_real_rows_logits():
    """Decode rows padded as a replica or a graph bucket pads them (token 0, the scratch slot):
    on the fused MoE every layer's router counts only the real rows' pairs (no expert runs for a
    padding row), and the real rows' logits are those of the batch without padding; the batch
    without padding is routed plainly (``ForwardBatch.padded`` False: no zeroed rows)."""
    import torch

    from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch
    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime.replica import pad_decode
    from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
    from ainfer_pd.phase import Phase, PhaseContext
    cfg = tiny_cfg(**{"model.num_layers": 2, "cache.num_blocks": 32, "cache.block_size": 4,
                      "device.attention_backend": "triton", "device.moe_backend": "triton"})
    runner = ModelRunner(RunnerSections.from_config(cfg), torch.device("cpu"), KVCacheManager(32, 4))
    g = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=g))
    model, k = runner.model, cfg.model.top_k
    counts, masked = [], []
    route = model.route_kernel

    def counting(*a, **kw):
        r = route(*a, **kw)
        counts.append(int(r.counts.sum()))
        masked.append(r.padded)
        return r
    model.route_kernel = counting
    fb = ForwardBatch(torch.tensor([5, 9, 17]), torch.tensor([6, 3, 9]), torch.tensor([4 * 1 + 2, 4 * 3 + 3, 4 * 6 + 1]),
                      decode=DecodeMeta(None, torch.tensor([7, 4, 10]),
                                        block_table=torch.tensor([[0, 1, 0], [3, 0, 0], [4, 5, 6]]), block_size=4),
                      logits_rows=torch.tensor([0, 1, 2]), block_size=4)
    padded = pad_decode(fb, 8, runner.scratch_slot, runner.scratch_block)
    ctx = PhaseContext(Phase.DECODE, None)
    with torch.inference_mode():
        want = runner.forward_fb(fb, ctx)
        n = len(counts)
        got = runner.forward_fb(padded, ctx)
    moe_layers = sum(model.layers[i].is_moe for i in range(cfg.model.num_layers))
    assert counts[:n] == counts[n:] == [3 * k] * moe_layers
    assert not any(masked[:n]) and all(masked[n:])      # a batch with no padding rows pays nothing for them
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
