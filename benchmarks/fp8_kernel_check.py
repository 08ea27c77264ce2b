"""Blockwise-FP8 kernels (issue 37) on the Qwen3-30B-A3B shape: errors against the torch oracle,
timings against the HBM bound, and tile / path sweeps (one H200, < 120 s).

* ``act_quant``: :func:`per_token_group_quant` against ``fp8.quantize_token_groups`` and against
  the same math with an IEEE division (``quantize_ieee``): scale mismatches (count, max ulps) and
  e4m3 byte mismatches (count, max distance in e4m3 steps). On CUDA the oracle's ``amax / 448``
  multiplies by fl(1/448) (torch divides by a Python float that way), one ulp off for about half
  the scales, and x / scale then rounds 1 step apart near e4m3 midpoints (many with bf16 input):
  see ``engine/quant/fp8_kernels.py``. Against ``quantize_ieee`` 0 mismatches are expected; a
  non-zero count there would be the hardware cast.
* ``err_moe``: :func:`fused_experts_fp8` against ``experts_fp8_reference`` with every plan of the
  table and each path (quantization on load, by separate launches, the k-slot sum folded into
  down), and ``paths_bit_equal``: the on-load and separate-launch paths with the same tiles
  (equal bytes into equal dots: equal outputs expected). ``err_linear``: :func:`fp8_linear`
  (x quantized on load up to 16 rows) against ``fp8_linear_reference``. Beside them the FP8
  oracle's own distance to the bf16 torch path (the quantization's error).
* ``fold``: the fold path in a CUDA graph replayed on two alternating inputs against eager (a
  stale or racy read of another program's rows shows as a mismatch), and batch invariance (a
  token's output taken out of its batch, bit for bit) of the on-load and fold paths.
* ``moe_T*``: fused_experts_fp8 (the table's plan) and the bf16 ``fused_experts`` at T tokens (a
  CUDA graph of ``REPS`` calls on distinct routings for T <= 128, so the touched experts are not
  L2-resident; eager for prefill), median of CUDA-event timings, against the HBM bound of the
  touched experts' weights (1 byte per FP8 weight + its float32 block scales; 2 per bf16 weight)
  at 4.8 TB/s, and a FLOP bound (H200 dense: 1979 TFLOP/s FP8, 989 bf16) for the roofline ratio.
* ``sweep_T*``: the quantize-on-load path against the separate-launch path (the previous best
  tiles, 16 x 32 gate_up / 16 x 64 down, 4 warps, 4 stages; prefill 64 x 128, 8 warps, 3 stages),
  the swapped-operand decode plans (the table's 16 x 64 / 16 x 64 on e4m3 wgmma, act quantized
  in a 16 x 128 gate_up's epilogue, a 16 x 128 down, on load with the fold), the fold, the
  prefill tiles that no longer spill (64 x 128 gate_up with 4 warps, 128 x 128), graph-timed up to
  T = 128; the best per size, and ``swap_over_separate``. ``--tiles`` runs only these sweeps.
  ``sweep_linear_*``: dense-GEMM plans at one row, x quantized on load or by its own launch.
  The sweeps stop past ``--budget-s``.

Every figure is a ``FIG name = json`` line.

    python benchmarks/fp8_kernel_check.py [--budget-s 100] [--out fp8.json] [--tiles]
    python benchmarks/fp8_kernel_check.py --smoke      # CPU, TRITON_INTERPRET=1, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if "--smoke" in sys.argv:                          # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd.engine.fused_moe import fused_experts  # noqa: E402
from ainfer_pd.engine.fused_moe.plan import GemmPlan, MoEPlan  # noqa: E402
from ainfer_pd.engine.model.moe import Routing, experts_local, route, routing_of  # noqa: E402
from _gate_cases import e4m3_steps  # noqa: E402
from ainfer_pd.engine.quant import fp8  # noqa: E402
from ainfer_pd.engine.quant.fp8_ops import fp8_linear, fused_experts_fp8, per_token_group_quant  # noqa: E402
from ainfer_pd.engine.quant.fp8_plan import Fp8MoEPlan, as_fp8_moe_plan, fp8_moe_plan  # noqa: E402

HBM_BW = 4.8e12
PEAK = {"fp8": 1979e12, "bf16": 989e12}
T0 = time.time()
RES: dict = {}


@dataclass(frozen=True)
class Shape:
    D: int
    E: int
    k: int
    I: int
    decode: tuple[int, ...]
    prefill: tuple[int, ...]
    err_T: tuple[int, ...]
    linears: tuple[tuple[int, int], ...]        # (N, K) of the dense layers checked
    reps: int                                   # calls (distinct routings) per decode graph
    iters: int                                  # timed replays / calls


FULL = Shape(2048, 128, 8, 768, (1, 16, 64, 128), (2048, 8192), (1, 16, 64), ((5120, 2048), (2048, 4096)), 16, 30)
SMOKE = Shape(256, 8, 2, 192, (1, 4), (24,), (1, 5), ((320, 256), (256, 200)), 1, 1)
_D_GU, _D_DN = GemmPlan(16, 32, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4)     # the previous decode best
_P_GU, _P_DN = GemmPlan(64, 128, 128, 8, 8, 3), GemmPlan(64, 128, 128, 8, 4, 4)    # the previous prefill best
_S_GU, _S_DN = GemmPlan(16, 64, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4)     # swapped operands (the table's)
SWEEP = {   # name -> plan (a plain MoEPlan: x / act quantized by launches of their own, a torch sum)
    "separate": MoEPlan(_D_GU, _D_DN),
    "swap": Fp8MoEPlan(_S_GU, _S_DN, quant_x_on_load=False, quant_act_on_load=False, swap_ab=True),
    "swap_gu128_fused": Fp8MoEPlan(GemmPlan(16, 128, 128, 1, 4, 4), _S_DN, quant_x_on_load=False,
                                   quant_act_on_load=False, swap_ab=True),
    "swap_dn128": Fp8MoEPlan(_S_GU, GemmPlan(16, 128, 128, 1, 4, 4), quant_x_on_load=False,
                             quant_act_on_load=False, swap_ab=True),
    "swap_load_fold": Fp8MoEPlan(_S_GU, _S_DN, fold_sum=True, swap_ab=True),
    # the table's decode plan with down summing each token's k rows (no moe_sum launch: ~3 us a layer at B 64)
    "swap_fold": Fp8MoEPlan(_S_GU, _S_DN, quant_x_on_load=False, quant_act_on_load=False, fold_sum=True, swap_ab=True),
    "load": Fp8MoEPlan(_D_GU, _D_DN),
    "load_fold": Fp8MoEPlan(_D_GU, _D_DN, fold_sum=True),
    "load_w2": Fp8MoEPlan(GemmPlan(16, 32, 128, 1, 2, 4), GemmPlan(16, 64, 128, 1, 2, 4)),
    "load_n64": Fp8MoEPlan(GemmPlan(16, 64, 128, 1, 4, 4), GemmPlan(16, 128, 128, 1, 4, 4)),
    "load_dn32_fold": Fp8MoEPlan(_D_GU, GemmPlan(16, 32, 128, 1, 4, 4), fold_sum=True),
}
PREFILL_SWEEP = {
    "separate": MoEPlan(_P_GU, _P_DN),                         # act quantized in gate_up's epilogue
    "load": Fp8MoEPlan(_P_GU, _P_DN),
    "x_load": Fp8MoEPlan(_P_GU, _P_DN, quant_act_on_load=False),
    "load_fold": Fp8MoEPlan(_P_GU, _P_DN, fold_sum=True),
    "x_load_w4": Fp8MoEPlan(GemmPlan(64, 128, 128, 8, 4, 3), _P_DN, quant_act_on_load=False),
    "gu_w4": MoEPlan(GemmPlan(64, 128, 128, 8, 4, 3), _P_DN),                 # spilled before the scalar scale
    "t128": MoEPlan(GemmPlan(128, 128, 128, 8, 8, 3), GemmPlan(128, 128, 128, 8, 8, 3)),     # likewise
    # gate_up of 64 columns a program (gate and up 64 each), 4 warps: 167 registers a thread and 72 KB
    # of shared memory at 3 stages, so 3 CTAs an SM where the 64 x 128 x 8-warp tile fits one (171 x 256
    # registers, 120 KB): the other CTAs' wgmmas can fill each K step's wait and its scaling FMAs, which
    # one CTA leaves the tensor cores idle for. act is then float32, quantized by a launch of its own
    # (a program's 64 columns are half a 128-column group)
    "gu_n64_w4": MoEPlan(GemmPlan(64, 64, 128, 8, 4, 3), _P_DN),
    "gu_n64_w4_s4": MoEPlan(GemmPlan(64, 64, 128, 8, 4, 4), _P_DN),
    # 128-row blocks on 8 warps with gate_up 64 columns a program: 172 registers, no spill once each K step's
    # product takes one FMA (fp8-scale-fold; PTX for sm_90, Triton 3.9), with down 128 or 64 columns wide
    "t128_gu_n64": MoEPlan(GemmPlan(128, 64, 128, 8, 8, 3), GemmPlan(128, 128, 128, 8, 8, 3)),
    "t128_n64": MoEPlan(GemmPlan(128, 64, 128, 8, 8, 3), GemmPlan(128, 64, 128, 8, 8, 3)),
}
LINEAR_SWEEP = ((GemmPlan(16, 32, 128, 1, 4, 4), True), (GemmPlan(16, 32, 128, 1, 4, 4), False),
                (GemmPlan(16, 64, 128, 1, 4, 4), True), (GemmPlan(16, 128, 128, 1, 4, 3), True))


def fig(name: str, value) -> None:
    RES[name] = value
    print(f"FIG {name} = {json.dumps(value)}", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0


def median_ms(fn, iters: int) -> float:
    """Median milliseconds of one call of ``fn`` (CUDA events around each call; wall clock on CPU)."""
    fn()
    if DEV.type != "cuda":
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in evs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def graphed(fn):
    """``fn`` captured in a CUDA graph (warm-up on a side stream first): its replay; ``fn`` on CPU.
    The capture fails if ``fn`` syncs with the host."""
    from _cuda_timing import graph_of     # benchmarks/ is on sys.path when run as a script
    return fn if DEV.type != "cuda" else graph_of(fn).replay


def over_budget(budget: float) -> bool:
    return time.time() - T0 > budget


# --------------------------------------------------------------------------- inputs
DEV = torch.device("cpu")
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Experts:
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]   # w13_q, w13_scale, w2_q, w2_scale
    w13: torch.Tensor                                                       # bf16 [E, D, 2I] (the bf16 kernels' layout)
    w2: torch.Tensor                                                        # bf16 [E, I, D]
    router: torch.Tensor                                                    # bf16 [E, D]


def make_experts(s: Shape) -> Experts:
    """Random bf16 experts (gate, up [E, I, D], down [E, D, I]) and their blockwise-FP8 copies."""
    g = torch.Generator(device=DEV).manual_seed(0)
    gate, up = ((torch.randn(s.E, s.I, s.D, generator=g, device=DEV) * s.D ** -0.5).to(BF16) for _ in range(2))
    down = (torch.randn(s.E, s.D, s.I, generator=g, device=DEV) * s.I ** -0.5).to(BF16)
    w13_q, w13_s = fp8.quantize_w13(gate, up)
    w2_q, w2_s = fp8.quantize_blockwise(down)
    w13 = torch.cat([gate, up], dim=1).transpose(1, 2).contiguous()
    router = torch.randn(s.E, s.D, generator=g, device=DEV).to(BF16)
    return Experts((w13_q, w13_s, w2_q, w2_s), w13, down.transpose(1, 2).contiguous(), router)


def tokens(s: Shape, ex: Experts, T: int, seed: int) -> tuple[torch.Tensor, Routing]:
    g = torch.Generator(device=DEV).manual_seed(1000 + seed)
    x = torch.randn(T, s.D, generator=g, device=DEV).to(BF16)
    return x, route(x, ex.router, s.k)


def reference(x: torch.Tensor, r: Routing, ex: Experts, chunk: int = 64) -> torch.Tensor:
    """experts_fp8_reference, token chunk by chunk (it materialises [T k, I, D] float32 weights)."""
    return torch.cat([fp8.experts_fp8_reference(x[i:i + chunk], r.topk_idx[i:i + chunk], r.topk_weights[i:i + chunk],
                                                *ex.fp8) for i in range(0, x.shape[0], chunk)])


# --------------------------------------------------------------------------- correctness
def quantize_ieee(x: torch.Tensor, group: int = fp8.BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_token_groups`` with ``amax / 448`` divided by a device tensor: an IEEE
    division on CUDA too (torch multiplies by the reciprocal of a Python-float divisor there)."""
    t, k = x.shape
    kb = fp8.blocks(k, group)
    xg = torch.nn.functional.pad(x.float(), (0, kb * group - k)).view(t, kb, group)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, fp8.FP8_MAX)).clamp_(min=1e-12)
    q = (xg / scale).clamp_(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8).view(t, kb * group)[:, :k].contiguous()
    return q, scale.view(t, kb).contiguous()


