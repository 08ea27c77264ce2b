"""The attention backends against a dense full-recompute reference, over random block tables.

The triton kernels run on CPU tensors under TRITON_INTERPRET=1 (conftest): block tables
with holes (unused blocks between a sequence's blocks), reused blocks (the same physical
block in two tables, as after eviction and reuse), mixed batches (prefill sequences and decode
rows in one flat batch), decode split into several KV splits, GQA groups of 1, 2 and 4.
"""
from __future__ import annotations

import math

import pytest
import torch

from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq, TorchAttention, paged_attention
from ainfer_pd.engine.attention.plan import decode_plan
from ainfer_pd.engine.attention.triton_backend import TritonAttention

BS = 4


def dense_reference(q, keys, vals, cached):
    """q [n, H, hd] at positions cached..cached+n over keys/vals [cached+n, Hk, hd], causal; float64."""
    H, Hk = q.shape[1], keys.shape[1]
    g = H // Hk
    k = keys.double().repeat_interleave(g, dim=1)
    v = vals.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) / math.sqrt(q.shape[-1])
    n, m = q.shape[0], keys.shape[0]
    vis = torch.arange(m)[None, :] <= (cached + torch.arange(n))[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), v)


def make_case(seed, seqs, decode_lens, H, Hk, hd, num_blocks=64, reuse=False):
    """Random cache, random block tables; returns (fb, q, k_new, v_new, kv, per-row reference inputs)."""
    g = torch.Generator().manual_seed(seed)
    S = num_blocks * BS
    kv = torch.randn(2, S, Hk, hd, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    take = iter(perm)
    prefill, rows, write, refs = [], [], [], []
    q_parts = []
    t = 0
    tables = []
    for (cached, n) in seqs:
        ctx = cached + n
        nb = -(-ctx // BS)
        blocks = [next(take) for _ in range(nb)]
        next(take)                                  # a hole: a block between this sequence's and the next's
        tables.append(blocks)
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(ctx)])
        prefill.append(PrefillSeq(t, n, ctx, key_slots=slots, block_ids=torch.tensor(blocks)))
        write.append(slots[cached:])
        refs.append((t, n, cached, slots))
        t += n
    d_tables, d_slots = [], []
    for j, L in enumerate(decode_lens):
        nb = -(-L // BS)
        if reuse and j == 0 and tables:
            blocks = tables[0][:nb] + [next(take) for _ in range(max(0, nb - len(tables[0])))]
        else:
            blocks = [next(take) for _ in range(nb)]
        d_tables.append(blocks)
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(L)])
        d_slots.append(slots)
        write.append(slots[-1:])
        refs.append((t, 1, L - 1, slots))
        t += 1
    q = torch.randn(t, H, hd, generator=g)
    knew = torch.randn(t, Hk, hd, generator=g)
    vnew = torch.randn(t, Hk, hd, generator=g)
    decode = None
    if decode_lens:
        nbmax = max(len(b) for b in d_tables) + 1          # one padding block beyond the longest row
        table = torch.tensor([b + [0] * (nbmax - len(b)) for b in d_tables])
        decode = DecodeMeta(None, torch.tensor(decode_lens), block_table=table, block_size=BS)
    fb = ForwardBatch(torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64), torch.cat(write),
                      prefill, decode, None, block_size=BS)
    return fb, q, knew, vnew, kv, refs


def check(backend, seed, seqs, decode_lens, H=4, Hk=2, hd=16, tol=1e-5, reuse=False):
    fb, q, knew, vnew, kv, refs = make_case(seed, seqs, decode_lens, H, Hk, hd, reuse=reuse)
    out = paged_attention(q, knew, vnew, kv, fb, backend)
    for (t, n, cached, slots) in refs:
        ref = dense_reference(q[t:t + n], kv[0][slots], kv[1][slots], cached)
        err = (out[t:t + n].double() - ref).abs().max().item()
        assert err < tol, (backend.name, t, n, cached, err)
    return out


CASES = [
    ("prefill-only", [(0, 7), (5, 3), (12, 9)], []),
    ("decode-only", [], [1, 5, 17, 33]),
    ("mixed", [(0, 6), (9, 2)], [3, 22, 8]),
]


@pytest.mark.parametrize("name,seqs,dec", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (8, 2)])
def test_torch_reference_matches_dense(name, seqs, dec, H, Hk):
    check(TorchAttention(), 1, seqs, dec, H=H, Hk=Hk)


