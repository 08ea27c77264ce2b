"""Blockwise-FP8 kernels (issue 37) on the Qwen3-30B-A3B shape: errors against the torch oracle,
timings against the HBM bound, and a decode tile sweep (one H200, < 120 s).

* ``act_quant``: :func:`per_token_group_quant` against ``fp8.quantize_token_groups`` (mismatching
  e4m3 bytes and scales: 0 expected, the GPU's native cast and IEEE division).
* ``err_moe_*`` / ``err_linear_*``: :func:`fused_experts_fp8` against ``experts_fp8_reference``
  (decode sizes with every plan of the table; 2048 tokens chunked by token) and
  :func:`fp8_linear` against ``fp8_linear_reference``: ||out - ref|| / ||ref|| and max |out - ref|;
  beside them the FP8 oracle's own distance to the bf16 torch path (the quantization's error).
* ``moe_T*``: fused_experts_fp8 and the bf16 ``fused_experts`` at T tokens (a CUDA graph of
  ``REPS`` calls on distinct routings for T <= 128, so the touched experts are not L2-resident;
  eager for prefill), median of CUDA-event timings, against the HBM bound of the touched
  experts' weights (1 byte per FP8 weight + its float32 block scales; 2 per bf16 weight) at
  4.8 TB/s, and a FLOP bound (H200 dense: 1979 TFLOP/s FP8, 989 bf16) for the roofline ratio.
* ``sweep_T*`` / ``sweep_linear_*``: a few fused-MoE plans at the decode sizes (graph-timed) and
  the prefill sizes, and dense-GEMM plans at one row (graph-timed); the best is printed (the plan table in
  ``engine/quant/fp8_plan.py`` holds untuned guesses until this is read). The sweeps stop past
  ``--budget-s``.

Every figure is a ``FIG name = json`` line.

    python benchmarks/fp8_kernel_check.py [--budget-s 100] [--out fp8.json]
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
from ainfer_pd.engine.model.moe import Routing, experts_local, route  # noqa: E402
from ainfer_pd.engine.quant import fp8  # noqa: E402
from ainfer_pd.engine.quant.fp8_ops import fp8_linear, fused_experts_fp8, per_token_group_quant  # noqa: E402
from ainfer_pd.engine.quant.fp8_plan import fp8_moe_plan  # noqa: E402

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
SMOKE = Shape(256, 8, 2, 192, (1, 4), (24,), (1, 5), ((320, 256), (256, 200)), 2, 1)
SWEEP = {   # name -> plan: (block_m, block_n, block_k, group_m, num_warps, num_stages) for gate_up, down
    "table": None,
    "n32": MoEPlan(GemmPlan(16, 32, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4)),
    "n64_k64": MoEPlan(GemmPlan(16, 64, 64, 1, 4, 5), GemmPlan(16, 64, 64, 1, 4, 5)),
    "fused_n128": MoEPlan(GemmPlan(16, 128, 128, 1, 4, 3), GemmPlan(16, 128, 128, 1, 4, 3)),
    "m32": MoEPlan(GemmPlan(32, 64, 128, 4, 4, 3), GemmPlan(32, 128, 128, 4, 4, 3)),
    "w8": MoEPlan(GemmPlan(16, 64, 128, 1, 8, 4), GemmPlan(16, 128, 128, 1, 8, 4)),
    "medium": MoEPlan(GemmPlan(64, 128, 128, 8, 4, 3), GemmPlan(64, 128, 128, 8, 4, 3)),
}


PREFILL_SWEEP = {
    "table": None,
    "m64_w8": MoEPlan(GemmPlan(64, 128, 128, 8, 8, 3), GemmPlan(64, 128, 128, 8, 4, 4)),
    "m128_k64": MoEPlan(GemmPlan(128, 128, 64, 8, 8, 4), GemmPlan(128, 128, 64, 8, 8, 4)),
    "m128_n64": MoEPlan(GemmPlan(128, 64, 128, 8, 4, 3), GemmPlan(128, 128, 128, 8, 8, 3)),
}
LINEAR_SWEEP = (GemmPlan(16, 32, 128, 1, 4, 4), GemmPlan(16, 64, 128, 1, 4, 4), GemmPlan(16, 128, 128, 1, 4, 3),
                GemmPlan(16, 64, 64, 1, 4, 6))


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
    if DEV.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


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
def check_act_quant(s: Shape) -> None:
    """Bytes and scales against the oracle: bf16 activations, and groups of amax 448 (scale 1)
    holding every e4m3 value, every midpoint and its float32 neighbours (the cast's rounding itself)."""
    x = torch.randn(2048 if DEV.type == "cuda" else 33, s.D, device=DEV).to(BF16) * 3
    vals = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    grid = torch.cat([vals, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])    # a cast through fp16 rounds twice
    grid = torch.cat([grid, torch.zeros(-len(grid) % 127)]).view(-1, 127)
    grid = torch.cat([torch.full((grid.shape[0], 1), 448.0), grid], dim=1).to(DEV)
    out = {}
    for name, t in (("bf16_random", x), ("fp32_e4m3_midpoints", grid)):
        q, sc = per_token_group_quant(t)
        rq, rs = fp8.quantize_token_groups(t)
        out[name] = {"byte_mismatches": int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()),
                     "scale_mismatches": int((sc != rs).sum()), "elements": t.numel()}
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
                                       "quant_rel_vs_bf16": rel_err(ref, torch.nn.functional.linear(x, w))}
        for M in (1, 2048 if DEV.type == "cuda" else 9):
            x = torch.randn(M, K, device=DEV).to(BF16)
            t8 = median_ms(lambda: fp8_linear(x, wq, ws), s.iters)
            tb = median_ms(lambda: torch.nn.functional.linear(x, w), s.iters)
            bound = (N * K + 4 * ws.numel()) / HBM_BW * 1e3
            rows[f"N{N}_K{K}_M{M}_time"] = {"fp8_ms": round(t8, 4), "bf16_torch_ms": round(tb, 4),
                                            "fp8_hbm_bound_ms": round(bound, 4), "fp8_ratio": round(t8 / bound, 2)}
    fig("err_linear", rows)