def mismatch(q, sc, rq, rs) -> dict:
    """Scale mismatches (count, max ulps: float32 bit patterns of positive scales) and e4m3 byte
    mismatches (count, max distance in e4m3 steps) of (q, sc) against (rq, rs)."""
    ulps = (sc.view(torch.int32).long() - rs.view(torch.int32).long()).abs()
    steps = e4m3_steps(q, rq)
    return {"scale_mismatches": int((ulps > 0).sum()), "scale_max_ulps": int(ulps.max()) if ulps.numel() else 0,
            "byte_mismatches": int((steps > 0).sum()), "max_e4m3_steps": int(steps.max()) if steps.numel() else 0}


def check_act_quant(s: Shape) -> None:
    """Bytes and scales against the oracle and its IEEE-division twin: bf16 and float32 activations
    (the GPU gate's log-spaced magnitudes), and groups of amax 448 (scale 1) holding every e4m3
    value, every midpoint and its float32 neighbours (the cast's rounding itself)."""
    rows = 2048 if DEV.type == "cuda" else 33
    x = torch.randn(rows, s.D, device=DEV).to(BF16) * 3
    xf = torch.randn(rows, 1000, device=DEV) * torch.logspace(-3, 3, 1000, device=DEV)
    vals = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    grid = torch.cat([vals, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])    # a cast through fp16 rounds twice
    grid = torch.cat([grid, torch.zeros(-len(grid) % 127)]).view(-1, 127)
    grid = torch.cat([torch.full((grid.shape[0], 1), 448.0), grid], dim=1).to(DEV)
    out = {}
    for name, t in (("bf16_random", x), ("fp32_logspaced", xf), ("fp32_e4m3_midpoints", grid)):
        q, sc = per_token_group_quant(t)
        out[name] = {"elements": t.numel(), "groups": sc.numel(),
                     "vs_oracle": mismatch(q, sc, *fp8.quantize_token_groups(t)),
                     "vs_ieee_oracle": mismatch(q, sc, *quantize_ieee(t))}
    fig("act_quant", out)


