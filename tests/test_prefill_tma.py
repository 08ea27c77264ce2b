"""The sweep's TMA prefill candidate (benchmarks/prefill_tma.py) against the dense reference, in the
interpreter: fresh prompts and cached prefixes, sequences shorter and longer than a tile, GQA."""
import sys
from pathlib import Path

import pytest
import torch

from tests.test_paged_attention import dense_reference, make_case

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from prefill_tma import prefill_tma  # noqa: E402


@pytest.mark.parametrize("seqs,bm,bn,H,Hk", [
    ([(0, 37), (0, 5), (0, 20)], 16, 16, 4, 2),
    ([(0, 40), (9, 13), (30, 17)], 16, 8, 8, 2),
    ([(6, 33), (0, 16)], 32, 16, 4, 4),
], ids=["fresh", "cached-prefix", "one-head-a-group"])
def test_prefill_tma_matches_dense(seqs, bm, bn, H, Hk):
    fb, q, knew, vnew, kv, refs = make_case(3, seqs, [], H, Hk, 16, num_blocks=96)
    kv[0][fb.write_slots] = knew          # the pass's keys, in the pool as the engine writes them
    kv[1][fb.write_slots] = vnew
    out = torch.full_like(q, float("nan"))
    prefill_tma(q, knew, vnew, kv[0], kv[1], fb, out, block_m=bm, block_n=bn, num_warps=4, num_stages=1)
    for t, n, cached, slots in refs:
        ref = dense_reference(q[t:t + n], kv[0][slots], kv[1][slots], cached)
        assert (out[t:t + n].double() - ref).abs().max().item() < 1e-5, (t, n, cached)
