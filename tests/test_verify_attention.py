"""A verify pass's decode attention (speculative decoding, issue 38): the paged decode kernel reads a
turn's keys once for the turn's consecutive rows (its last token, then its drafts: ``DecodeMeta.lead_off``),
and every row's output is bitwise the one it gets attended alone, and matches a dense reference. Under
``TRITON_INTERPRET=1`` (conftest): groups narrower and wider than the group width, several KV splits, and
rows of one turn whose keys split differently (past ``max_splits`` splits a row's splits lengthen)."""
from __future__ import annotations

import pytest
import torch

from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, lead_offsets, paged_attention
from ainfer_pd.engine.attention.plan import verify_group_width
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from tests.test_paged_attention import BS, dense_reference


def verify_case(seed: int, turns: list[tuple[int, int]], H: int, Hk: int, hd: int, width: int):
    """Turns of (L, w): w rows at L .. L + w - 1 keys, one block table each turn; each row writes its key
    at its last position. Returns (fb with lead offsets, the same fb without, q, k, v, kv, reference rows)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-(L + w) // BS) + 1 for L, w in turns) + 2
    kv = torch.randn(2, nblocks * BS, Hk, hd, generator=g)
    take = iter(torch.randperm(nblocks, generator=g).tolist())
    lens, tables, write, refs = [], [], [], []
    for L, w in turns:
        blocks = [next(take) for _ in range(-(-(L + w - 1) // BS))]
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(L + w - 1)])
        for j in range(w):
            refs.append((len(lens), L + j - 1, slots[:L + j]))
            lens.append(L + j)
            tables.append(blocks)
            write.append(slots[L + j - 1:L + j])
    n = len(lens)
    nb = max(map(len, tables)) + 1
    table = torch.tensor([b + [0] * (nb - len(b)) for b in tables])
    q = torch.randn(n, H, hd, generator=g)
    kn, vn = torch.randn(n, Hk, hd, generator=g), torch.randn(n, Hk, hd, generator=g)

    def fb(lead):
        meta = DecodeMeta(None, torch.tensor(lens), block_table=table, block_size=BS, lead_off=lead,
                          group_width=width if lead is not None else 1)
        return ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.tensor(lens) - 1, torch.cat(write), [], meta,
                            None, block_size=BS)
    lead = torch.tensor(lead_offsets([w for _, w in turns], width))
    return fb(lead), fb(None), q, kn, vn, kv, refs


TURNS = [(5, 1), (9, 3), (17, 4), (30, 2), (40, 5), (3, 4)]


@pytest.mark.parametrize("over", [{}, {"block_n": 16, "split_keys": 16},
                                  {"block_n": 16, "split_keys": 16, "max_splits": 2}],
                         ids=["one-split", "splits", "capped-splits"])
@pytest.mark.parametrize("H,Hk,width", [(8, 2, 4), (4, 4, 2), (8, 1, 4)])
def test_verify_groups_equal_rows_alone_and_the_dense_reference(over, H, Hk, width):
    turns = TURNS + ([(63, 4), (95, 3)] if over.get("max_splits") else [])     # lens 63..66: splits 32, 32, 48, 48
    be = TritonAttention(torch.device("cpu"), decode_overrides=over)
    grouped, alone, q, kn, vn, kv, refs = verify_case(3, turns, H, Hk, 16, width)
    out = paged_attention(q.clone(), kn, vn, kv, grouped, be)
    ref_out = paged_attention(q.clone(), kn, vn, kv, alone, be)
    # a row's result does not depend on its group: bitwise on the GPU (the gate's
    # verify_attention_grouped_equals_rows_alone); the interpreter's tl.dot is the host BLAS's matmul, whose
    # rounding can follow the tile's row count (an AMD EPYC's OpenBLAS kernel: up to 4e-7 here)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=2e-6)
    for r, cached, slots in refs:
        want = dense_reference(q[r:r + 1], kv[0][slots], kv[1][slots], cached)
        assert (out[r:r + 1].double() - want).abs().max().item() < 1e-5, r


def test_a_group_attends_only_its_own_rows():
    """A row's later drafts are not its keys: the first row of a group sees its keys only (a wrong mask
    would let it see the drafts' keys, written by the same pass)."""
    be = TritonAttention(torch.device("cpu"))
    grouped, _, q, kn, vn, kv, refs = verify_case(5, [(6, 4)], 8, 2, 16, 4)
    out = paged_attention(q.clone(), kn, vn, kv, grouped, be)
    r, cached, slots = refs[0]
    longer = dense_reference(q[0:1], kv[0][refs[-1][2]], kv[1][refs[-1][2]], refs[-1][1])
    assert (out[0:1].double() - dense_reference(q[0:1], kv[0][slots], kv[1][slots], cached)).abs().max() < 1e-5
    assert (out[0:1].double() - longer).abs().max() > 1e-3