def check_linear(s: Shape) -> None:
    rows = {}
    for N, K in s.linears:
        w = (torch.randn(N, K, device=DEV) * K ** -0.5).to(BF16)
        wq, ws = fp8.quantize_blockwise(w)
        for M in (1, 64, 2048 if DEV.type == "cuda" else 9):
            x = torch.randn(M, K, device=DEV).to(BF16)
            y, ref = fp8_linear(x, wq, ws), fp8.fp8_linear_reference(x, wq, ws)
            rows[f"N{N}_K{K}_M{M}"] = {"rel": rel_err(y, ref), "max": max_err(y, ref),
                                       "quant_rel_vs_bf16": rel_err(ref, torch.nn.functional.linear(x, w)),
                                       "on_load_equals_launch": bool(torch.equal(
                                           fp8_linear(x, wq, ws, quant_on_load=True),
                                           fp8_linear(x, wq, ws, quant_on_load=False)))}
        for M in (1, 2048 if DEV.type == "cuda" else 9):
            x = torch.randn(M, K, device=DEV).to(BF16)
            t8 = median_ms(lambda: fp8_linear(x, wq, ws), s.iters)
            tb = median_ms(lambda: torch.nn.functional.linear(x, w), s.iters)
            bound = (N * K + 4 * ws.numel()) / HBM_BW * 1e3
            rows[f"N{N}_K{K}_M{M}_time"] = {"fp8_ms": round(t8, 4), "bf16_torch_ms": round(tb, 4),
                                            "fp8_hbm_bound_ms": round(bound, 4), "fp8_ratio": round(t8 / bound, 2)}
    fig("err_linear", rows)


