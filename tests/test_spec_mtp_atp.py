"""MTP drafts (``spec.method: mtp``) under attention TP: what a TP follower receives of its leader's MTP
passes (``engine/runtime/mtp_wire.py``)."""
from __future__ import annotations


# ---------------------------------------------------------------- the wire (pure)
def _same_fb(a, b) -> None:
    for name in ("input_ids", "positions", "write_slots"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert [(s.q_start, s.q_len, s.ctx_len, s.block_ids.tolist()) for s in a.prefill] == \
        [(s.q_start, s.q_len, s.ctx_len, s.block_ids.tolist()) for s in b.prefill]
    assert (a.decode is None) == (b.decode is None)
    if a.decode is not None:
        assert a.decode.ctx_lens.tolist() == b.decode.ctx_lens.tolist()
        assert a.decode.block_table.tolist() == b.decode.block_table.tolist()


def test_the_wire_gives_a_follower_the_leaders_catch_ups_and_chain_under_stash_keys():
    """What a TP follower receives equals what its leader built, each trajectory named by its
    stash key: a D batch's catch-up (padded to the agreed rows), a P batch's (rows, or a pass of
    none), a verify round's world chain."""
    import types

    import torch

    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime import mtp_wire as wire
    from ainfer_pd.spec.mtp_batch import catch_up_batch, decode_catch_up, world_chain_batches
    from ainfer_pd.spec.stash_keys import StashKeys
    kv, keys = KVCacheManager(16, 4), StashKeys()
    for tid, n in (("a", 10), ("b", 7)):
        kv.reserve(tid, 20, list(range(n)))
    turns = [types.SimpleNamespace(tid="a", context=list(range(10)), seq_len=10),
             types.SimpleNamespace(tid="b", context=list(range(7)), seq_len=7)]
    turns[0].out_tokens = turns[1].out_tokens = [3]
    covered = {("a", 8)}                                   # a's stash holds position 8, b's nothing
    d = decode_catch_up(kv, "cpu", turns, None, [[5, 6], []], lambda tid, p: (tid, p) in covered, 64)
    got = wire.unpack_decode_catch_up(wire.pack_decode_catch_up(d, keys.of, 8), 8, torch.device("cpu"))
    assert got.first.tolist() == d.first.tolist() and got.first_write.tolist() == d.first_write.tolist()
    assert got.refs == [(0, keys.of("a"), 8)] and got.ref_rows.tolist() == [0]
    assert got.keeps == [(keys.of(t), a, b, p) for t, a, b, p in d.keeps]
    p = catch_up_batch(kv, "cpu", 12, [(turns[0], 4, 6), (turns[1], 0, 6)], [], None, None,
                       lambda tid, q: tid == "a")
    got = wire.unpack_prefill_catch_up(wire.pack_prefill_catch_up(p, keys.of), torch.device("cpu"), 4)
    _same_fb(p.fb, got.fb)
    for name in ("tok_idx", "extra", "hid_idx", "keep_idx"):
        assert getattr(p, name).tolist() == getattr(got, name).tolist(), name
    assert got.refs == [(keys.of(t), q) for t, q in p.refs] and got.drops == [keys.of(t) for t in p.drops]
    assert got.keeps == [(keys.of(t), a, b, q) for t, a, b, q in p.keeps] and p.refs and p.drops and p.keeps
    empty = decode_catch_up(kv, "cpu", [], None, None, lambda tid, q: False, 64)        # a P pass of no rows
    got = wire.unpack_prefill_catch_up(wire.pack_prefill_catch_up(empty, keys.of), torch.device("cpu"), 4)
    assert type(got) is type(empty) and got.first.numel() == 0 and not got.refs
    steps = world_chain_batches(kv, "cpu", [("a", 10, 77, 3), ("b", 7, 88, 1)], 4, 3, 64, 16)
    refs = [("a", 8), ("b", 5)]
    back, got_refs = wire.unpack_chain(wire.pack_chain(steps, refs, keys.of, 4, 6), 4, 3, 6, torch.device("cpu"), 4)
    assert got_refs == [(keys.of("a"), 8), (keys.of("b"), 5)] and len(back) == 3
    for a, b in zip(steps, back):
        _same_fb(a, b)
    keys.forget("a")
    assert keys.take(5) == [0] and keys.of("a") == 2 and len(keys) == 2       # a new key: never reused
