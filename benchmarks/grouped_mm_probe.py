"""Probe: the prefill experts on torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on sm_90) against the
engine's Triton fused MoE, Qwen3-30B-A3B shape, bf16, random routing (GPU host).

For T tokens: the engine's ``fused_experts`` (its plan for T) and, beside it, the grouped path in
its parts: the pairs sorted by expert (a stable sort: an expert's rows in token order), x's rows
gathered, gate_up as one grouped GEMM, silu(gate) * up, down as one grouped GEMM, the rows put back
in pair order (weighted) and the engine's ``moe_sum``. Prints each part's median time, the two
GEMMs' TFLOP/s, and the grouped output's distance from the engine's (both bf16 with float32
accumulation: a few bf16 ulps). A probe: nothing in the library uses the grouped path.

    python benchmarks/grouped_mm_probe.py --tokens 2048,4096,8192
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cuda_timing import median_ms  # noqa: E402

from ainfer_pd.engine.fused_moe import fused_experts, moe_sum  # noqa: E402
from ainfer_pd.engine.model.moe import route  # noqa: E402

D, E, K, I = 2048, 128, 8, 768


def grouped_parts(x, r, w13, w2):
    """The grouped path's steps as closures over one ``state`` dict (each timed alone), the whole, and the state."""
    (T, D), (E, I, K) = x.shape, (w13.shape[0], w2.shape[1], r.topk_idx.shape[1])
    flat = r.topk_idx.reshape(-1)
    state = {}

    def sort():
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        state["order"], state["offs"] = order, torch.cumsum(counts, 0).to(torch.int32)

    def gather():
        state["xs"] = x.index_select(0, state["order"] // K)

    def gate_up():
        state["h"] = torch._grouped_mm(state["xs"], w13, offs=state["offs"])

    def act():
        h = state["h"]
        state["a"] = F.silu(h[:, :I]) * h[:, I:]

    def down():
        state["y"] = torch._grouped_mm(state["a"], w2, offs=state["offs"])

    def put_back():
        rows = torch.empty(T * K, D, dtype=x.dtype, device=x.device)
        w = r.topk_weights.reshape(-1)[state["order"]].unsqueeze(1)
        rows[state["order"]] = (state["y"] * w).to(x.dtype)
        state["rows"] = rows

    def total():
        state["out"] = moe_sum(state["rows"], T, K)

    steps = {"sort": sort, "gather": gather, "gate_up": gate_up, "act": act, "down": down,
             "put_back": put_back, "sum": total}

    def whole():
        for f in steps.values():
            f()
        return state["out"]
    return steps, whole, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,4096,8192")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w13 = (torch.randn(E, D, 2 * I, device=dev) * D ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, I, D, device=dev) * I ** -0.5).to(torch.bfloat16)
    router = (torch.randn(E, D, device=dev) * D ** -0.5).to(torch.bfloat16)
    print(f"grouped-mm probe on {torch.cuda.get_device_name()}, torch {torch.__version__}: D={D} E={E} k={K} I={I}")
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, D, device=dev).to(torch.bfloat16)
        r = route(x, router, K)
        flops_gu, flops_dn = 2 * T * K * D * 2 * I, 2 * T * K * I * D
        engine = median_ms(lambda: fused_experts(x, r, w13, w2), rep=50)
        steps, whole, _ = grouped_parts(x, r, w13, w2)
        out = whole()
        ref = fused_experts(x, r, w13, w2)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        parts = {name: median_ms(f, rep=50) for name, f in steps.items()}
        grouped = median_ms(whole, rep=50)
        print(f"T {T}: engine fused_experts {engine:.4f} ms; grouped whole {grouped:.4f} ms "
              f"({grouped / engine:.3f}x the engine's); max |diff| / max |ref| {err:.2e}")
        print("   parts: " + ", ".join(f"{k} {v:.4f}" for k, v in parts.items()))
        print(f"   grouped gate_up {flops_gu / parts['gate_up'] / 1e9:.0f} TFLOP/s, "
              f"down {flops_dn / parts['down'] / 1e9:.0f} TFLOP/s")
        print(f"FIG grouped_mm_probe T={T} engine_ms={engine:.4f} grouped_ms={grouped:.4f} "
              f"gate_up_ms={parts['gate_up']:.4f} down_ms={parts['down']:.4f} rel_err={err:.2e}", flush=True)


if __name__ == "__main__":
    main()