def check_moe(s: Shape, ex: Experts) -> None:
    """Every plan of the table and each path at the decode sizes, the table's and the on-load
    path at a prefill size; the on-load and separate paths with the same tiles bit for bit."""
    plans = {"small": fp8_moe_plan(1, s.E), "medium": fp8_moe_plan(32 * s.E, s.E), "large": fp8_moe_plan(1 << 30, s.E),
             "separate": SWEEP["separate"], "load_fold": SWEEP["load_fold"], "swap_load_fold": SWEEP["swap_load_fold"],
             "swap_fold": SWEEP["swap_fold"]}
    rows, equal = {}, {}
    for T in s.err_T + s.prefill[:1]:
        x, r = tokens(s, ex, T, seed=T)
        ref = reference(x, r, ex)
        rows[f"T{T}_quant_rel_vs_bf16"] = rel_err(ref, experts_local(x, r, ex.w13, ex.w2))
        todo = plans if T in s.err_T else {"table": None, "load": PREFILL_SWEEP["load"],
                                           "load_fold": PREFILL_SWEEP["load_fold"]}
        for name, plan in todo.items():
            out = fused_experts_fp8(x, r, *ex.fp8, plan=plan)
            rows[f"T{T}_{name}"] = {"rel": rel_err(out, ref), "max": max_err(out, ref)}
        for name, sw in (("decode", SWEEP), ("prefill", PREFILL_SWEEP)):      # same tiles, both paths
            equal[f"T{T}_{name}_tiles"] = bool(torch.equal(fused_experts_fp8(x, r, *ex.fp8, plan=sw["load"]),
                                                           fused_experts_fp8(x, r, *ex.fp8, plan=sw["separate"])))
    fig("err_moe", rows)
    fig("paths_bit_equal", equal)