def check_moe(s: Shape, ex: Experts) -> None:
    """Every plan of the table at the decode sizes, the table's own at a prefill size."""
    plans = {"small": fp8_moe_plan(1, s.E), "medium": fp8_moe_plan(32 * s.E, s.E), "large": fp8_moe_plan(1 << 30, s.E)}
    rows = {}
    for T in s.err_T + s.prefill[:1]:
        x, r = tokens(s, ex, T, seed=T)
        ref = reference(x, r, ex)
        rows[f"T{T}_quant_rel_vs_bf16"] = rel_err(ref, experts_local(x, r, ex.w13, ex.w2))
        for name, plan in (plans.items() if T in s.err_T else [("table", None)]):
            out = fused_experts_fp8(x, r, *ex.fp8, plan=plan)
            rows[f"T{T}_{name}"] = {"rel": rel_err(out, ref), "max": max_err(out, ref)}
    fig("err_moe", rows)


def check_graph(s: Shape, ex: Experts) -> None:
    """fused_experts_fp8 captured in a CUDA graph (no host sync) gives the eager result, bit for bit."""
    x, r = tokens(s, ex, s.decode[-1], seed=7)
    eager = fused_experts_fp8(x, r, *ex.fp8)
    box = {}
    replay = graphed(lambda: box.__setitem__("out", fused_experts_fp8(x, r, *ex.fp8)))
    replay()
    fig("graph_equals_eager", bool(torch.equal(box["out"], eager)))


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
            plan = plans[best] or fp8_moe_plan(T * s.k, s.E)
            fig(f"sweep_T{T}", {"best": best, "best_plan": [_plan_tuple(plan.gate_up), _plan_tuple(plan.down)],
                                "ms": rows[best], "hbm_bound_ms": round(hbm, 4), "ratio": round(rows[best] / hbm, 2),
                                "all_ms": rows})


def sweep_linear(s: Shape, budget: float, plans: tuple[GemmPlan, ...]) -> None:
    """A few dense-GEMM plans for one decode row (x quantization included), the best per layer."""
    for N, K in s.linears:
        w = (torch.randn(N, K, device=DEV) * K ** -0.5).to(BF16)
        wq, ws = fp8.quantize_blockwise(w)
        x = torch.randn(1, K, device=DEV).to(BF16)
        rows = {}
        for plan in plans:
            if over_budget(budget):
                break
            run = graphed(lambda: fp8_linear(x, wq, ws, plan=plan))
            rows[str(_plan_tuple(plan))] = round(median_ms(run, s.iters), 4)
        if rows:
            best = min(rows, key=rows.get)
            bound = (N * K + 4 * ws.numel()) / HBM_BW * 1e3
            fig(f"sweep_linear_N{N}_K{K}_M1", {"best_plan": json.loads(best), "ms": rows[best],
                                               "hbm_bound_ms": round(bound, 4), "ratio": round(rows[best] / bound, 2),
                                               "all_ms": rows})


def _plan_tuple(g: GemmPlan) -> list[int]:
    return [g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages]


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--budget-s", type=float, default=100.0, help="the sweep stops past this many seconds")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    DEV = torch.device("cpu" if args.smoke else "cuda")
    s = SMOKE if args.smoke else FULL
    print(f"fp8 kernel check on {DEV} ({torch.cuda.get_device_name() if DEV.type == 'cuda' else 'interpreter'}): "
          f"D={s.D} E={s.E} k={s.k} I={s.I}", flush=True)
    with torch.inference_mode():
        ex = make_experts(s)
        check_act_quant(s)
        check_linear(s)
        check_moe(s, ex)
        check_graph(s, ex)
        for T in s.decode + s.prefill:
            fig(f"moe_T{T}", time_moe(s, ex, T))
        few = 2 if args.smoke else None                # the smoke run: the sweeps' code, not their figures
        sweep(s, ex, args.budget_s, s.decode, dict(list(SWEEP.items())[:few]))
        sweep(s, ex, args.budget_s, s.prefill, dict(list(PREFILL_SWEEP.items())[:few]))
        sweep_linear(s, args.budget_s, LINEAR_SWEEP[:few])
    fig("elapsed_s", round(time.time() - T0, 1))
    if args.out:
        Path(args.out).write_text(json.dumps(RES, indent=1))


if __name__ == "__main__":
    main()
