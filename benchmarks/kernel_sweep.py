"""Tile-configuration sweep of the Triton kernels on the Qwen3-30B-A3B shape (GPU host).

Times each candidate configuration of the paged decode attention, the varlen paged prefill
attention and the two fused-MoE GEMMs (decode-, medium- and prefill-sized row counts) against
its byte or FLOP bound, and prints the best per case. The chosen defaults live in
``engine/attention/plan.py`` and ``engine/fused_moe/plan.py``; docs/RESULTS.md records the run.

    python benchmarks/kernel_sweep.py --budget-s 240 --out sweep.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cuda_timing import median_ms as ms  # noqa: E402
from _gate_cases import paged_case, uniform_decode  # noqa: E402

from ainfer_pd.engine.attention.plan import PrefillPlan  # noqa: E402
from ainfer_pd.engine.attention.triton_backend import TritonAttention  # noqa: E402
from ainfer_pd.engine.attention.triton_prefill_tma import prefill_tma  # noqa: E402
from ainfer_pd.engine.fused_moe import GemmPlan, align_blocks, launch_down, launch_gate_up  # noqa: E402
from ainfer_pd.engine.model.moe import route  # noqa: E402

DEV = torch.device("cuda")
H, Hk, hd, D, E, K, I = 32, 4, 128, 2048, 128, 8, 768
T0 = time.time()
RES: dict = {}


def over(budget: float) -> bool:
    return time.time() - T0 > budget


def sweep(name: str, cands, run, bound_ms: float, budget: float) -> None:
    rows = []
    for c in cands:
        if over(budget):
            print(f"  {name}: budget reached", flush=True)
            break
        try:
            t = run(c)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {name} {c}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
            continue
        rows.append((t, c))
        print(f"  {name} {c}: {t:.4f} ms ({t / bound_ms:.2f}x bound)", flush=True)
    rows.sort(key=lambda r: r[0])
    if rows:
        t, c = rows[0]
        print(f"BEST {name}: {c} {t:.4f} ms = {t / bound_ms:.2f}x bound {bound_ms:.4f} ms", flush=True)
        RES[name] = {"best": list(c) if isinstance(c, tuple) else c, "ms": t, "bound_ms": bound_ms,
                     "all": [[list(cc), tt] for tt, cc in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="moe64,moe128,moe512,moe4096,decode,prefill",
                    help="comma list among moe64, moe128, moe512, moe2048, moe4096, moe8192, moe16384, moedirect, "
                         "moetma2048, moetma4096, moetma8192, decode, prefill, prefilltma, prefilltmac")
    args = ap.parse_args()
    sections = args.sections.split(",")            # whole names: "prefill" is not "prefilltma"
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (ms(lambda: y.copy_(x)) / 1e3)
    del x, y
    print(f"HBM copy {bw / 1e12:.2f} TB/s", flush=True)
    dt = torch.bfloat16
    bud = args.budget_s

    # ---- fused MoE, decode-sized (B = 64 tokens, 8 pairs each)
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(E, D, 2 * I, device=DEV, generator=g) * 0.02).to(dt)
    w2 = (torch.randn(E, I, D, device=DEV, generator=g) * 0.02).to(dt)
    rw = (torch.randn(E, D, device=DEV, generator=g) * 0.02).to(dt)
    small = [(16, 64, 128, 1, 4, 3), (16, 64, 128, 1, 4, 4), (16, 32, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3),
             (16, 128, 128, 1, 4, 3), (16, 64, 64, 1, 4, 5), (16, 32, 256, 1, 4, 4), (16, 128, 64, 1, 8, 4),
             (16, 64, 128, 1, 8, 4)]
    large = [(128, 128, 32, 8, 8, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 128, 8, 8, 3),
             (128, 128, 32, 16, 8, 4), (128, 128, 32, 8, 8, 5), (128, 128, 64, 16, 8, 3), (128, 256, 64, 8, 8, 3),
             (128, 128, 128, 8, 8, 3), (128, 64, 64, 8, 4, 4)]
    # 64-row blocks for prefill: an expert's rows are padded to a multiple of block_m, which with the
    # Qwen3 shape's random routing costs 1.46 / 1.24 / 1.13x the pairs at 128 rows against 1.23 / 1.12 /
    # 1.06x at 64 (2K / 4K / 8K tokens: 128 / 256 / 512 rows an expert on average). Tiles whose gate_up
    # compiles for sm_90 without spills or with a few bytes (`kernel_ptx_report.compile_stats`, the runtime's
    # stride hints); 4-warp 64 x 128 tiles spill 150-4,600 bytes in gate_up's two accumulators
    large_64 = [(64, 128, 64, 8, 8, 3), (64, 128, 64, 8, 8, 4), (64, 128, 32, 8, 8, 4), (64, 256, 64, 8, 8, 3),
                (64, 64, 64, 8, 4, 3), (64, 64, 64, 8, 4, 4)]
    medium = [(32, 64, 128, 4, 4, 3), (32, 128, 64, 4, 4, 3), (64, 64, 64, 8, 4, 3), (32, 64, 64, 4, 4, 4),
              (16, 64, 128, 1, 4, 4), (64, 128, 64, 8, 4, 3)]
    # moetma{T}: gate_up's pointer tiles against the same tiles with the weights through TMA descriptors
    # (engine/fused_moe/kernels_tma.py; the prefill plan's at 128 x 128 x 64, 8 warps, 4 stages), ("tma",
    # block_m, block_n, block_k, group_m, warps, stages); down through descriptors was no faster at any tile
    # (docs/results/kernels/tma_candidates_sweep_ee81de8_h100.txt), its pointer tiles only
    tma = [(128, 128, 32, 8, 8, 4), (128, 128, 64, 8, 8, 3), ("tma", 128, 128, 32, 8, 8, 4),
           ("tma", 128, 128, 64, 8, 8, 3), ("tma", 128, 128, 64, 8, 8, 4), ("tma", 64, 128, 64, 8, 8, 4),
           ("tma", 64, 128, 64, 8, 4, 4)]
    moe_cases = [(f"moe{T}", T, c) for T, c in ((64, small), (128, small), (512, medium), (2048, large + large_64),
                                                (4096, large + large_64), (8192, large + large_64), (16384, large))]
    # (half-block layouts, an expert's last block a 64-row tile, were swept at f20a8d9 and not taken: docs/history.md)
    moe_cases = [(n, T, c) for n, T, c in moe_cases + [(f"moetma{T}", T, tma) for T in (2048, 4096, 8192)]
                 if n in sections]
    if any(n.startswith("moetma") for n, _, _ in moe_cases):
        from ainfer_pd.engine.fused_moe.kernels_tma import launch_gate_up_tma
    for sec, T, cands in moe_cases:
        xx = torch.randn(T, D, device=DEV, dtype=dt)
        r = route(xx, rw, K)
        touched = int((r.counts > 0).sum())
        N = T * K
        flops = 2 * N * D * 2 * I
        wb1, wb2 = touched * D * 2 * I * 2, touched * I * D * 2
        act = torch.empty(N, I, device=DEV, dtype=dt)
        rows = torch.empty(N, D, device=DEV, dtype=dt)
        topw = r.topk_weights.reshape(-1).contiguous()
        lay = {}

        def layout(bm):
            if bm not in lay:
                lay[bm] = align_blocks(r, bm)
            return lay[bm]
        b1 = max(wb1 / bw, flops / 800e12) * 1e3
        b2 = max(wb2 / bw, flops / 2 / 800e12) * 1e3
        def gate_up(c):
            if c[0] == "tma":
                return ms(lambda: launch_gate_up_tma(xx, w13, act, layout(c[1]), K, GemmPlan(*c[1:])))
            return ms(lambda: launch_gate_up(xx, w13, act, layout(c[0]), K, GemmPlan(*c)))

        def down(c):
            return ms(lambda: launch_down(act, w2, rows, layout(c[0]), topw, GemmPlan(*c)))
        tag = "_tma" if sec.startswith("moetma") else ""
        sweep(f"moe{tag}_gate_up_T{T}", cands, gate_up, b1, bud)
        sweep(f"moe{tag}_down_T{T}", [c for c in cands if c[0] != "tma"], down, b2, bud)

    # ---- fused MoE at a handful of tokens (the rollout's tail): the aligned layout against a direct plan
    # (each pair its own row block: no align / scatter launch), whole fused_experts calls in a CUDA graph
    if "moedirect" in sections:
        from _cuda_timing import graph_of
        from ainfer_pd.engine.fused_moe import MoEPlan, fused_experts, moe_plan
        for T in (1, 2, 4, 8):
            xx = torch.randn(T, D, device=DEV, dtype=dt)
            r = route(xx, rw, K)
            aligned = moe_plan(T * K, E, False)
            direct = MoEPlan(aligned.gate_up, aligned.down, direct=True)
            wb = int((r.counts > 0).sum()) * 3 * D * I * 2
            res = {}
            for name, plan in (("aligned", aligned), ("direct", direct)):
                g = graph_of(lambda: fused_experts(xx, r, w13, w2, plan))
                res[name] = ms(g.replay)
            print(f"moe T={T}: aligned {res['aligned'] * 1e3:.1f} us, direct {res['direct'] * 1e3:.1f} us "
                  f"({res['direct'] / res['aligned']:.3f}x), weight bytes bound {wb / bw * 1e6:.1f} us", flush=True)
            RES[f"moe_direct_T{T}"] = {**{k: round(v, 5) for k, v in res.items()}, "bound_ms": wb / bw * 1e3,
                                       "direct_over_aligned": round(res["direct"] / res["aligned"], 3)}

    # ---- paged decode attention
    # one split_keys serves every batch (a row's splits never depend on its batch): B 1 is the rollout's
    # tail (a long chain decoding alone: 17.5 us a layer of attention against a 1 us bound)
    for B, L in ((32, 2048), (1, 2048), (64, 2048), (128, 2048), (16, 5000), (64, 4096)) if "decode" in sections \
            else ():
        fb, q, kc, vc = uniform_decode(B, L, H, Hk, hd, dt, DEV)
        kvb = 2 * B * L * Hk * hd * 2
        # split_keys around the default 256: at B 32 x 2K the graph is ~19 us of fixed latency plus 1.1x
        # its bytes (the gate at 7b20989), a program's serial walk over its split's key blocks; shorter
        # splits shorten it (more programs, more partials: 16 / split_keys of the KV bytes)
        cands = [(bn, w, st, sk) for sk in (64, 128, 256, 512) for (bn, w, st) in ((64, 2, 2), (64, 4, 2), (32, 4, 3),
                                                                                  (32, 2, 3), (128, 4, 2))
                 if sk >= bn]

        def run(c):
            be = TritonAttention(DEV, decode_overrides={"block_n": c[0], "num_warps": c[1], "num_stages": c[2],
                                                        "split_keys": c[3]})
            return ms(lambda: be.decode(q, kc, vc, fb))
        sweep(f"attn_decode_B{B}_L{L}", cands, run, kvb / bw * 1e3, bud)
        del fb, q, kc, vc

    # ---- varlen paged prefill attention: (block_m, block_n, warps, stages[, heavy_first]), the tiles with the
    # most keys launched first (default) or in sequence order (False); q heads packed per KV head, lazy
    # rescaling and warp_specialize were no faster (docs/history.md)
    if "prefill" in sections:
        prefill_sweep("attn_prefill", [(64, 64, 4, 2), (64, 64, 4, 2, False), (128, 128, 8, 3), (128, 128, 8, 3, False),
                                       (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4),
                                       (128, 128, 8, 4), (128, 64, 8, 3)], bud)
    # the TMA kernel (engine/attention/triton_prefill_tma.py: the pass's own keys through tensor descriptors,
    # the long passes' plan on Hopper) beside the paged kernel's long and default tiles:
    # ("tma", block_m, block_n, warps, stages, warp_specialize)
    if "prefilltma" in sections:
        prefill_sweep("attn_prefill_tma", [(128, 128, 8, 3), (64, 64, 4, 2), ("tma", 128, 128, 8, 2, False),
                                           ("tma", 128, 128, 8, 2, True), ("tma", 128, 64, 8, 3, False),
                                           ("tma", 128, 64, 8, 3, True), ("tma", 128, 128, 8, 3, False),
                                           ("tma", 128, 64, 4, 3, False), ("tma", 64, 64, 4, 3, False)], bud)
    # continuations on cached prefixes: the paged 64 / 128 tiles and TMA (attention/plan.py's choice between them)
    if "prefilltmac" in sections:
        prefill_sweep("attn_prefill_tmac", [(64, 64, 4, 2), (128, 128, 8, 3), ("tma", 128, 128, 8, 3, False)], bud,
                      cases=([(2048, 2048)], [(4096, 2048)], [(8000, 2048)], [(4096, 1024)], [(0, 1024)]))
    if args.out:
        Path(args.out).write_text(json.dumps(RES, indent=1))
    print(f"sweep done in {time.time() - T0:.0f} s", flush=True)


def prefill_sweep(name: str, cands, bud: float, cases=None) -> None:
    """Each candidate at 2,048, 4,096 and 8,192 new tokens and two 575-token continuations on 1,500 cached
    (or ``cases``: lists of (cached, new) sequences),
    its output within bf16 of the first candidate's: an engine tile (a :class:`PrefillPlan`'s
    fields) or ``("tma", ...)``, :func:`~ainfer_pd.engine.attention.triton_prefill_tma.prefill_tma`'s
    tile. The pass's new keys are written into the pool first, where the paged kernel reads them and
    the TMA one does not (it reads ``k`` / ``v``, as the engine's own K / V of the pass)."""
    for seqs in cases or ([(0, 2048)], [(0, 4096)], [(0, 8192)], [(1500, 575), (1500, 575)]):
        fb, q, k, v, kv, _ = paged_case(seqs, [], H, Hk, hd, torch.bfloat16, DEV)
        kc, vc = kv[0], kv[1]
        kc[fb.write_slots], vc[fb.write_slots] = k, v
        out = torch.empty_like(q)
        fl = sum(4 * H * hd * (n * c + n * n / 2) for c, n in seqs)
        ref = None

        def runp(c):
            nonlocal ref
            fb.prefill_meta = None           # the candidate's own tile metadata, built once, cached on the batch
            if c[0] == "tma":
                plan = PrefillPlan(*c[1:5], own_keys_tma=True)

                def fn():
                    prefill_tma(q, k, v, kc, vc, fb, out, plan, ws=c[5])
            else:
                be = TritonAttention(DEV, prefill_override=PrefillPlan(*c))

                def fn():
                    be.prefill(q, kc, vc, fb, out)
            fn()
            if ref is None:
                ref = out.clone()       # the first candidate's output (the default tile): every other within bf16
            elif (gap := (out.float() - ref.float()).abs().max().item()) > 2e-2:
                raise ValueError(f"output {gap:.3g} off the first candidate's")
            return ms(fn)
        sweep(f"{name}_{'+'.join(f'{c}:{n}' for c, n in seqs)}", cands, runp, fl / 800e12 * 1e3, bud)


if __name__ == "__main__":
    main()
