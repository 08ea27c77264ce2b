"""The sweep's FP8 TMA expert GEMMs (benchmarks/fp8_moe_tma.py) against the engine's FP8 fused MoE with
the same tiles, in the interpreter: the same act bytes and scales, the same rows, and the FP8 oracle
(act quantized in gate_up's epilogue and by a launch of its own; a partial K step; a column tail)."""
import sys
from pathlib import Path

import pytest
import torch

from ainfer_pd.engine.fused_moe import GemmPlan, align_blocks, moe_sum
from ainfer_pd.engine.quant import fp8
from ainfer_pd.engine.quant.fp8_ops import fused_experts_fp8, launch_fp8_gate_up, per_token_group_quant
from ainfer_pd.engine.quant.fp8_plan import Fp8MoEPlan
from tests.test_fp8_kernels import moe_case, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from fp8_moe_tma import launch_fp8_down_tma, launch_fp8_gate_up_tma  # noqa: E402


@pytest.mark.parametrize("T,E,k,D,inter,plan", [
    (40, 4, 2, 256, 256, Fp8MoEPlan(GemmPlan(16, 128, 128, 2, 4, 1), GemmPlan(16, 64, 128, 2, 4, 1),
                                    quant_x_on_load=False, quant_act_on_load=False)),
    (21, 8, 3, 160, 128, Fp8MoEPlan(GemmPlan(16, 64, 64, 1, 4, 1), GemmPlan(16, 32, 64, 1, 4, 1),
                                    quant_x_on_load=False, quant_act_on_load=False)),
], ids=["act-in-epilogue", "act-launch-k-tail"])
def test_fp8_tma_experts_match_the_engine_and_the_oracle(T, E, k, D, inter, plan):
    x, r, ws = moe_case(T, E, k, D, inter, torch.float32)
    w13_q, w13_s, w2_q, w2_s = ws
    layout = align_blocks(r, plan.block_m)
    xq, xs = per_token_group_quant(x)
    act, act_s = launch_fp8_gate_up_tma(xq, xs, w13_q, w13_s, layout, k, plan)
    ref_act, ref_s = launch_fp8_gate_up(xq, xs, w13_q, w13_s, layout, k, plan)
    assert torch.equal(act.view(torch.uint8), ref_act.view(torch.uint8)) and torch.equal(act_s, ref_s)
    rows = torch.full((T * k, D), float("nan"))
    launch_fp8_down_tma(act, act_s, w2_q, w2_s, rows, layout, r.topk_weights.reshape(-1).contiguous(), plan)
    out = moe_sum(rows, T, k)
    assert torch.equal(out, fused_experts_fp8(x, r, *ws, plan=plan))
    assert rel_err(out, fp8.experts_fp8_reference(x, r.topk_idx, r.topk_weights, *ws)) <= 1e-4
