"""Engine-core roofline benchmark on one GPU (issue 2).

Prints and writes JSON:
* measured HBM copy bandwidth and bf16 matmul peak;
* decode iteration time vs batch size (eager and CUDA-graph replay) on the
  paper-shaped model, against the HBM bound (weight bytes touched + KV bytes read) / bandwidth;
* prefill throughput (tokens/s, TFLOP/s) on 2K-8K token chunks against the matmul peak.

    python benchmarks/engine_gpu_bench.py --layers 8 --ctx 2048 --out bench.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from _cuda_timing import cuda_time_s  # benchmarks/ is on sys.path when run as a script

from ainfer_pd.config import WorkerConfig
from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq
from ainfer_pd.engine.cuda_graphs import DecodeGraphs
from ainfer_pd.engine.kv_cache import KVCacheManager
from ainfer_pd.engine.runner import ModelRunner
from ainfer_pd.phase import Phase, PhaseContext


timed = cuda_time_s


def hbm_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), 20)
    return 2 * x.numel() / t


def matmul_peak() -> float:
    a = torch.randn(16384, 2560, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(2560, 10240, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: a @ b, 20)
    return 2 * 16384 * 2560 * 10240 / t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--expert-intermediate", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--prefill", default="2048,4096,8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of prefill and decode")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = [int(b) for b in args.batches.split(",")]
    Bmax, C = max(batches), args.ctx
    cfg = WorkerConfig.from_dict({
        "model": {"vocab_size": 32000, "hidden_size": 2560, "num_layers": args.layers, "num_heads": 20,
                  "num_kv_heads": 4, "head_dim": 128, "num_experts": args.experts, "top_k": 8,
                  "expert_intermediate": args.expert_intermediate, "shared_expert_intermediate": 0,
                  "max_context_len": 16384, "dtype": "bfloat16", "seed": 0},
        "cache": {"block_size": 16, "num_blocks": Bmax * C // 16 + 64},
        "scheduler": {"max_decode_batch": Bmax},
        "device": {"device": "cuda"},
    })
    mc = cfg.model
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
                 "experts": args.experts, "ctx": C}
    bw = hbm_bandwidth()
    peak = matmul_peak()
    res["hbm_copy_GBps"] = bw / 1e9
    res["bf16_matmul_TFLOPs"] = peak / 1e12
    print(f"HBM copy bandwidth {bw/1e12:.2f} TB/s; bf16 matmul {peak/1e12:.0f} TFLOP/s", flush=True)

    t0 = time.time()
    kv = KVCacheManager(cfg.cache.num_blocks, cfg.cache.block_size)
    runner = ModelRunner(cfg, torch.device("cuda"), kv)
    print(f"model built in {time.time()-t0:.1f}s; params {mc.num_params/1e9:.2f} B", flush=True)
    runner.kv_cache.normal_(0, 0.5)
    bpe = 2  # bf16 bytes
    D, I, E, L = mc.hidden_size, mc.expert_intermediate, mc.num_experts, mc.num_layers
    attn_bytes = L * bpe * (D * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + mc.num_heads * mc.head_dim * D + E * D)
    expert_bytes = bpe * 3 * D * I
    kv_token_bytes = L * 2 * mc.num_kv_heads * mc.head_dim * bpe
    dev = torch.device("cuda")
    dctx = PhaseContext(Phase.DECODE, None)
    pctx = PhaseContext(Phase.PREFILL, None)

    # ------------------------------------------------------------ decode
    res["decode"] = []
    for B in batches:
        slots = torch.arange(B * C, device=dev).view(B, C)
        fb = ForwardBatch(torch.randint(2, mc.vocab_size, (B,), device=dev), torch.full((B,), C - 1, device=dev),
                          slots[:, -1].contiguous(), [], DecodeMeta(slots, torch.full((B,), C, device=dev)),
                          torch.arange(B, device=dev))
        with torch.inference_mode():
            eager = timed(lambda: runner.forward_fb(fb, dctx), 10)
            # experts actually touched by this batch's routing, every layer
            st = runner.model.embed_tokens(fb)
            touched = 0
            for i in range(L):
                st = runner.model.attn_route(i, st, fb, runner.kv_cache[i])
                touched += int((st.routing.counts > 0).sum())
                st = runner.model.experts(i, st)
            graphs = DecodeGraphs(runner, (B,), (C,), runner.scratch_slot, dctx)
            graphs.capture_all()
            g, s, out = graphs.graphs[(B, C)]
            s["ids"].copy_(fb.input_ids); s["pos"].copy_(fb.positions); s["write"].copy_(fb.write_slots)
            s["keys"].copy_(slots); s["lens"].copy_(fb.decode.ctx_lens)
            replay = timed(g.replay, 20)
        bytes_ = attn_bytes + touched * expert_bytes + B * C * kv_token_bytes + 2 * mc.vocab_size * D * bpe
        bound = bytes_ / bw
        row = {"batch": B, "eager_ms": eager * 1e3, "graph_ms": replay * 1e3, "bound_ms": bound * 1e3,
               "graph_over_bound": replay / bound, "graph_speedup": eager / replay,
               "experts_touched_per_layer": touched / L}
        res["decode"].append(row)
        print(f"decode B={B:4d} ctx={C}: eager {eager*1e3:7.3f} ms  graph {replay*1e3:7.3f} ms  "
              f"bound {bound*1e3:7.3f} ms  graph/bound {replay/bound:5.2f}x  graph speed-up {eager/replay:4.2f}x  "
              f"experts/layer {touched/L:.0f}", flush=True)
        del graphs, g, s, out
        torch.cuda.empty_cache()

    # ------------------------------------------------------------ prefill
    res["prefill"] = []
    active = L * ((D * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + mc.num_heads * mc.head_dim * D)
                  + E * D + mc.top_k * 3 * D * I)
    for T in [int(t) for t in args.prefill.split(",")]:
        slots = torch.arange(T, device=dev)
        fb = ForwardBatch(torch.randint(2, mc.vocab_size, (T,), device=dev), torch.arange(T, device=dev), slots,
                          [PrefillSeq(0, T, T, slots)], None, torch.tensor([T - 1], device=dev))
        with torch.inference_mode():
            t = timed(lambda: runner.forward_fb(fb, pctx), 5, warmup=2)
        flops = 2 * T * active + L * 4 * mc.num_heads * mc.head_dim * T * T / 2
        # every routed expert a chunk of T tokens touches is read once: the weight-bytes floor
        n_exp = E * (1 - (1 - mc.top_k / E) ** T)
        wbytes = attn_bytes + L * n_exp * expert_bytes
        roof = max(flops / peak, wbytes / bw)
        row = {"tokens": T, "ms": t * 1e3, "tokens_per_s": T / t, "TFLOPs": flops / t / 1e12,
               "fraction_of_peak": flops / t / peak, "roofline_ms": roof * 1e3, "fraction_of_roofline": roof / t}
        res["prefill"].append(row)
        if args.profile and T == 4096:
            dB = 64
            dsl = torch.arange(dB * C, device=dev).view(dB, C)
            dfb = ForwardBatch(torch.randint(2, mc.vocab_size, (dB,), device=dev), torch.full((dB,), C - 1, device=dev),
                               dsl[:, -1].contiguous(), [], DecodeMeta(dsl, torch.full((dB,), C, device=dev)),
                               torch.arange(dB, device=dev))
            from torch.profiler import ProfilerActivity, profile
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.forward_fb(dfb, dctx)
                torch.cuda.synchronize()
            print("eager decode B=64 kernels:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=10), flush=True)
            from torch.profiler import ProfilerActivity, profile
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.forward_fb(fb, pctx)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        print(f"prefill T={T}: {t*1e3:.1f} ms  {T/t:,.0f} tok/s  {flops/t/1e12:.0f} TFLOP/s  "
              f"({flops/t/peak*100:.0f}% of measured matmul peak; roofline {roof*1e3:.1f} ms = "
              f"max(flops/peak, weight bytes/bw): {roof/t*100:.0f}% of it)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