def test_a_group_reads_its_first_row_s_block_table():
    """The rows after a group's first are attended by its program, through the first row's block table:
    with every other row's table garbage the grouped pass still equals the reference (and the rows alone
    do not), so the pass did group them."""
    be = TritonAttention(torch.device("cpu"))
    grouped, alone, q, kn, vn, kv, refs = verify_case(7, [(9, 4), (20, 3)], 8, 2, 16, 4)
    lead = grouped.decode.lead_off
    for fb in (grouped, alone):
        t = fb.decode.block_table
        t[lead > 0] = (t[lead > 0] + 1) % (kv.shape[1] // BS)
    out = paged_attention(q.clone(), kn, vn, kv, grouped, be)
    bad = paged_attention(q.clone(), kn, vn, kv, alone, be)
    for r, cached, slots in refs:
        want = dense_reference(q[r:r + 1], kv[0][slots], kv[1][slots], cached)
        assert (out[r:r + 1].double() - want).abs().max().item() < 1e-5, r
        if lead[r] > 0:
            assert (bad[r:r + 1].double() - want).abs().max().item() > 1e-3, r


def test_lead_offsets_and_group_width():
    assert lead_offsets([1, 3, 5], 4) == [0, 0, 1, 2, 0, 1, 2, 3, 0]
    assert lead_offsets([2, 2], 1) == [0, 0, 0, 0]
    assert verify_group_width(5, 8) == 4 and verify_group_width(3, 8) == 3     # Qwen3-30B-A3B: 8 heads a KV head
    assert verify_group_width(9, 4) == 8 and verify_group_width(9, 64) == 1


def test_speculating_worker_on_the_triton_backends_groups_its_verify_rows(monkeypatch):
    """The whole worker on the Triton kernels (interpreter), speculating (suffix drafts, not adaptive; two
    siblings start after a first one has finished, so they draft its tokens): their verify passes reach the
    decode kernel with their turns' groups, and the greedy tokens equal decoding without speculation."""
    import asyncio
    import random

    from ainfer_pd import RolloutWorker, SamplingParams
    from tests.conftest import rand_ids, tiny_cfg
    seen = []
    decode = TritonAttention.decode

    def spy(self, q, kc, vc, fb, kv_scale=None):
        d = fb.decode
        if d.lead_off is not None and bool((d.lead_off > 0).any()):
            seen.append(d.group_width)
        return decode(self, q, kc, vc, fb, kv_scale=kv_scale)
    monkeypatch.setattr(TritonAttention, "decode", spy)
    rng = random.Random(4)
    prompt = rand_ids(rng, 24)

    async def go(**spec):
        cfg = tiny_cfg(**{"model.num_layers": 2, "cache.num_blocks": 256, "device.attention_backend": "triton",
                          "device.moe_backend": "triton", **spec})
        async with RolloutWorker(cfg) as w:
            p = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            first = await w.generate(prompt, p)
            outs = [first, *await asyncio.gather(*(w.generate(prompt, p) for _ in range(2)))]
            for o in outs:
                await w.release(o.trajectory_id)
            assert w.kv_leak_free()
            return [o.token_ids for o in outs], w.metrics().get("spec_drafted", 0), cfg.model
    (off, _, _), (on, drafted, mc) = asyncio.run(go()), asyncio.run(go(**{"spec.method": "suffix",
                                                                          "spec.adaptive": False,
                                                                          "spec.num_draft_tokens": 4}))
    assert on == off and drafted > 0
    assert seen and set(seen) == {verify_group_width(5, mc.num_heads // mc.num_kv_heads)}, seen


def test_verify_groups_on_an_fp8_pool_with_bf16_queries():
    """An FP8 pool (non-unit scales) read by bfloat16 queries (the float16 MMAs): grouped rows bitwise equal
    to the rows alone, within bfloat16's rounding of the dense reference over the dequantized pool."""
    from ainfer_pd.engine.attention.kv_fp8 import dequantize_kv, quantize_kv
    scales = torch.tensor([0.37, 2.9])
    be = TritonAttention(torch.device("cpu"), decode_overrides={"block_n": 16, "split_keys": 16})
    grouped, alone, q, kn, vn, kv, refs = verify_case(9, TURNS, 8, 2, 16, 4)
    kv8 = torch.stack([quantize_kv(kv[0], scales[0]), quantize_kv(kv[1], scales[1])])
    q = (q / 8).to(torch.bfloat16)
    kn, vn = kn.to(torch.bfloat16), vn.to(torch.bfloat16)
    out = paged_attention(q.clone(), kn, vn, kv8, grouped, be, kv_scale=scales)
    assert torch.equal(out, paged_attention(q.clone(), kn, vn, kv8, alone, be, kv_scale=scales))
    keys, vals = dequantize_kv(kv8[0], scales[0], torch.float64), dequantize_kv(kv8[1], scales[1], torch.float64)
    for r, cached, slots in refs:
        want = dense_reference(q[r:r + 1].double(), keys[slots], vals[slots], cached)
        assert (out[r:r + 1].double() - want).abs().max().item() < 2e-2 * want.abs().max().item(), r


def test_the_verify_cost_batch_runs_the_experts():
    """The cost measurement's rows write the scratch block, never its first slot (the padding rows' mark,
    routed to no expert in a replayed graph): a measured verify pays for its MoE."""
    from ainfer_pd.engine.runtime.verify_costs import _decode_batch
    from tests.conftest import cpu_runner, tiny_cfg
    cfg = tiny_cfg(**{"model.num_layers": 1, "cache.num_blocks": 64, "spec.method": "suffix"})
    runner = cpu_runner(cfg)
    fb = _decode_batch(runner, 8, 4, 20)
    bs = runner.kv.block_size
    assert not bool((fb.write_slots == runner.model.pad_slot).any())
    assert bool((fb.write_slots // bs == runner.scratch_block).all())
