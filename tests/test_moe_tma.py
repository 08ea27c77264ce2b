"""The fused MoE's gate_up through TMA descriptors (engine/fused_moe/kernels_tma.py), in the
interpreter: the engine's ``fused_experts`` with a TMA plan against the reference experts path
(several row blocks an expert, idle experts, a K that is not a multiple of the K step: the
descriptor's zero fill past an expert's rows), and the plan's choice of it."""
import pytest
import torch

from ainfer_pd.engine.fused_moe import GemmPlan, MoEPlan, fused_experts, moe_plan
from ainfer_pd.engine.fused_moe.plan import gate_up_tma_ok
from ainfer_pd.engine.model.moe import experts_local, route
from ainfer_pd.engine.tma import has_tma


@pytest.mark.parametrize("T,E,k,D,I,bk", [(40, 8, 2, 64, 32, 16), (21, 6, 3, 40, 32, 16), (9, 16, 2, 48, 16, 32)],
                         ids=["blocks-per-expert", "k-tail", "idle-experts"])
def test_tma_gate_up_in_fused_experts_matches_reference(T, E, k, D, I, bk):
    g = torch.Generator().manual_seed(T)
    w13 = torch.randn(E, D, 2 * I, generator=g) * D ** -0.5
    w2 = torch.randn(E, I, D, generator=g) * I ** -0.5
    x = torch.randn(T, D, generator=g)
    r = route(x, torch.randn(E, D, generator=g), k)
    tile = GemmPlan(16, 16, bk, 4, 4, 1)
    assert gate_up_tma_ok(x, w13, tile.block_n)
    out = fused_experts(x, r, w13, w2, MoEPlan(tile, tile, gate_up_tma=True))
    ref = experts_local(x, r, w13, w2)
    assert (out - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    plain = fused_experts(x, r, w13, w2, MoEPlan(tile, tile))
    assert (out - plain).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())


def test_plan_takes_tma_gate_up_only_where_it_measured_faster():
    E = 128
    for T in (2048, 4096):                            # up to 256 rows an expert (measured faster there)
        assert moe_plan(T * 8, E, False, tokens=T, tma=True).gate_up_tma
    assert not moe_plan(8192 * 8, E, False, tokens=8192, tma=True).gate_up_tma      # 512 rows: pointer loads
    assert not moe_plan(4096 * 8, E, False, tokens=4096).gate_up_tma
    for T in (1, 16, 128, 512):                       # decode and medium tiers keep the pointer kernels
        assert not moe_plan(T * 8, E, False, tokens=T, tma=True).gate_up_tma
    assert not moe_plan(4096 * 8, E, True, tokens=4096, tma=True).gate_up_tma      # float32: its own tiles
    p = moe_plan(4096 * 8, E, False, tokens=4096, tma=True)
    assert p.down == moe_plan(4096 * 8, E, False, tokens=4096).down                # down keeps its pointer tile
    assert not has_tma(torch.device("cpu"))


def test_gate_up_tma_ok_refuses_layouts_a_descriptor_cannot_read():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert gate_up_tma_ok(x, torch.zeros(8, 64, 2 * 256, dtype=torch.bfloat16))
    assert not gate_up_tma_ok(x, torch.zeros(8, 64, 2 * 192, dtype=torch.bfloat16))            # I % 128
    assert not gate_up_tma_ok(x, torch.zeros(8, 2 * 256, 64, dtype=torch.bfloat16).transpose(1, 2))
    assert not gate_up_tma_ok(x.float(), torch.zeros(8, 64, 2 * 256, dtype=torch.bfloat16))   # x's dtype
    assert not gate_up_tma_ok(x, torch.zeros(8, 64, 2 * 256, dtype=torch.int16))