def check_graph(s: Shape, ex: Experts) -> None:
    """fused_experts_fp8 captured in a CUDA graph (no host sync) gives the eager result, bit for bit."""
    x, r = tokens(s, ex, s.decode[-1], seed=7)
    out = {}
    for name, plan in (("table", None), ("separate", SWEEP["separate"]), ("load_fold", SWEEP["load_fold"])):
        eager = fused_experts_fp8(x, r, *ex.fp8, plan=plan)
        box = {}
        replay = graphed(lambda: box.__setitem__("out", fused_experts_fp8(x, r, *ex.fp8, plan=plan)))
        replay()
        out[name] = bool(torch.equal(box["out"], eager))
    fig("graph_equals_eager", out)


def check_fold(s: Shape, ex: Experts, replays: int) -> None:
    """The fold in a graph replayed on two alternating inputs, each replay against its eager output
    (a read of another program's rows before they land, or of the last replay's, mismatches);
    batch invariance of the on-load and fold paths (a token's output alone = in its batch)."""
    T = s.decode[-1]
    plan = SWEEP["load_fold"]
    cases = [tokens(s, ex, T, seed=50 + i) for i in range(2)]
    want = [fused_experts_fp8(x, r, *ex.fp8, plan=plan) for x, r in cases]
    x0, r0 = cases[0]
    sx, si, sw = x0.clone(), r0.topk_idx.clone(), r0.topk_weights.clone()
    sr = Routing(si, sw, None, r0.counts.clone())
    box = {}
    replay = graphed(lambda: box.__setitem__("out", fused_experts_fp8(sx, sr, *ex.fp8, plan=plan)))
    bad = 0
    for i in range(replays):
        x, r = cases[i % 2]
        for dst, src in ((sx, x), (si, r.topk_idx), (sw, r.topk_weights), (sr.counts, r.counts)):
            dst.copy_(src)
        replay()
        bad += int(not torch.equal(box["out"], want[i % 2]))
    sub = torch.tensor([T - 1, 0, T // 2, 3], device=DEV)
    rs = routing_of(r0.topk_idx[sub], r0.topk_weights[sub], s.E)
    inv = {name: bool(torch.equal(fused_experts_fp8(x0[sub], rs, *ex.fp8, plan=p),
                                  fused_experts_fp8(x0, r0, *ex.fp8, plan=p)[sub]))
           for name, p in (("load", SWEEP["load"]), ("load_fold", plan), ("separate", SWEEP["separate"]))}
    fig("fold", {"graph_replays": replays, "replay_mismatches": bad, "batch_invariant": inv,
                 "fold_rel_vs_torch_sum": rel_err(want[0], fused_experts_fp8(x0, r0, *ex.fp8, plan=SWEEP["load"]))})


# --------------------------------------------------------------------------- timing
def expert_bytes(s: Shape) -> dict[str, int]:
    """HBM bytes of one expert's weights: FP8 (1 byte each + float32 block scales) and bf16."""
    nb_i, nb_d = fp8.blocks(s.I), fp8.blocks(s.D)
    return {"fp8": 3 * s.I * s.D + 4 * (2 * nb_i * nb_d + nb_d * nb_i), "bf16": 2 * 3 * s.I * s.D}


def timed_calls(s: Shape, cases, fn) -> float:
    """Median ms of one call of ``fn(x, r)``: a graph of one call per case (distinct routings)
    for decode sizes, eager calls for prefill sizes."""
    run = lambda: [fn(x, r) for x, r in cases]          # noqa: E731
    T = cases[0][0].shape[0]
    return median_ms(graphed(run) if T <= 128 else run, s.iters) / len(cases)


def time_moe(s: Shape, ex: Experts, T: int) -> dict:
    """fused_experts_fp8 and the bf16 fused_experts at T tokens, each against its bounds."""
    cases = [tokens(s, ex, T, seed=100 * T + i) for i in range(s.reps if T <= 128 else 1)]
    touched = statistics.mean(int((r.counts > 0).sum()) for _, r in cases)
    flops = 2 * T * s.k * s.D * 3 * s.I
    out = {"experts_touched": touched, "graph": DEV.type == "cuda" and T <= 128}
    fns = {"fp8": lambda x, r: fused_experts_fp8(x, r, *ex.fp8),
           "bf16": lambda x, r: fused_experts(x, r, ex.w13, ex.w2)}
    for name, fn in fns.items():
        t = timed_calls(s, cases, fn)
        hbm = touched * expert_bytes(s)[name] / HBM_BW * 1e3
        roof = max(hbm, flops / PEAK[name] * 1e3)
        out[name] = {"ms": round(t, 4), "hbm_bound_ms": round(hbm, 4), "ratio": round(t / hbm, 2),
                     "roofline_ms": round(roof, 4), "roofline_ratio": round(t / roof, 2),
                     "tflops": round(flops / t / 1e9, 1)}
    out["bf16_over_fp8"] = round(out["bf16"]["ms"] / out["fp8"]["ms"], 2)
    return out


def sweep(s: Shape, ex: Experts, budget: float, sizes: tuple[int, ...], plans: dict) -> None:
    """The fused-MoE ``plans`` at each of ``sizes`` tokens (graph-timed up to 128); the best per size."""
    for T in sizes:
        cases = [tokens(s, ex, T, seed=100 * T + i) for i in range(s.reps if T <= 128 else 1)]
        touched = statistics.mean(int((r.counts > 0).sum()) for _, r in cases)
        hbm = touched * expert_bytes(s)["fp8"] / HBM_BW * 1e3
        rows = {}
        for name, plan in plans.items():
            if over_budget(budget):
                print(f"  sweep T{T}: budget reached", flush=True)
                break
            try:
                rows[name] = round(timed_calls(s, cases, lambda x, r: fused_experts_fp8(x, r, *ex.fp8, plan=plan)), 4)
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile is reported and skipped
                print(f"  sweep T{T} {name}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
        if rows:
            best = min(rows, key=rows.get)
            fig(f"sweep_T{T}", {"best": best, "best_plan": _moe_plan_desc(plans[best]), "ms": rows[best],
                                "hbm_bound_ms": round(hbm, 4), "ratio": round(rows[best] / hbm, 2),
                                "load_over_separate": round(rows["load"] / rows["separate"], 3)
                                if {"load", "separate"} <= rows.keys() else None,
                                "swap_over_separate": round(rows["swap"] / rows["separate"], 3)
                                if {"swap", "separate"} <= rows.keys() else None, "all_ms": rows})


def sweep_linear(s: Shape, budget: float, plans: tuple[tuple[GemmPlan, bool], ...]) -> None:
    """A few dense-GEMM plans for one decode row, x quantized on load or by its own launch
    (included in the time); the best per layer."""
    for N, K in s.linears:
        w = (torch.randn(N, K, device=DEV) * K ** -0.5).to(BF16)
        wq, ws = fp8.quantize_blockwise(w)
        x = torch.randn(1, K, device=DEV).to(BF16)
        rows = {}
        for plan, on_load in plans:
            if over_budget(budget):
                break
            run = graphed(lambda: fp8_linear(x, wq, ws, plan=plan, quant_on_load=on_load))
            rows[json.dumps(_plan_tuple(plan) + [int(on_load)])] = round(median_ms(run, s.iters), 4)
        if rows:
            best = min(rows, key=rows.get)
            bound = (N * K + 4 * ws.numel()) / HBM_BW * 1e3
            fig(f"sweep_linear_N{N}_K{K}_M1", {"best_plan_on_load": json.loads(best), "ms": rows[best],
                                               "hbm_bound_ms": round(bound, 4), "ratio": round(rows[best] / bound, 2),
                                               "all_ms": rows})


def _plan_tuple(g: GemmPlan) -> list[int]:
    return [g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages]


def _moe_plan_desc(plan: MoEPlan | Fp8MoEPlan) -> dict:
    p = as_fp8_moe_plan(plan)
    return {"gate_up": _plan_tuple(p.gate_up), "down": _plan_tuple(p.down), "x_on_load": p.quant_x_on_load,
            "act_on_load": p.quant_act_on_load, "fold_sum": p.fold_sum, "swap_ab": p.swap_ab}


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--budget-s", type=float, default=100.0, help="the sweep stops past this many seconds")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--tiles", action="store_true", help="only the fused-MoE tile / path sweeps")
    args = ap.parse_args()
    DEV = torch.device("cpu" if args.smoke else "cuda")
    s = SMOKE if args.smoke else FULL
    print(f"fp8 kernel check on {DEV} ({torch.cuda.get_device_name() if DEV.type == 'cuda' else 'interpreter'}): "
          f"D={s.D} E={s.E} k={s.k} I={s.I}", flush=True)
    with torch.inference_mode():
        ex = make_experts(s)
        if not args.tiles:
            check_act_quant(s)
            check_linear(s)
            check_moe(s, ex)
            check_graph(s, ex)
            check_fold(s, ex, replays=40 if DEV.type == "cuda" else 2)
            for T in s.decode + s.prefill:
                fig(f"moe_T{T}", time_moe(s, ex, T))
        few = 3 if args.smoke else None                # the smoke run: the sweeps' code, not their figures
        budget = float("inf") if args.smoke else args.budget_s
        sweep(s, ex, budget, s.decode, dict(list(SWEEP.items())[:few]))
        sweep(s, ex, budget, s.prefill, dict(list(PREFILL_SWEEP.items())[:few]))
        if not args.tiles:
            sweep_linear(s, budget, LINEAR_SWEEP[:few])
    fig("elapsed_s", round(time.time() - T0, 1))
    if args.out:
        Path(args.out).write_text(json.dumps(RES, indent=1))


if __name__ == "__main__":
    main()
