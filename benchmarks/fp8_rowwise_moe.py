"""Candidate, not in the engine: the FP8 fused MoE with one scale per row (x and act per token, each
weight row per output channel) against the engine's blockwise one (1 x 128 / 128 x 128 scales).

Why: the blockwise kernel scales each 128-wide K step's product before adding it (the scales change
with K), so every K step waits on its MMA and the tensor cores idle through the scaling
(``engine/quant/fp8_kernels.py``). At the FP8 prefill sizes it ran at ~38% of the FP8 rate while the
bf16 kernel ran at ~62% of bf16's (H100, the gate's 4K profile: FP8 gate_up 359 against bf16 430 us a
layer). With scales that do not change along K the K loop is a plain ``acc = dot(a, b, acc)``, which
Triton pipelines on Hopper as it does bf16, and the scales apply once, in the epilogue. Compiled for
sm_90 (``tests/test_fp8_rowwise_candidate.py``), the blockwise loop waits for every MMA each K step
(``wgmma.wait_group 0``), and the candidate's loops keep one MMA group a dot in flight. e4m3 is a
floating-point format, so a row scale loses range, not relative precision, where a block's amax is
below its row's. The script reports both kernels' distance to the bf16 experts, to show what that
costs. Weights quantized at load or at weight sync (verl's flow) can be quantized per row directly. A
blockwise checkpoint would be re-quantized once, rounding a second time.

    python benchmarks/fp8_rowwise_moe.py [--tokens 64,128,2048,4096,8192] [--budget-s 80]

Prints FIG lines: per T, the engine's blockwise fused MoE, the bf16 fused MoE and each rowwise tile
(ms, the whole call with its quantization and layout launches), the best rowwise's gate_up and down
alone, both FP8 paths' relative error against the bf16 experts, and the same MoE on torch's grouped
rowwise FP8 GEMM (``torch._scaled_grouped_mm``, CUTLASS on sm_90; its GEMMs alone too): what a
library GEMM reaches on this format.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ainfer_pd.engine.fused_moe import align_blocks_triton, layout_rows, moe_sum  # noqa: E402
from ainfer_pd.engine.fused_moe.kernels import _expert_block  # noqa: E402
from ainfer_pd.engine.model.moe import Routing  # noqa: E402
from ainfer_pd.engine.quant.fp8 import FP8  # noqa: E402
from ainfer_pd.engine.quant.fp8_kernels import _quant_tile  # noqa: E402

FP8_MAX = 448.0
# (block_m, block_n, block_k, group_m, warps, stages[, swap]), one for both GEMMs (they walk the same row
# blocks); swap: the products transposed, the weight tile on wgmma's M side (the engine's decode plans')
TILES = ((64, 64, 128, 8, 4, 3), (64, 128, 128, 8, 4, 3), (64, 128, 128, 8, 4, 4), (128, 64, 128, 8, 8, 3),
         (128, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 4))
DECODE_TILES = ((16, 64, 128, 1, 4, 4, True), (16, 128, 128, 1, 4, 4, True), (32, 64, 128, 1, 4, 4, True))
DECODE_MAX_TOKENS = 128


def _exact() -> bool:
    """The interpreter's float -> e4m3 cast is wrong (``fp8_kernels``' docstring): round on the grid first."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def row_quant_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    """One row of x [R, K] -> q [R, K] float8 and s [R] float32 (one scale for the whole row)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    v = tl.load(X + r * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    q, s = _quant_tile(v[None, :], EXACT)
    tl.store(Q + r * stride_q + cols[None, :], q, mask=m[None, :])
    tl.store(S + r + tl.arange(0, 1), s)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (q [R, K] float8 e4m3, s [R] float32) on x's device, one launch."""
    R, K = x.shape
    q = torch.empty(R, K, dtype=FP8, device=x.device)
    s = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        row_quant_kernel[(R,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(K), EXACT=_exact(),
                               num_warps=4)
    return q, s


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of :func:`quantize_rows` (and the weights' quantization): per row of the last dim,
    scale = max(amax / 448, 1e-12), q = clamp(x / scale) rounded to e4m3."""
    x = x.float()
    s = torch.clamp(x.abs().amax(dim=-1) / FP8_MAX, min=1e-12)
    return torch.clamp(x / s.unsqueeze(-1), -FP8_MAX, FP8_MAX).to(FP8), s


@triton.jit
def _plain_dot(a_ptr, b_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SWAP_AB: tl.constexpr):
    """sum over K steps of a [BLOCK_M, BLOCK_K] . b, no scales: ``a_ptr`` [BLOCK_M, BLOCK_K] pointers;
    ``b_ptr`` [BLOCK_K, BLOCK_N], or with SWAP_AB [BLOCK_N, BLOCK_K] (the product computed transposed,
    the weight tile the MMA's M side: a 16-row block still takes e4m3 wgmma) -> [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(b_ptr + k0), tl.trans(tl.load(a_ptr + k0)), acc)
        out = tl.trans(acc)
    else:
        out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            out = tl.dot(tl.load(a_ptr + k0), tl.load(b_ptr + k0), out)
    return out


@triton.jit
def _plain_dot_pair(a_ptr, g_ptr, u_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr):
    """:func:`_plain_dot` against two weight tiles (``g_ptr``'s and ``u_ptr``'s), each A tile loaded once
    for both -> (acc_g, acc_u) [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            at = tl.trans(tl.load(a_ptr + k0))
            acc_g = tl.dot(tl.load(g_ptr + k0), at, acc_g)
            acc_u = tl.dot(tl.load(u_ptr + k0), at, acc_u)
        out_g, out_u = tl.trans(acc_g), tl.trans(acc_u)
    else:
        out_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        out_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + k0)
            out_g = tl.dot(a, tl.load(g_ptr + k0), out_g)
            out_u = tl.dot(a, tl.load(u_ptr + k0), out_u)
    return out_g, out_u


@triton.jit
def _w_tile(w_rows, offs_k, SWAP_AB: tl.constexpr):
    """The weight tile's pointers at K step 0 from its rows' first elements ``w_rows`` [BLOCK_N]."""
    if SWAP_AB:
        p = w_rows[:, None] + offs_k[None, :]
    else:
        p = w_rows[None, :] + offs_k[:, None]
    return p


@triton.jit(do_not_specialize=["num_pairs", "P"])
def rowwise_gate_up_kernel(SORTED, BLOCK_EXPERT, NUM_POST, XQ, XS, W, WS, ACT, num_pairs, P, K, I,
                           stride_xt, stride_we, stride_wn, stride_wse, stride_an,
                           TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """act[pair, n] = silu(g) * u, g / u = (x_q[tok] . W_q[e, n] / W_q[e, I + n]) * s_x[tok] * s_w[e, row]:
    a plain K loop (K % BLOCK_K == 0), the scales in the epilogue. Padding rows read token 0 and
    columns past I wrap (neither is stored)."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    tok = (tl.where(rmask, pairs, 0) // TOPK).to(tl.int64)
    cols = (offs_n % I).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = XQ + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptr = _w_tile(W + e * stride_we + cols * stride_wn, offs_k, SWAP_AB)
    acc_g, acc_u = _plain_dot_pair(a_ptr, g_ptr, g_ptr + I * stride_wn, K, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
    sx = tl.load(XS + tok)
    ws = WS + e * stride_wse + cols
    g = acc_g * sx[:, None] * tl.load(ws)[None, :]
    u = acc_u * sx[:, None] * tl.load(ws + I)[None, :]
    act = g * tl.sigmoid(g) * u
    prow = pairs.to(tl.int64)
    tl.store(ACT + prow[:, None] * stride_an + offs_n[None, :], act.to(ACT.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "P"])
def rowwise_down_kernel(SORTED, BLOCK_EXPERT, NUM_POST, AQ, AS, W, WS, TOPW, ROWS, num_pairs, P, K, N,
                        stride_an, stride_we, stride_wn, stride_wse, stride_rn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        SWAP_AB: tl.constexpr = False):
    """rows[pair, n] = topw[pair] * (act_q[pair] . W_q[e, n]) * s_act[pair] * s_w[e, n], a plain K loop."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, N,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    arow = tl.where(rmask, pairs, 0).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = AQ + arow[:, None] * stride_an + offs_k[None, :]
    acc = _plain_dot(a_ptr, _w_tile(W + e * stride_we + cols * stride_wn, offs_k, SWAP_AB), K, BLOCK_M, BLOCK_N,
                     BLOCK_K, SWAP_AB)
    s = tl.load(AS + arow) * tl.load(TOPW + arow).to(tl.float32)
    out = acc * s[:, None] * tl.load(WS + e * stride_wse + cols)[None, :]
    prow = pairs.to(tl.int64)
    tl.store(ROWS + prow[:, None] * stride_rn + offs_n[None, :], out.to(ROWS.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def _launch(kernel, layout, tile, ncols: int, args: tuple, **meta) -> None:
    bm, bn, bk, gm, warps, stages = tile[:6]
    P = layout_rows(layout, bm, False)
    kernel[(triton.cdiv(P, bm) * triton.cdiv(ncols, bn),)](*layout, *args[:-1], P, *args[-1], BLOCK_M=bm,
                                                            BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                                                            SWAP_AB=len(tile) > 6 and bool(tile[6]),
                                                            num_warps=warps, num_stages=stages, **meta)


def rowwise_parts(x: torch.Tensor, r: Routing, w13q, w13s, w2q, w2s, tile):
    """The rowwise fused MoE's launches as closures over shared buffers, in order: (x quantization,
    layout, gate_up, act quantization, down, sum) -> (list of callables, the output box)."""
    T, D = x.shape
    k = r.topk_idx.shape[1]
    N, I = T * k, w13q.shape[1] // 2
    assert D % tile[2] == 0 and I % tile[2] == 0, "the candidate's K loop takes whole K steps"
    box = {"act": torch.empty(N, I, dtype=torch.float32, device=x.device),
           "rows": torch.empty(N, D, dtype=x.dtype, device=x.device),
           "topw": r.topk_weights.reshape(-1).contiguous()}

    def xquant():
        box["xq"], box["xs"] = quantize_rows(x)

    def layout():
        box["layout"] = align_blocks_triton(r, tile[0])

    def gate_up():
        act, xq = box["act"], box["xq"]
        _launch(rowwise_gate_up_kernel, box["layout"], tile, I,
                (xq, box["xs"], w13q, w13s, act, N,
                 (D, I, xq.stride(0), w13q.stride(0), w13q.stride(1), w13s.stride(0), act.stride(0))), TOPK=k)

    def aquant():
        box["aq"], box["as"] = quantize_rows(box["act"])

    def down():
        aq, rows = box["aq"], box["rows"]
        _launch(rowwise_down_kernel, box["layout"], tile, D,
                (aq, box["as"], w2q, w2s, box["topw"], rows, N,
                 (I, D, aq.stride(0), w2q.stride(0), w2q.stride(1), w2s.stride(0), rows.stride(0))))

    def total():
        box["out"] = moe_sum(box["rows"], T, k)
    return [xquant, layout, gate_up, aquant, down, total], box


def fused_experts_rowwise(x, r: Routing, w13q, w13s, w2q, w2s, tile=TILES[0]) -> torch.Tensor:
    """Routed experts with per-row FP8 scales: x [T, D]; w13q [E, 2I, D] float8 + w13s [E, 2I]; w2q
    [E, D, I] float8 + w2s [E, D] -> [T, D] in x's dtype. act stays float32 until its quantization, as the
    engine's blockwise path keeps it (rounded to bf16 first, e4m3's rounding moves ~2% of its bytes)."""
    parts, box = rowwise_parts(x, r, w13q, w13s, w2q, w2s, tile)
    for p in parts:
        p()
    return box["out"]


def grouped_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, offs: torch.Tensor):
    """torch's grouped rowwise FP8 GEMM (CUTLASS on sm_90): a [M, K] float8 rows sorted by expert, sa [M];
    w [E, N, K] float8 (read column-major: its transpose), ws [E, N]; offs [E] int32 each expert's end
    row -> [M, N] bf16."""
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), sa, ws, offs=offs, out_dtype=torch.bfloat16)


def grouped_parts(x, r: Routing, w13q, w13s, w2q, w2s):
    """The same MoE on :func:`grouped_gemm` (the layout by a torch sort, the gathers, act and the
    scatter by torch ops): a bound on what the rowwise format's GEMMs can run at, not a kernel to
    ship. -> (callables in order, box); parts 2 and 4 are the two GEMMs."""
    T, D = x.shape
    k = r.topk_idx.shape[1]
    N, E, I = T * k, w13q.shape[0], w13q.shape[1] // 2
    flat = r.topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    tok = order // k
    topw = r.topk_weights.reshape(-1)[order].float()[:, None]
    box = {}

    def xquant():
        box["xq"], box["xs"] = quantize_rows(x)

    def gather():
        box["a"], box["sa"] = box["xq"].view(torch.uint8)[tok].view(FP8), box["xs"][tok]

    def gate_up():
        box["h"] = grouped_gemm(box["a"], box["sa"], w13q, w13s, offs)

    def act():
        h = box["h"].float()
        box["aq"], box["as"] = quantize_rows(torch.nn.functional.silu(h[:, :I]) * h[:, I:])

    def down():
        box["y"] = grouped_gemm(box["aq"], box["as"], w2q, w2s, offs)

    def total():
        rows = torch.empty(N, D, dtype=x.dtype, device=x.device)
        rows[order] = (box["y"].float() * topw).to(x.dtype)
        box["out"] = moe_sum(rows, T, k)
    return [xquant, gather, gate_up, act, down, total], box


def rowwise_reference(x, r: Routing, w13q, w13s, w2q, w2s) -> torch.Tensor:
    """The candidate's oracle in float32 torch: the same quantization, dequantized products."""
    T, D = x.shape
    k = r.topk_idx.shape[1]
    I = w13q.shape[1] // 2
    xq, xs = quantize_rows_torch(x)
    xd = xq.float() * xs[:, None]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    flat, tw = r.topk_idx.reshape(-1), r.topk_weights.reshape(-1).float()
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().flatten()
        tok = pairs // k
        h = xd[tok] @ (w13q[e].float() * w13s[e][:, None]).t()
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        aq, as_ = quantize_rows_torch(act)
        y = (aq.float() * as_[:, None]) @ (w2q[e].float() * w2s[e][:, None]).t()
        out.index_add_(0, tok, y * tw[pairs][:, None])
    return out.to(x.dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run(tokens, dev: torch.device, ms, shape=(128, 2048, 768, 8), dtype=torch.bfloat16, budget_s: float = 80.0,
        tiles=None) -> dict:
    """The figures of :func:`main` (module docstring) at each T of ``tokens``; ``ms(fn)`` times a call.
    ``shape`` (E, D, I, k): the Qwen3-30B-A3B expert shape by default; ``tiles``: the rowwise tiles
    tried (default: :data:`DECODE_TILES` up to :data:`DECODE_MAX_TOKENS` tokens, else :data:`TILES`)."""
    from ainfer_pd.engine.fused_moe import fused_experts
    from ainfer_pd.engine.model.moe import route
    from ainfer_pd.engine.quant.fp8 import quantize_blockwise, quantize_w13
    from ainfer_pd.engine.quant.fp8_ops import fused_experts_fp8
    t0 = time.time()
    E, D, I, k = shape
    g = torch.Generator(device=dev).manual_seed(0)
    gate, up = (torch.randn(E, I, D, device=dev, generator=g) * D ** -0.5 for _ in range(2))
    w2f = torch.randn(E, D, I, device=dev, generator=g) * I ** -0.5
    w13b, w13bs = quantize_w13(gate, up)
    w2b, w2bs = quantize_blockwise(w2f)
    w13r, w13rs = quantize_rows_torch(torch.cat([gate, up], dim=1))
    w2r, w2rs = quantize_rows_torch(w2f)
    w13_16 = torch.cat([gate, up], dim=1).transpose(1, 2).contiguous().to(dtype)     # [E, D, 2I]
    w2_16 = w2f.transpose(1, 2).contiguous().to(dtype)                                 # [E, I, D]
    del gate, up, w2f
    router = torch.randn(E, D, device=dev, generator=g).to(dtype)
    res = {}
    for T in tokens:
        if time.time() - t0 > budget_s:
            print(f"budget spent: T {T} not run", flush=True)
            break
        x = torch.randn(T, D, device=dev, generator=g).to(dtype)
        r = route(x, router, k)
        exact = fused_experts(x, r, w13_16, w2_16)
        blockwise = fused_experts_fp8(x, r, w13b, w13bs, w2b, w2bs)
        row = {"bf16_ms": round(ms(lambda: fused_experts(x, r, w13_16, w2_16)), 4),
               "blockwise_ms": round(ms(lambda: fused_experts_fp8(x, r, w13b, w13bs, w2b, w2bs)), 4),
               "blockwise_rel_err_vs_bf16": round(_rel(blockwise, exact), 5)}
        best = None
        for tile in (tiles if tiles is not None else DECODE_TILES if T <= DECODE_MAX_TOKENS else TILES):
            if time.time() - t0 > budget_s:
                break
            try:
                out = fused_experts_rowwise(x, r, w13r, w13rs, w2r, w2rs, tile)
                t = ms(lambda: fused_experts_rowwise(x, r, w13r, w13rs, w2r, w2rs, tile))
            except Exception as e:       # a tile that does not fit (shared memory, registers): said, not fatal
                row[f"rowwise_{tile}"] = f"{type(e).__name__}: {str(e)[:80]}"
                continue
            row[f"rowwise_{tile}_ms"] = round(t, 4)
            if best is None or t < best[1]:
                best = (tile, t, out)
        if best is not None:
            tile, t, out = best
            parts, _ = rowwise_parts(x, r, w13r, w13rs, w2r, w2rs, tile)
            for p in parts:
                p()
            oracle = rowwise_reference(x, r, w13r, w13rs, w2r, w2rs)
            row.update({"rowwise_best_tile": list(tile), "rowwise_best_ms": round(t, 4),
                        "rowwise_gate_up_ms": round(ms(parts[2]), 4), "rowwise_down_ms": round(ms(parts[4]), 4),
                        "rowwise_rel_err_vs_bf16": round(_rel(out, exact), 5),
                        "rowwise_rel_err_vs_oracle": round(_rel(out, oracle), 5),
                        "blockwise_over_rowwise": round(row["blockwise_ms"] / max(t, 1e-9), 3)})
        if x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and time.time() - t0 <= budget_s:
            try:
                parts, box = grouped_parts(x, r, w13r, w13rs, w2r, w2rs)
                for p in parts:
                    p()

                def whole():
                    for p in parts:
                        p()
                row.update({"grouped_ms": round(ms(whole), 4), "grouped_gate_up_ms": round(ms(parts[2]), 4),
                            "grouped_down_ms": round(ms(parts[4]), 4),
                            "grouped_rel_err_vs_bf16": round(_rel(box["out"], exact), 5)})
            except Exception as e:       # torch's grouped rowwise GEMM refused here: said, not fatal
                row["grouped"] = f"{type(e).__name__}: {str(e)[:120]}"
        res[T] = row
        print(f"FIG rowwise_moe_T{T} = {json.dumps(row)}", flush=True)
    return res


def main() -> None:
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,128,2048,4096,8192")
    ap.add_argument("--budget-s", type=float, default=80.0)
    args = ap.parse_args()
    t0 = time.time()
    print(f"rowwise FP8 MoE candidate: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)

    def ms(fn):
        return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
    run([int(t) for t in args.tokens.split(",")], torch.device("cuda"), ms, budget_s=args.budget_s)
    print(f"FIG elapsed_s = {time.time() - t0:.1f}", flush=True)


if __name__ == "__main__":
    main()
