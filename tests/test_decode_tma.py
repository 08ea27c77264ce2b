"""The sweep's TMA decode candidate (benchmarks/decode_tma.py) against the dense reference and the
engine's kernel, in the interpreter: splits, rows shorter than a split, GQA, a page past the end."""
import sys
from pathlib import Path

import pytest
import torch

from ainfer_pd.engine.attention.triton_backend import TritonAttention
from tests.test_paged_attention import dense_reference, make_case

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from decode_tma import decode_tma  # noqa: E402


@pytest.mark.parametrize("join", [False, True], ids=["page-steps", "joined"])
@pytest.mark.parametrize("lens,H,Hk,pages,over", [
    ([2, 40, 61], 8, 2, 4, {"block_n": 16, "split_keys": 16}),
    ([1, 5, 17, 33], 4, 4, 2, {"block_n": 16, "split_keys": 32}),
    ([9, 30], 8, 2, 1, {"block_n": 8, "split_keys": 64}),
], ids=["splits", "one-head-a-group", "one-split"])
def test_decode_tma_matches_dense_and_the_engine(lens, H, Hk, pages, over, join):
    fb, q, knew, vnew, kv, refs = make_case(11, [], lens, H, Hk, 16, num_blocks=64)
    kv[0][fb.write_slots] = knew              # the rows' own keys, in the pool as the engine writes them
    kv[1][fb.write_slots] = vnew
    be = TritonAttention(torch.device("cpu"), decode_overrides=over)
    plan = be.decode_plan(fb.decode.max_keys)
    out = decode_tma(q, kv[0], kv[1], fb, plan, pages=pages, join=join)
    engine = be.decode(q, kv[0], kv[1], fb)
    for t, n, cached, slots in refs:
        ref = dense_reference(q[t:t + n], kv[0][slots], kv[1][slots], cached)
        assert (out[t:t + n].double() - ref).abs().max().item() < 1e-5, (t, cached)
    assert (out - engine).abs().max().item() < 1e-5