@pytest.mark.parametrize("name,seqs,dec", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("H,Hk", [(4, 4), (8, 2)])
def test_triton_kernels_match_dense(name, seqs, dec, H, Hk):
    check(TritonAttention(torch.device("cpu")), 2, seqs, dec, H=H, Hk=Hk)


def test_triton_decode_split_kv_matches_dense():
    """Several KV splits per row (some rows shorter than a split: empty splits merge to nothing)."""
    be = TritonAttention(torch.device("cpu"), decode_overrides={"block_n": 16, "split_keys": 16})
    plan = be.decode_plan(64)
    assert plan.num_splits == 4
    check(be, 3, [], [2, 40, 61], H=8, Hk=2)


def test_triton_prefill_tiles_cross_sequences_and_long_cached_prefix():
    """Query tiles of several sizes: a sequence longer than one tile, a long cached prefix."""
    from ainfer_pd.engine.attention.plan import PrefillPlan
    be = TritonAttention(torch.device("cpu"), prefill_override=PrefillPlan(16, 16, 4, 1))
    check(be, 4, [(0, 37), (50, 5), (3, 16)], [])


def test_long_prefill_passes_take_the_long_tile():
    """From LONG_PREFILL_TOKENS query tokens the 128 x 128 tile on 8 warps (above the P graphs'
    default buckets, so a replayed pass runs the tile its eager pass would); fp32 keeps its tile."""
    from ainfer_pd.engine.attention.plan import LONG_PREFILL_TOKENS, PrefillPlan, prefill_plan
    assert LONG_PREFILL_TOKENS > 2048
    assert prefill_plan(128, False, LONG_PREFILL_TOKENS - 1) == PrefillPlan(64, 64, 4, 2)
    assert prefill_plan(128, False, LONG_PREFILL_TOKENS) == PrefillPlan(128, 128, 8, 3)
    assert prefill_plan(256, False, 8192) == PrefillPlan(64, 64, 4, 2)
    assert prefill_plan(128, True, 8192) == PrefillPlan(32, 32, 4, 1)
    assert prefill_plan(128, False, 8192, kv_fp8=True) == PrefillPlan(64, 64, 4, 2)     # not measured on FP8 pools


def test_triton_prefill_long_tile_matches_dense():
    """The long tile's shape (128 x 128) over sequences shorter and longer than a tile, one with a
    cached prefix, in the interpreter."""
    from ainfer_pd.engine.attention.plan import PrefillPlan
    be = TritonAttention(torch.device("cpu"), prefill_override=PrefillPlan(128, 128, 8, 3))
    check(be, 7, [(0, 140), (8, 5), (20, 60)], [], H=8, Hk=2)


def test_reused_block_in_two_tables():
    """A decode row whose first blocks are the prefill sequence's own (shared physical blocks)."""
    check(TritonAttention(torch.device("cpu")), 5, [(0, 8)], [12, 5], reuse=True)


def test_decode_plan_splits_at_fixed_key_positions():
    p = decode_plan(2048)
    assert p.num_splits * p.split_keys >= 2048 and p.split_keys % p.block_n == 0
    assert decode_plan(2000).split_keys == p.split_keys                # boundaries independent of the batch
    assert decode_plan(100).num_splits == 1


def test_triton_decode_is_batch_invariant_and_split_count_free():
    """A row's output is bitwise the same alone, in a longer batch (more, empty splits), eager or not."""
    be = TritonAttention(torch.device("cpu"), decode_overrides={"block_n": 16, "split_keys": 32})
    fb, q, kn, vn, kv, _ = make_case(9, [], [20, 70, 130], 8, 2, 16)
    full = paged_attention(q, kn, vn, kv, fb, be)
    assert be.decode_plan(fb.decode.max_keys).num_splits >= 5
    for j in range(3):
        assert torch.equal(_row_alone(fb, j, q, kn, vn, kv, be), full[j:j + 1])


def _row_alone(fb, j, q, kn, vn, kv, be):
    """Decode row j of ``fb`` attended alone (a batch of one, its own blocks only)."""
    d = fb.decode
    nb = -(-int(d.ctx_lens[j]) // BS)
    one = ForwardBatch(fb.input_ids[j:j + 1], fb.positions[j:j + 1], fb.write_slots[j:j + 1], [],
                       DecodeMeta(None, d.ctx_lens[j:j + 1], block_table=d.block_table[j:j + 1, :nb],
                                  block_size=BS), None, block_size=BS)
    return paged_attention(q[j:j + 1], kn[j:j + 1], vn[j:j + 1], kv, one, be)


def test_varlen_metadata_parts_start_on_16_byte_boundaries():
    """Triton specialises pointers on 16-byte alignment: every part of the packed metadata must be
    aligned whatever the sequence and tile counts, or each new count compiles a new variant."""
    for seqs in ([(0, 7)], [(0, 5), (3, 9), (1, 1)], [(0, 70), (2, 3), (9, 4), (0, 1), (5, 33)]):
        fb = make_case(1, seqs, [], 4, 2, 16)[0]
        pm = fb.build_prefill_meta(16)
        base = pm.q_start.data_ptr()
        for t in (pm.q_start, pm.q_len, pm.ctx_len, pm.tile_seq, pm.tile_m, pm.block_table):
            assert (t.data_ptr() - base) % 16 == 0
        assert pm.q_len.tolist() == [n for _, n in seqs]
        assert pm.ctx_len.tolist() == [c + n for c, n in seqs]


def test_heavy_first_orders_tiles_by_the_keys_they_attend():
    """The launch order puts the tiles with the most keys first (a causal grid's longest programs
    in its first wave); the same tiles as in sequence order, ties in sequence order."""
    seqs = [(0, 70), (2, 3), (9, 4), (0, 1), (5, 33)]
    fb = make_case(1, seqs, [], 4, 2, 16)[0]
    plain = fb.build_prefill_meta(16)
    tiles = list(zip(plain.tile_seq.tolist(), plain.tile_m.tolist()))
    assert tiles[:5] == [(0, 0), (0, 16), (0, 32), (0, 48), (0, 64)]             # sequence order
    heavy = fb.build_prefill_meta(16, heavy_first=True)
    assert fb.build_prefill_meta(16, heavy_first=True) is heavy                  # cached
    order = list(zip(heavy.tile_seq.tolist(), heavy.tile_m.tolist()))
    keys = [seqs[i][0] + min(m + 16, seqs[i][1]) for i, m in order]
    assert sorted(order) == sorted(tiles) and keys == sorted(keys, reverse=True)
    assert order[:4] == [(0, 64), (0, 48), (0, 32), (4, 32)] and keys[:4] == [70, 64, 48, 38]


def test_triton_prefill_in_sequence_order_matches_dense():
    """Both launch orders compute the same rows (every program is independent of the others)."""
    from ainfer_pd.engine.attention.plan import PrefillPlan
    outs = [check(TritonAttention(torch.device("cpu"), prefill_override=PrefillPlan(16, 16, 4, 1, heavy_first=h)),
                  8, [(0, 37), (50, 5), (3, 16)], []) for h in (False, True)]
    assert torch.equal(outs[0], outs[1])


def test_triton_decode_caps_splits_and_lengthens_them_for_long_rows():
    """Past max_splits x split_keys keys a row's splits grow (its keys over max_splits), so a graph
    captured for the whole context has a bounded grid and partial buffer; rows still match the
    dense reference and are bitwise the same alone or beside longer rows."""
    over = {"block_n": 16, "split_keys": 16, "max_splits": 2}
    be = TritonAttention(torch.device("cpu"), decode_overrides=over)
    plan = be.decode_plan(104)
    assert plan.num_splits == 2                               # capped, not 7
    assert plan.row_split_keys(20) == 16 and plan.row_split_keys(70) == 48 and plan.row_split_keys(100) == 64
    out = check(be, 11, [], [3, 20, 70, 100], H=8, Hk=2)
    fb, q, kn, vn, kv, _ = make_case(11, [], [3, 20, 70, 100], 8, 2, 16)
    for j in (1, 2):
        assert torch.equal(_row_alone(fb, j, q, kn, vn, kv, be), out[j:j + 1])


def test_decode_plan_never_exceeds_its_split_cap():
    from ainfer_pd.engine.attention.plan import MAX_DECODE_SPLITS
    for keys in (1, 255, 256, 257, 16384, 16385, 40960, 131072):
        p = decode_plan(keys)
        assert 1 <= p.num_splits <= MAX_DECODE_SPLITS
        assert p.num_splits * p.row_split_keys(keys) >= keys          # the row's splits cover its keys
        if keys <= MAX_DECODE_SPLITS * p.split_keys:
            assert p.row_split_keys(keys) == p.split_keys             # unchanged up to 16K keys
