"""The sweep's half-block expert GEMMs (benchmarks/moe_half_blocks.py) against the reference experts
path, in the interpreter, and their layout: every pair in exactly one block's rows, an expert's last
block a half one exactly when its run needs no more than half a block past its full ones."""
import sys
from pathlib import Path

import pytest
import torch

from tests._ptx_child import compile_in_child

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ainfer_pd.engine.fused_moe import GemmPlan, moe_sum  # noqa: E402
from ainfer_pd.engine.model.moe import experts_local, route  # noqa: E402
from moe_half_blocks import (half_block_layout, half_block_layout_triton, launch_down_half,  # noqa: E402
                             launch_gate_up_half, launch_gate_up_half_tma)


def _layout_rows(layout, block_m):
    sorted_ids, start, expert, half, nb = layout
    rows = {}
    for b in range(int(nb.item())):
        n = block_m // 2 if half[b] else block_m
        for p in sorted_ids[int(start[b]):int(start[b]) + n].tolist():
            rows.setdefault(p, []).append(int(expert[b]))
    return rows


@pytest.mark.parametrize("build", [half_block_layout, half_block_layout_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("T,E,k,bm", [(40, 8, 2, 16), (23, 6, 3, 8), (9, 16, 2, 16), (64, 4, 2, 16)])
def test_half_block_layout_covers_every_pair_once_in_its_expert(T, E, k, bm, build):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 32, generator=g)
    r = route(x, torch.randn(E, 32, generator=g), k)
    layout = build(r, bm)
    rows = _layout_rows(layout, bm)
    N = T * k
    flat = r.topk_idx.reshape(-1).tolist()
    assert all(rows[p] == [flat[p]] for p in range(N)), "each pair once, in its expert's block"
    _, start, expert, half, nb = layout
    counts = r.counts.tolist()
    for e in range(E):
        blocks = [b for b in range(int(nb.item())) if int(expert[b]) == e]
        assert len(blocks) == -(-counts[e] // bm)
        tail = counts[e] % bm
        assert [int(half[b]) for b in blocks] == [0] * (len(blocks) - 1) + [1] * (len(blocks) > 0) \
            if 0 < tail <= bm // 2 else all(int(half[b]) == 0 for b in blocks)


@pytest.mark.parametrize("T,E,k,D,I,bk", [(40, 8, 2, 64, 32, 16), (21, 6, 3, 40, 32, 16), (9, 16, 2, 48, 16, 32)],
                         ids=["blocks-per-expert", "k-tail", "idle-experts"])
def test_half_block_expert_gemms_match_reference(T, E, k, D, I, bk):
    g = torch.Generator().manual_seed(T)
    w13 = torch.randn(E, D, 2 * I, generator=g) * D ** -0.5
    w2 = torch.randn(E, I, D, generator=g) * I ** -0.5
    x = torch.randn(T, D, generator=g)
    r = route(x, torch.randn(E, D, generator=g), k)
    plan = GemmPlan(16, 16, bk, 4, 4, 1)
    layout = half_block_layout(r, plan.block_m)
    assert int(layout[3].sum()) > 0, "the case has half blocks"
    act = torch.full((T * k, I), float("nan"))
    launch_gate_up_half(x, w13, act, layout, k, plan)
    rows = torch.full((T * k, D), float("nan"))
    launch_down_half(act, w2, rows, layout, r.topk_weights.reshape(-1).contiguous(), plan)
    out = moe_sum(rows, T, k)
    ref = experts_local(x, r, w13, w2)
    assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    act_tma = torch.full((T * k, I), float("nan"))               # gate_up's weight tiles through descriptors
    launch_gate_up_half_tma(x, w13, act_tma, layout, k, plan)
    assert (act_tma - act).abs().max().item() < 1e-5 * max(1.0, act.abs().max().item())


_CHILD = r'''
import json, sys
sys.path.insert(0, "benchmarks")
from benchmarks.kernel_ptx_report import compile_stats
from moe_half_blocks import moe_down_half_kernel, moe_gate_up_half_kernel, moe_gate_up_half_tma_kernel
lay = dict.fromkeys(("SORTED", "BLOCK_START", "BLOCK_EXPERT", "BLOCK_HALF", "NUM_BLOCKS"), "*i32")
tile = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, IEEE=False)
try:
    out = {"gate_up": compile_stats(moe_gate_up_half_kernel, {**lay, "X": "*bf16", "W": "*bf16", "ACT": "*bf16"},
                                    {"K": 2048, "I": 768, "stride_xt": 2048, "stride_wk": 1536, "stride_an": 768},
                                    dict(tile, TOPK=8), 8, 4),
           "gate_up_tma": compile_stats(moe_gate_up_half_tma_kernel, {**lay, "X": "*bf16", "W": "*bf16",
                                        "ACT": "*bf16"}, {"K": 2048, "I": 768, "E": 128, "stride_xt": 2048,
                                        "stride_an": 768}, dict(tile, BLOCK_K=64, TOPK=8), 8, 4),
           "down": compile_stats(moe_down_half_kernel, {**lay, "A": "*bf16", "W": "*bf16", "OUT": "*bf16",
                                 "TOPW": "*fp32"}, {"K": 768, "N": 2048, "stride_an": 768, "stride_wk": 2048,
                                 "stride_on": 2048}, tile, 8, 4)}
except Exception as e:
    if "ptxas" not in str(e).lower():
        raise
    out = {"skip": str(e)[:300]}
print(json.dumps(out))
'''


def test_half_blocks_compile_for_sm90_with_both_tile_heights():
    """On sm_90 the prefill tile (128 x 128 x 32, 8 warps, 4 stages) compiles with no spill, its full
    blocks on m64n128 wgmma and its half blocks on m64n64 (the two warpgroups side by side on N); the TMA
    gate_up (128 x 128 x 64) the same, with TMA bulk copies."""
    pytest.importorskip("triton")
    out = compile_in_child(_CHILD)
    for name, s in out.items():
        shapes = {m.split(".")[4] for m in s["mma"]}
        # the TMA gate_up's 128 x 128 x 64 tile spills ~300 bytes with or without half blocks (test_moe_tma_ptx)
        assert s["spill"] < (512 if name == "gate_up_tma" else 1) and shapes == {"m64n64k16", "m64n128k16"}, (name, s)
    assert out["gate_up_tma"]["tma_loads"] > 0, out["gate_up_tma"]
