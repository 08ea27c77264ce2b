"""The sweep's TMA expert GEMMs (benchmarks/moe_tma.py) against the reference experts path, in the
interpreter: several row blocks an expert, idle experts, a K that is not a multiple of the K step
(the descriptor's zero fill past an expert's rows), a down whose N is not a multiple of the tile."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ainfer_pd.engine.fused_moe import GemmPlan, align_blocks, moe_sum  # noqa: E402
from ainfer_pd.engine.model.moe import experts_local, route  # noqa: E402
from moe_tma import launch_down_tma, launch_gate_up_tma  # noqa: E402


@pytest.mark.parametrize("T,E,k,D,I,bk", [(40, 8, 2, 64, 32, 16), (21, 6, 3, 40, 32, 16), (9, 16, 2, 48, 16, 32)],
                         ids=["blocks-per-expert", "k-tail", "idle-experts"])
def test_tma_expert_gemms_match_reference(T, E, k, D, I, bk):
    g = torch.Generator().manual_seed(T)
    w13 = torch.randn(E, D, 2 * I, generator=g) * D ** -0.5
    w2 = torch.randn(E, I, D, generator=g) * I ** -0.5
    x = torch.randn(T, D, generator=g)
    r = route(x, torch.randn(E, D, generator=g), k)
    plan = GemmPlan(16, 16, bk, 4, 4, 1)
    layout = align_blocks(r, plan.block_m)
    act = torch.full((T * k, I), float("nan"))
    launch_gate_up_tma(x, w13, act, layout, k, plan)
    rows = torch.full((T * k, D), float("nan"))
    launch_down_tma(act, w2, rows, layout, r.topk_weights.reshape(-1).contiguous(), plan)
    out = moe_sum(rows, T, k)
    ref = experts_local(x, r, w13, w2)
    assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
