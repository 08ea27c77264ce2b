"""The GPU gate (run on the H200 through benchmarks/gpu_gate.sh): correctness checks of every GPU
kernel and path, decode-graph capture of every bucket, and the roofline figures of issue 11.

Prints one ``PASS name`` / ``FAIL name`` line per check (a check that raises is a FAIL with its
error) and ``FIG`` lines for the figures, then writes ``latest.json``: ``commit``, ``checks``
(name -> bool), ``figures``, ``targets`` (issue 11's targets, name -> met), ``errors``.

    python benchmarks/gpu_gate.py --commit HASH --out DIR [--skip-bench] [--only kernels,qwen3,...,nccl,spec,bench,mtp]
    (``--only benchfp8``: the FP8 P1 bench alone, for a gate its time limit cut there)

Bounds use the HBM copy bandwidth and the bf16 matmul peak measured in the same run.
Tolerances: fp32 kernels <= 1e-4 relative (||out - ref|| / ||ref||, ref in float64);
bf16 <= 2e-2, and never worse than 2x the torch reference path's own bf16 error + 1e-3.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cuda_timing import graph_of  # noqa: E402
from _gate_cases import (dense_attention, paged_case, rel_err, topk_choice_error, uniform_decode,  # noqa: E402
                         verify_decode)

from ainfer_pd.tools.bench import _finite  # noqa: E402
from ainfer_pd.config import WorkerConfig  # noqa: E402
from ainfer_pd.engine.attention import (DecodeMeta, ForwardBatch, PrefillSeq, TorchAttention,  # noqa: E402
                                        paged_attention)
from ainfer_pd.engine.attention.plan import TMA_PREFILL_TOKENS, verify_group_width  # noqa: E402
from ainfer_pd.engine.attention.triton_backend import TritonAttention  # noqa: E402
from ainfer_pd.engine.fused_moe import fused_experts, fused_softmax_route  # noqa: E402
from ainfer_pd.engine.kv.kv_cache import KVCacheManager  # noqa: E402
from ainfer_pd.engine.model.moe import Routing, experts_local, route  # noqa: E402
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402

DEV = torch.device("cuda")
R: dict = {"checks": {}, "figures": {}, "targets": {}, "errors": {}}


def check(name: str, ok: bool, detail: str = "") -> bool:
    R["checks"][name] = bool(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)
    return ok


def fig(name: str, value, detail: str = "") -> None:
    R["figures"][name] = value
    print(f"FIG {name} = {json.dumps(value)} {detail}".rstrip(), flush=True)


def target(name: str, met: bool, detail: str) -> None:
    R["targets"][name] = bool(met)
    print(f"TARGET {'MET' if met else 'MISSED'} {name}: {detail}", flush=True)


OUT_DIR: Path | None = None


def save() -> None:
    """latest.json after every section, so a run stopped at its limit still leaves its figures."""
    if OUT_DIR is not None:
        R["passed"] = all(R["checks"].values()) and bool(R["checks"])
        (OUT_DIR / "latest.json").write_text(json.dumps(_finite(R), indent=1, default=str))


def guarded(name: str, fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as exc:  # noqa: BLE001 - a crashing section is a failed check
        R["errors"][name] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        check(name, False, f"raised {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        save()
    # The traceback's frames held the failed section's tensors (a model, its KV pool): freed here,
    # or every later section, and the sections run as processes of their own, runs out of memory.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return None


def bench_ms(fn, rep_ms: int = 100) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median"))


def gpu_busy_ms(fn) -> float:
    """Sum of the device time of every kernel of one call of ``fn`` (host launch gaps excluded):
    what the pass costs the GPU, as against its wall time when the host launches slower."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    key = "self_device_time_total" if hasattr(prof.key_averages()[0], "self_device_time_total") else "self_cuda_time_total"
    return sum(getattr(e, key) for e in prof.key_averages()) / 1e3


# --------------------------------------------------------------------------- ceilings
def ceilings() -> tuple[float, float]:
    x = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / (bench_ms(lambda: y.copy_(x)) / 1e3)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    peak = 2 * 8192 ** 3 / (bench_ms(lambda: a @ b) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    fig("hbm_copy_TBps", round(bw / 1e12, 3))
    fig("bf16_matmul_TFLOPs", round(peak / 1e12, 1))
    return bw, peak


# --------------------------------------------------------------------------- kernel checks
# (H, Hk, hd) of the checked shapes, the checked batches, and the sizes of the figures
SHAPES = {"qwen3": (32, 4, 128), "tiny": (4, 2, 32), "paper": (20, 4, 128)}
CASES = {
    "decode": ([], [1, 17, 300, 2049, 2900, 4096, 33]),
    "prefill": ([(0, 300), (1500, 575), (37, 1)], []),
    "mixed": ([(0, 129), (800, 64)], [5, 1000, 2500]),
}
MOE_CHECK = (128, 2048, 768, 8, (1, 48, 333, 2048))      # E, D, I, k, token counts
ITER_B, ITER_CTX = (1, 4, 16, 40, 64, 128), 2048     # 40: between buckets (its graph has 24 padding rows)
ITER_LONG = ((16, 2048), (16, 8192), (16, 16384), (32, 8192))     # (B, context): the long-context decode rows
PREFILL = ((2048, 0), (4096, 0), (8192, 0), (575, 1500))
ATTN_PARTS = ((32, 2048), (64, 2048), (64, 4096), (128, 2048))
ATTN_SMALL = ((1, 2048), (1, 5000), (4, 5000), (16, 5000))   # reported; latency-bound, not held to 1.5x
VERIFY_ATTN = ((32, 2048, 4), (32, 8192, 4), (64, 2048, 4), (16, 8192, 2))   # (turns, keys, rows a turn)
MOE_PARTS = (32, 64, 128)
EAGER_PROFILE = (37, 1500)


def kernel_checks() -> None:
    tri, ref = TritonAttention(DEV), TorchAttention()
    shapes, cases = SHAPES, CASES
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        for sname, (H, Hk, hd) in shapes.items():
            if dtype == torch.float32 and sname == "paper":
                continue
            for cname, (seqs, dec) in cases.items():
                worst = worst_ref = 0.0
                for seed in range(2):
                    fb, q, k, v, kv = paged_case(seqs, dec, H, Hk, hd, dtype, DEV, seed=seed)[:5]
                    refs = paged_case(seqs, dec, H, Hk, hd, dtype, DEV, seed=seed)[5]
                    kv2 = kv.clone()
                    fb2 = paged_case(seqs, dec, H, Hk, hd, dtype, DEV, seed=seed)[0]
                    out = paged_attention(q, k, v, kv, fb, tri)
                    out_ref = paged_attention(q, k, v, kv2, fb2, ref)
                    for (t, n, cached, slots) in refs:
                        s = slots.to(DEV)
                        d = dense_attention(q[t:t + n], kv[0][s], kv[1][s], cached)
                        worst = max(worst, rel_err(out[t:t + n], d))
                        worst_ref = max(worst_ref, rel_err(out_ref[t:t + n], d))
                bound = tol if dtype == torch.float32 else min(tol, 2 * worst_ref + 1e-3)
                check(f"attn_{cname}_{dn}_{sname}", worst <= bound,
                      f"rel err {worst:.2e} (torch path {worst_ref:.2e}, bound {bound:.1e})")
    # decode kernels replay inside a CUDA graph and give the eager result
    H, Hk, hd = shapes["qwen3"]
    fb, q, kc, vc = uniform_decode(48, 2048, H, Hk, hd, torch.bfloat16, DEV)
    eager = tri.decode(q, kc, vc, fb)
    box = {}
    g = graph_of(lambda: box.__setitem__("o", tri.decode(q, kc, vc, fb)))
    g.replay()
    torch.cuda.synchronize()
    check("attn_decode_graph_equals_eager", torch.equal(box["o"], eager))
    # fused MoE against the reference grouped-GEMM path
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        dn = "fp32" if dtype == torch.float32 else "bf16"
        E, D, I, k, counts = MOE_CHECK
        g0 = torch.Generator(device=DEV).manual_seed(0)
        w13 = (torch.randn(E, D, 2 * I, device=DEV, generator=g0) * D ** -0.5).to(dtype)
        w2 = (torch.randn(E, I, D, device=DEV, generator=g0) * I ** -0.5).to(dtype)
        rw = torch.randn(E, D, device=DEV, generator=g0).to(dtype)
        for T in counts:
            x = torch.randn(T, D, device=DEV, generator=g0).to(dtype)
            r = route(x, rw, k)
            out = fused_experts(x, r, w13, w2)
            d = experts_local(x.double(), Routing(r.topk_idx, r.topk_weights.double(), r.order, r.counts, r.offsets),
                              w13.double(), w2.double())
            e_ref = rel_err(experts_local(x, r, w13, w2), d)
            e = rel_err(out, d)
            bound = tol if dtype == torch.float32 else min(tol, 2 * e_ref + 1e-3)
            check(f"moe_T{T}_{dn}", e <= bound, f"rel err {e:.2e} (torch path {e_ref:.2e}, bound {bound:.1e})")
            # the fused softmax router against the exact probabilities of the same logits (bf16
            # logits tie exactly and often: either expert of a tie is a right choice, so the choice
            # is compared by the probabilities it took, not index by index)
            fr = fused_softmax_route(x, rw, k)
            probs = torch.softmax(torch.nn.functional.linear(x, rw).double(), dim=-1)
            gap, werr = topk_choice_error(fr.topk_idx, fr.topk_weights, probs, norm=True)
            same = float((fr.topk_idx == r.topk_idx).all(dim=1).float().mean())
            counts_ok = torch.equal(fr.counts, torch.bincount(fr.topk_idx.reshape(-1), minlength=E))
            fp32 = dtype == torch.float32
            ok = gap <= 1e-6 and werr <= (1e-5 if fp32 else 8e-3) and counts_ok
            check(f"router_T{T}_{dn}", ok, f"top-k probability gap {gap:.1e}, weights max err {werr:.1e}, "
                  f"counts {'equal' if counts_ok else 'DIFFER'}; index-equal to torch.topk for {same:.3f} of tokens")
        del w13, w2
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- model-level figures
def model_cfg(path: str, num_blocks: int, extra: dict | None = None) -> WorkerConfig:
    cfg = WorkerConfig.from_yaml(path)
    kw = {"cache.num_blocks": num_blocks, "device.device": "cuda"}
    kw.update(extra or {})
    return cfg.replace(**kw)


def weight_bytes(model) -> tuple[float, float, float]:
    """(bytes of every layer tensor but the routed experts, bytes of one routed expert with its
    scales, embed + head bytes) of the model as built: bf16 or FP8 (1 byte a weight + its block scales)."""
    c = model.cfg
    expert = other = 0
    for name, p in model.layers.named_parameters():
        n = p.numel() * p.element_size()
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 3 and leaf.startswith(("w13", "w2")):     # w13 / w2, or w13_fp8 / w13_scale_inv ...
            expert += n
        else:
            other += n
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    local = model.expert_range[1] - model.expert_range[0]
    eh = model.embed.numel() * model.embed.element_size() * (1 if c.tie_word_embeddings else 2)
    return other, expert / max(1, moe_layers * local), eh


def touched_experts(runner, fb) -> int:
    """Experts the routing of this batch touches, summed over layers (eager walk, no graphs)."""
    m = runner.model
    st = m.embed_tokens(fb)
    n = 0
    for i in range(m.cfg.num_layers):
        st = m.attn_route(i, st, fb, runner.kv_cache[i])
        n += int((st.routing.counts > 0).sum())
        st = m.experts(i, st)
    return n


def decode_fb(runner, B: int, L: int, seed: int = 0) -> ForwardBatch:
    """B rows at context L over distinct shuffled blocks of the runner's cache."""
    bs = runner.kv.block_size
    nb = -(-L // bs)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(runner.kv.alloc.num_blocks, generator=g)[:B * nb].view(B, nb)
    write = table[:, (L - 1) // bs] * bs + (L - 1) % bs
    mc = runner.sections.model
    ids = torch.randint(2, mc.vocab_size, (B,), generator=g)
    return ForwardBatch(ids.to(DEV), torch.full((B,), L - 1, device=DEV),
                        write.to(DEV), [], DecodeMeta(None, torch.full((B,), L, device=DEV), block_table=table.to(DEV),
                                                      block_size=bs),
                        torch.arange(B, device=DEV), block_size=bs)


def prefill_fb(runner, n: int, cached: int, seed: int = 0) -> ForwardBatch:
    bs = runner.kv.block_size
    ctx = cached + n
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(runner.kv.alloc.num_blocks, generator=g)[:-(-ctx // bs)]
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:ctx]
    mc = runner.sections.model
    ids = torch.randint(2, mc.vocab_size, (n,), generator=g)
    return ForwardBatch(ids.to(DEV), torch.arange(cached, ctx, device=DEV),
                        slots[cached:].to(DEV), [PrefillSeq(0, n, ctx, block_ids=blocks)], None,
                        torch.tensor([n - 1], device=DEV), block_size=bs)


def projection_flops(mc, n: int) -> tuple[float, float]:
    """(the dense projections: QKV, O, the router and the shared expert; the routed experts) FLOPs of
    ``n`` tokens (``model.fp8_dense`` makes the dense ones bar the router FP8)."""
    D, H, Hk, hd, L = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.num_layers
    dense = D * (H + 2 * Hk) * hd + H * hd * D + mc.num_experts * D + 3 * D * mc.shared_expert_intermediate
    return 2 * n * dense * L, 2 * n * mc.top_k * 3 * D * mc.expert_intermediate * L


def prefill_flops(mc, n: int, cached: int) -> tuple[float, float]:
    """(projection FLOPs, attention and head FLOPs) of a prefill pass of ``n`` new tokens on ``cached``
    keys of the model ``mc``: the roofline's compute terms (the projections run at the FP8 rate in FP8)."""
    D, H, hd, L = mc.hidden_size, mc.num_heads, mc.head_dim, mc.num_layers
    return sum(projection_flops(mc, n)), L * 4 * H * hd * (n * cached + n * n / 2) + 2 * D * mc.vocab_size


def kv_token_bytes(mc, elem_bytes: int = 2) -> int:
    """Bytes of one token's K and V over every layer, in a pool of ``elem_bytes`` a value (2: bf16, 1: FP8)."""
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem_bytes


def prefill_roofline_ms(model, n: int, cached: int, peak: float, bw: float, as_built: bool = False) -> float:
    """The roofline (ms) of a prefill pass of ``n`` new tokens on ``cached`` keys of ``model``: the
    larger of its compute time (:func:`prefill_flops` at ``peak``; an FP8 model's projections at twice
    it, its attention bf16) and its bytes (the weights, the routed experts its tokens touch, the KV
    read) over ``bw``. ``as_built``: each projection at the rate of the precision it runs in (an FP8
    model's dense projections at the bf16 rate unless ``model.fp8_dense``), not all at the FP8 rate."""
    mc = model.cfg
    attn_b, exp_b, eh_b = weight_bytes(model)
    _, attn_flops = prefill_flops(mc, n, cached)
    dense, experts = projection_flops(mc, n)
    e_touch = mc.num_experts * (1 - (1 - mc.top_k / mc.num_experts) ** n)
    bytes_ = attn_b + mc.num_layers * e_touch * exp_b + eh_b + (n + cached) * kv_token_bytes(mc)
    fp8 = 2 if mc.quantization == "fp8" else 1
    dense_fp8 = fp8 if not as_built or getattr(mc, "fp8_dense", False) else 1
    return max(dense / (peak * dense_fp8) + experts / (peak * fp8) + attn_flops / peak, bytes_ / bw) * 1e3


def capture_graphs(runner, cfg: WorkerConfig, tag: str, dctx: PhaseContext, pctx: PhaseContext) -> tuple[int, tuple]:
    """Each phase's graphs captured on its own stream (D's decode buckets, then P's), and the check
    that every decode bucket was; returns (decode graphs, their context buckets)."""
    from ainfer_pd.engine.runtime.cuda_graphs import graph_buckets
    t0 = time.time()
    n = runner.capture_decode_graphs(dctx)
    runner.capture_prefill_graphs(pctx)
    dc, mc = cfg.device, cfg.model
    sizes, ctxs = graph_buckets(dc.graph_batch_sizes, cfg.scheduler.max_decode_batch, dc.graph_context_tiers,
                                dc.graph_max_context, mc.max_context_len)
    check(f"{tag}_graphs_capture_every_bucket", n == len(sizes) * len(ctxs) and n > 0,
          f"{n} graphs of {len(sizes) * len(ctxs)} (contexts {list(ctxs)}) in {time.time() - t0:.1f} s")
    return n, ctxs


def iter_batches(cfg: WorkerConfig, tag: str, headroom: int = 6 << 30) -> tuple[int, ...]:
    """The batches of ``ITER_B`` whose KV pool at ``ITER_CTX`` fits this device beside the weights
    (``headroom`` for the graphs and activations); those left out are said (an H100 holds the
    Qwen3-30B-A3B shape's bf16 weights and B 64 at 2K, not B 128: H200 figures need the H200)."""
    from ainfer_pd.engine.kv.residency import kv_block_bytes
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0] - cfg.model.rank_weight_bytes(cfg.parallel.expert_parallel) - headroom
    fits = tuple(b for b in ITER_B if (b * ITER_CTX // 16 + 1024) * kv_block_bytes(cfg) <= free) or ITER_B[:1]
    if fits != ITER_B:
        fig(f"{tag}_decode_batches_left_out", {"batches": [b for b in ITER_B if b not in fits],
                                                "why": f"KV pool past the {free / 2**30:.1f} GiB free beside the weights"})
    return fits


def model_figures(tag: str, cfg_path: str, bw: float, peak: float, capture_all: bool, extra: dict | None = None) -> None:
    """The model-level checks and figures of one config (``extra``: settings on top, e.g. FP8)."""
    mc0 = WorkerConfig.from_yaml(cfg_path).model
    batches = iter_batches(model_cfg(cfg_path, 1, extra), tag)
    num_blocks = max(batches) * ITER_CTX // 16 + 1024
    cfg = model_cfg(cfg_path, num_blocks, extra)
    t0 = time.time()
    kv = KVCacheManager(num_blocks, 16)
    runner = ModelRunner(RunnerSections.from_config(cfg), DEV, kv)
    runner.kv_cache.normal_(0, 1)
    torch.cuda.synchronize()
    fig(f"{tag}_model_build_s", round(time.time() - t0, 1), f"({mc0.num_params / 1e9:.1f} B params)")
    mc = cfg.model
    dctx, pctx = PhaseContext(Phase.DECODE, None), PhaseContext(Phase.PREFILL, None)
    attn_b, exp_b, eh_b = weight_bytes(runner.model)
    fp8 = mc.quantization == "fp8"
    kv_tok = kv_token_bytes(mc)
    with torch.inference_mode():
        if capture_all:
            n, ctxs = capture_graphs(runner, cfg, tag, dctx, pctx)
            fig(f"{tag}_graph_capture", {"graphs": n, "contexts": list(ctxs), "capture_s": round(runner.graphs.capture_s, 2),
                                         "memory_MiB": round(runner.graphs.memory_bytes / 2**20, 1)})
            # ---- P passes replay the piecewise P graphs, equal to the eager pass
            pg = runner.pgraphs
            streams = (runner.graphs.stream, pg.stream if pg is not None else None)
            check(f"{tag}_graphs_captured_on_their_phase_streams",
                  streams == (runner.phase_stream(dctx), runner.phase_stream(pctx)) and streams[0] != streams[1],
                  f"D graphs on {streams[0]}, P graphs on {streams[1]} (one stream: one cuBLAS workspace for both)")
            check(f"{tag}_prefill_graphs_captured", pg is not None and len(pg.graphs) > 0,
                  f"{len(pg.graphs) if pg else 0} token buckets; refusal: {runner.prefill_graphs_refusal()}")
            if pg is not None:
                fig(f"{tag}_prefill_graph_capture", {"buckets": list(pg.buckets), "capture_s": round(pg.capture_s, 2),
                                                     "memory_MiB": round(pg.memory_bytes / 2**20, 1)})
                for n, cached in ((37, 0), (575, 1500), (2000, 100), (2048, 0), (2048, 1000),
                                  (2048, 4096)):
                    r0 = pg.num_replays
                    glog = runner.forward_fb(prefill_fb(runner, n, cached, seed=n), pctx)
                    replayed = pg.num_replays == r0 + 1
                    runner.pgraphs = None
                    eager = runner.forward_fb(prefill_fb(runner, n, cached, seed=n), pctx)
                    runner.pgraphs = pg
                    err = rel_err(glog, eager)
                    kept = pg.graphs[pg.bucket(n)].own_kv is not None    # the TMA plan's own K/V, kept by the graphs
                    tma = pg.bucket(n) >= TMA_PREFILL_TOKENS and getattr(runner.model.attn_backend, "tma", False)
                    check(f"{tag}_prefill_graph_equals_eager_{n}_on_{cached}", replayed and err < 2e-2 and kept == tma,
                          f"{'replayed' if replayed else 'NOT replayed'}, own K/V kept {kept} (TMA plan {tma}), "
                          f"logits rel err {err:.2e}, "
                          f"argmax {'equal' if bool((glog.argmax(-1) == eager.argmax(-1)).all()) else 'differs'}")
            # ---- a row at the model's whole context replays a graph (no context cliff), equal to eager
            Lmax = mc.max_context_len
            for B in (b for b in (1, 4) if b * -(-Lmax // 16) <= num_blocks):
                r0 = runner.graphs.num_replays
                glog = runner.graphs.try_run(decode_fb(runner, B, Lmax, seed=7))
                replayed = glog is not None and runner.graphs.num_replays == r0 + 1
                eager = runner.forward_fb(decode_fb(runner, B, Lmax, seed=7), dctx)
                ok = replayed and float((glog.argmax(-1) == eager.argmax(-1)).float().mean()) >= 0.75 \
                    and rel_err(glog, eager) < 2e-2
                check(f"{tag}_decode_at_max_context_replays_graph_b{B}", ok,
                      f"context {Lmax}: {'replayed' if replayed else 'NOT replayed'}"
                      + (f", logits rel err {rel_err(glog, eager):.2e}" if glog is not None else ""))
        # ---- whole decode iteration (graph) vs its bound, ctx 2K
        rows = {}
        C = ITER_CTX
        for B in batches:
            fb = decode_fb(runner, B, C, seed=B)
            touched = touched_experts(runner, decode_fb(runner, B, C, seed=B))
            bound = (attn_b + touched * exp_b + B * C * kv_tok + eh_b + B * mc.hidden_size * 2) / bw
            eager_logits = runner.forward_fb(decode_fb(runner, B, C, seed=B), dctx)
            efb = decode_fb(runner, B, C, seed=B)
            t_eager = bench_ms(lambda: runner.forward_fb(efb, dctx), 300)
            if runner.graphs is not None and runner.graphs.bucket(B, C) in runner.graphs.graphs:
                glog = runner.graphs.try_run(fb)
                g = runner.graphs.graphs[runner.graphs.bucket(B, C)][0]
                t_graph = bench_ms(g.replay, 300)
                agree = float((glog.argmax(-1) == eager_logits.argmax(-1)).float().mean())
                err = rel_err(glog, eager_logits)
                check(f"{tag}_graph_decode_equals_eager_b{B}", agree >= 0.95 and err < 2e-2,
                      f"argmax agreement {agree:.3f}, logits rel err {err:.2e}")
            else:
                t_graph = float("nan")
            rows[B] = {"graph_ms": round(t_graph, 3), "eager_ms": round(t_eager, 3), "bound_ms": round(bound * 1e3, 3),
                       "ratio": round(t_graph / (bound * 1e3), 3), "experts_touched_per_layer": touched / mc.num_layers}
            fig(f"{tag}_decode_iteration_b{B}", rows[B])
        R[f"{tag}_decode_rows"] = rows
        # ---- long contexts: the same graphs, lengths as data; tokens/s against the bound as at 2K
        if capture_all:
            long_rows = {}
            for B, C in ITER_LONG:
                if runner.graphs is None or runner.graphs.bucket(B, C) not in runner.graphs.graphs \
                        or B * -(-C // 16) > num_blocks:
                    continue
                fb = decode_fb(runner, B, C, seed=B + C)
                touched = touched_experts(runner, decode_fb(runner, B, C, seed=B + C))
                bound = (attn_b + touched * exp_b + B * C * kv_tok + eh_b + B * mc.hidden_size * 2) / bw
                runner.graphs.try_run(fb)
                t_graph = bench_ms(runner.graphs.graphs[runner.graphs.bucket(B, C)][0].replay, 300)
                long_rows[f"B{B}_L{C}"] = {"graph_ms": round(t_graph, 3), "bound_ms": round(bound * 1e3, 3),
                                           "ratio": round(t_graph / (bound * 1e3), 3),
                                           "bucket": list(runner.graphs.bucket(B, C))}
            fig(f"{tag}_decode_iteration_long", long_rows)
        # ---- eager decode uses the same kernels as the graphs, no cuDNN
        from torch.profiler import ProfilerActivity, profile
        B, C = EAGER_PROFILE                    # the rows that fit the pool (an H100's is smaller beside the weights)
        B = max(1, min(B, runner.kv.alloc.num_blocks // -(-C // runner.kv.block_size)))
        fb = decode_fb(runner, B, C)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.forward_fb(fb, dctx)
            torch.cuda.synchronize()
        names = [e.key for e in prof.key_averages()]
        cudnn = [n for n in names if "cudnn" in n.lower() or "fmha" in n.lower() or "efficient_attention" in n.lower()]
        paged = [n for n in names if "paged_decode_kernel" in n]
        check(f"{tag}_eager_decode_paged_kernels_no_cudnn", bool(paged) and not cudnn,
              f"paged kernel {'seen' if paged else 'absent'}; cudnn/sdpa kernels {cudnn[:3]}")
        # ---- prefill 2K / 4K / 8K and the 575-token continuation
        pre = {}
        D, H, Hk, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
        for n, cached in PREFILL:
            pfb = prefill_fb(runner, n, cached)

            def step():
                pfb.prefill_meta = None            # the varlen metadata is built (host) every pass, as in the engine
                return runner.forward_fb(pfb, pctx)
            t = bench_ms(step, 300)
            flops = sum(prefill_flops(mc, n, cached))
            roof = prefill_roofline_ms(runner.model, n, cached, peak, bw)
            busy = gpu_busy_ms(step)
            pre[f"{n}+{cached}"] = {"ms": round(t, 2), "roofline_ms": round(roof, 2),
                                    "roofline_fraction": round(roof / t, 3), "TFLOPs": round(flops / t / 1e9, 1),
                                    "gpu_busy_ms": round(busy, 2), "gpu_busy_roofline_fraction": round(roof / busy, 3)}
            if fp8:                  # the dense projections as they run (bf16 unless model.fp8_dense)
                built = prefill_roofline_ms(runner.model, n, cached, peak, bw, as_built=True)
                pre[f"{n}+{cached}"]["as_built_roofline_fraction"] = round(built / t, 3)
            fig(f"{tag}_prefill_{n}_cached_{cached}", pre[f"{n}+{cached}"])
        R[f"{tag}_prefill_rows"] = pre
        if fp8:                     # the FP8 kernels' parts: benchmarks/fp8_kernel_check.py
            release(runner)
            return
        # ---- per-layer parts: decode attention (eager and graph) and MoE decode
        tri = runner.model.attn_backend
        attn = {}
        for B, Lk in ATTN_PARTS + ATTN_SMALL:
            fb, q, kc, vc = uniform_decode(B, Lk, H, Hk, hd, mc.torch_dtype, DEV)
            kvb = 2 * B * Lk * Hk * hd * 2 + 2 * B * H * hd * 2
            t_e = bench_ms(lambda: tri.decode(q, kc, vc, fb))
            g = graph_of(lambda: tri.decode(q, kc, vc, fb))
            t_g = bench_ms(g.replay)
            attn[f"B{B}_L{Lk}"] = {"eager_ms": round(t_e, 4), "graph_ms": round(t_g, 4),
                                   "bound_ms": round(kvb / bw * 1e3, 4), "eager_ratio": round(t_e / (kvb / bw * 1e3), 3),
                                   "graph_ratio": round(t_g / (kvb / bw * 1e3), 3)}
            del fb, q, kc, vc, g
        fig(f"{tag}_decode_attention", attn)
        # ---- a verify pass's attention (speculative decoding): a turn's rows read its keys once
        ver, same = {}, True
        W = verify_group_width(4, H // Hk)
        for B, Lk, w in VERIFY_ATTN:
            grouped, alone, q, kc, vc = verify_decode(B, w, Lk, H, Hk, hd, mc.torch_dtype, DEV, W)
            same = same and torch.equal(tri.decode(q, kc, vc, grouped), tri.decode(q, kc, vc, alone))
            t_g, t_a = (bench_ms(graph_of(lambda fb=fb: tri.decode(q, kc, vc, fb)).replay) for fb in (grouped, alone))
            kvb = 2 * B * (Lk + w) * Hk * hd * 2 + 2 * B * w * H * hd * 2
            ver[f"B{B}x{w}_L{Lk}"] = {"grouped_ms": round(t_g, 4), "rows_alone_ms": round(t_a, 4),
                                      "speedup": round(t_a / t_g, 3), "bound_ms": round(kvb / bw * 1e3, 4),
                                      "grouped_ratio": round(t_g / (kvb / bw * 1e3), 3)}
            del grouped, alone, q, kc, vc
        for B, Lk in ((64, 2048), (32, 8192)):      # rows alone on the verify kernel (plain passes: the plain graphs)
            fb, q, kc, vc = uniform_decode(B, Lk, H, Hk, hd, mc.torch_dtype, DEV)
            lone = ForwardBatch(fb.input_ids, fb.positions, fb.write_slots, [], DecodeMeta(
                None, fb.decode.ctx_lens, block_table=fb.decode.block_table, block_size=fb.decode.block_size,
                lead_off=torch.zeros_like(fb.decode.ctx_lens), group_width=W), None, block_size=fb.block_size)
            same = same and torch.equal(tri.decode(q, kc, vc, lone), tri.decode(q, kc, vc, fb))
            t_w, t_1 = (bench_ms(graph_of(lambda b=b: tri.decode(q, kc, vc, b)).replay) for b in (lone, fb))
            ver[f"plain_B{B}_L{Lk}"] = {"width_kernel_ms": round(t_w, 4), "plain_kernel_ms": round(t_1, 4),
                                        "cost": round(t_w / t_1, 3)}
            del fb, lone, q, kc, vc
        fig(f"{tag}_verify_attention", ver)
        check(f"{tag}_verify_attention_grouped_equals_rows_alone", same, "bitwise, every row")
        lyr = runner.model.layers[0]
        moe = {}
        for B in MOE_PARTS:
            x = torch.randn(B, D, device=DEV, dtype=mc.torch_dtype)
            r = route(x, lyr.router, mc.top_k)
            touched = int((r.counts > 0).sum())
            wb = touched * exp_b + mc.num_experts * D * 2
            g = graph_of(lambda: fused_experts(x, route(x, lyr.router, mc.top_k), lyr.w13, lyr.w2))
            t_f = bench_ms(g.replay)
            g2 = graph_of(lambda: experts_local(x, route(x, lyr.router, mc.top_k), lyr.w13, lyr.w2))
            t_r = bench_ms(g2.replay)
            moe[f"B{B}"] = {"fused_graph_ms": round(t_f, 4), "reference_graph_ms": round(t_r, 4),
                            "bound_ms": round(wb / bw * 1e3, 4), "ratio": round(t_f / (wb / bw * 1e3), 3),
                            "experts_touched": touched}
            del g, g2
        fig(f"{tag}_moe_decode", moe)
        R[f"{tag}_parts"] = {"attention": attn, "moe": moe}
    release(runner)


def release(runner) -> None:
    """Free a runner's GPU memory now (the library's own release: graphs, KV pool, weights' storage,
    then the allocator's cache back to the driver)."""
    runner.release_cuda()


def summarize_targets() -> None:
    f = R["figures"]
    attn = f.get("qwen3_decode_attention", {})
    held = {f"B{B}_L{L}" for B, L in ATTN_PARTS}
    ratios = {k: max(v["eager_ratio"], v["graph_ratio"]) for k, v in attn.items() if k in held}
    R["decode_attention_small"] = {k: v for k, v in attn.items() if k not in held}
    R["decode_attention_ratio"] = ratios
    if ratios:
        target("decode_attention_le_1.5x", max(ratios.values()) <= 1.5, f"worst {max(ratios.values()):.2f}x of KV bytes")
    moe = f.get("qwen3_moe_decode", {})
    R["moe_decode_ratio"] = {k: v["ratio"] for k, v in moe.items()}
    if moe:
        w = max(v["ratio"] for v in moe.values())
        target("moe_decode_le_1.3x", w <= 1.3, f"worst {w:.2f}x of touched weights")
    for B in (64, 128):
        row = f.get(f"qwen3_decode_iteration_b{B}")
        if row:
            R[f"decode_iteration_ratio_b{B}"] = row["ratio"]
            target(f"decode_iteration_b{B}_le_1.3x", row["ratio"] <= 1.3, f"{row['graph_ms']} ms vs bound {row['bound_ms']} ms")
    pre = R.get("qwen3_prefill_rows", {})
    R["prefill_roofline_fraction"] = {k.split("+")[0]: v["roofline_fraction"] for k, v in pre.items() if k.endswith("+0")}
    for k, v in R["prefill_roofline_fraction"].items():
        target(f"prefill_{k}_ge_60pct", v >= 0.6, f"{v * 100:.0f}% of max(FLOPs/peak, bytes/bw)")
    if "575+1500" in pre:
        c = pre["575+1500"]
        R["continuation_epoch_ms"] = c["ms"]
        R["continuation_epoch_gpu_busy_ms"] = c["gpu_busy_ms"]
        target("continuation_575_le_25ms", c["ms"] <= 25,
               f"{c['ms']} ms wall (forward pass), {c['gpu_busy_ms']} ms of kernels: the rest is host launch time")


# --------------------------------------------------------------------------- subprocess checks
def run_sub(name: str, cmd: list[str], timeout: int, log: Path) -> int:
    """Run ``cmd`` into ``log``; past ``timeout`` it gets SIGABRT, so (PYTHONFAULTHANDLER) every
    thread's stack lands in the log and a hang is told from a slow run, then SIGKILL; rc 124. 20 s
    before that, a CLI run (``ainfer_pd.tools.stall_dump``) also writes its asyncio tasks' stacks."""
    t0 = time.time()
    with log.open("w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                                  "AINFER_PD_STALL_DUMP_S": str(max(10, timeout - 20))})  # the tasks' stacks too
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = 124
    print(f"   ({name}: rc {rc} in {time.time() - t0:.0f} s; log {log.name})", flush=True)
    return rc


def smoke(out: Path) -> None:
    rc = run_sub("cuda_smoke", [sys.executable, "benchmarks/cuda_smoke.py"], 200, out / "cuda_smoke.log")
    tail = (out / "cuda_smoke.log").read_text().splitlines()[-12:]
    print("   " + "\n   ".join(tail), flush=True)
    check("cuda_smoke", rc == 0, "(fp32 policies identical; bf16 graph vs eager)")


def nccl(out: Path) -> None:
    """The NCCL path of the crossed pair's collectives at world size 1 (issue 36, item 5): a real NCCL
    world through ainfer_pd.launch, the phase collectives on their own communicators, and the multi-rank
    engine with D's DP-attention collectives issued (benchmarks/_gate_nccl.py, as a subprocess)."""
    from _gate_nccl import section
    section(out, run_sub, check, fig)


def spec(out: Path) -> None:
    """Speculative decoding on the GPU path (issue 38): the trained small model's greedy two-turn
    rollouts with suffix drafts against none, float32 (benchmarks/_gate_spec.py, as a subprocess)."""
    from _gate_spec import section
    section(out, run_sub, check, fig)


def mtp(out: Path) -> None:
    """MTP drafts on the GPU path (issue 38): the fitted tiny glm4_moe MTP checkpoint on its decode
    graphs (and, bf16, the P graphs) against plain decoding and the eager run (benchmarks/_gate_spec.py
    --part mtp, as a subprocess; last, after the bench: its five workers compile their own kernels)."""
    from _gate_spec import section
    section(out, run_sub, check, fig, part="mtp", timeout=360)


def bench(out: Path, args, *, tag: str = "", policies: str = "normal,fine-grained,mixed-chunked",
          sets: tuple[str, ...] = ()) -> None:
    """The P1 cell on the Qwen3 shape, one run a policy; ``tag`` names a variant's figures and
    check (``sets``: its config overrides), e.g. the overlapped D loop."""
    bdir = Path(f"/tmp/gpu_gate_bench{tag}")   # plots stay here: only a few files come back from a device run
    cmd = [sys.executable, "-m", "ainfer_pd.tools.cli", "bench", "--config", "configs/qwen3-30b-a3b-shape.yaml",
           "--policies", policies, "--cells", "P1", "--repeats", "1",
           "--conversations", str(args.bench_conversations), "--max-turns", "3", "--token-scale", str(args.bench_token_scale),
           "--no-progress", "--out", str(bdir), "--set", "device.graph_batch_sizes=[1,4,16,32,64]"]
    for kv in sets:
        cmd += ["--set", kv]
    rc = run_sub(f"bench{tag}", cmd, args.bench_timeout, out / f"bench{tag}.log")
    lines = [ln for ln in (out / f"bench{tag}.log").read_text().splitlines() if "makespan" in ln or "D iters" in ln
             or "|" in ln]
    print("   " + "\n   ".join(lines[-20:]), flush=True)
    ok = rc == 0 and (bdir / "results.json").exists()
    if ok:
        (out / f"bench{tag}_results.json").write_text((bdir / "results.json").read_text())
        res = json.loads((bdir / "results.json").read_text())
        agg = res["aggregates"]["P1"]
        ms = {v: agg[v]["makespan_s"]["median"] for v in agg}
        fails = {v: sum(s["failures"] for s in res["summaries"]["P1"][v]) for v in agg}
        fig(f"qwen3_p1{tag}_makespan_s", ms)
        fig(f"qwen3_p1{tag}_ratio_vs_normal", {v: round(ms[v] / ms["normal"], 3) for v in ms})
        extra = {}
        for v in agg:
            s = res["summaries"]["P1"][v][0]
            extra[v] = {k: s.get(k) for k in ("ttft_p99_s", "d_wait_mean_s", "d_iter_mean_s", "p_epoch_mean_s")
                        if k in s}
        fig(f"qwen3_p1{tag}_detail", extra)
        ok = all(f == 0 for f in fails.values())
        pools = kv_pools(bdir / "runs.jsonl")
        if pools:           # one process, a worker after another: the bench sizes the pool once (_BenchRun.pinned)
            check(f"qwen3_p1{tag}_kv_pool_one_for_all", len(set(pools.values())) == 1,
                  f"KV blocks per run {pools} (cache.num_blocks 0: the first run's pool, sized from the device)")
    check(f"qwen3_p1{tag}_bench_completes", ok)


def kv_pools(runs: Path) -> dict[str, int]:
    """The KV pool (blocks) of each run of a bench's ``runs.jsonl``, by its label."""
    if not runs.exists():
        return {}
    out = {}
    for line in runs.read_text().splitlines():
        r = json.loads(line)
        if "kv_total_blocks" in r.get("metrics", {}):
            out[r.get("label", str(len(out)))] = int(r["metrics"]["kv_total_blocks"])
    return out


def profiles(out: Path) -> None:
    """Top CUDA kernels of an eager Qwen3-shape decode step (B 64, ctx 2K), a 4K prefill and a
    continuation (diagnosis), then the FP8 model's 4K prefill (issue 37's prefill miss), all in one
    ``profiles.txt`` (a device run returns only a few files)."""
    (out / "profiles.txt").write_text("")
    _profile_model(out, {}, ("decode_b64_ctx2048", "prefill_4096", "continuation_575_on_1500"))
    _profile_model(out, {"model.quantization": "fp8"}, ("prefill_4096",), "fp8_")


def _profile_model(out: Path, extra: dict, names: tuple[str, ...], tag: str = "") -> None:
    from torch.profiler import ProfilerActivity, profile
    cfg = model_cfg("configs/qwen3-30b-a3b-shape.yaml", 64 * 2048 // 16 + 1024, extra)
    runner = ModelRunner(RunnerSections.from_config(cfg), DEV, KVCacheManager(cfg.cache.num_blocks, 16))
    dctx, pctx = PhaseContext(Phase.DECODE, None), PhaseContext(Phase.PREFILL, None)
    cases = {"decode_b64_ctx2048": lambda: (decode_fb(runner, 64, 2048), dctx),
             "prefill_4096": lambda: (prefill_fb(runner, 4096, 0), pctx),
             "continuation_575_on_1500": lambda: (prefill_fb(runner, 575, 1500), pctx)}
    with torch.inference_mode():
        for name in names:
            fb, ctx = cases[name]()
            name = tag + name
            for _ in range(2):
                fb.prefill_meta = None
                runner.forward_fb(fb, ctx)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fb.prefill_meta = None
                runner.forward_fb(fb, ctx)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
            with (out / "profiles.txt").open("a") as f:
                f.write(f"== profile {name}\n{table}\n")
            print(f"== profile {name}\n{table}", flush=True)
    release(runner)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="kernels,qwen3,fp8,paper,profile,smoke,nccl,spec,bench,mtp")
    ap.add_argument("--bench-conversations", type=int, default=24)
    ap.add_argument("--bench-token-scale", type=float, default=0.5)
    ap.add_argument("--bench-timeout", type=int, default=240)
    args = ap.parse_args()
    global OUT_DIR
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    OUT_DIR = out
    only = set(args.only.split(","))
    R["commit"] = args.commit
    R["machine"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    R["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw, peak = ceilings()
    if "kernels" in only:
        guarded("kernel_checks", kernel_checks)
    if "qwen3" in only:
        guarded("qwen3_figures", model_figures, "qwen3", "configs/qwen3-30b-a3b-shape.yaml", bw, peak, True)
        summarize_targets()
    if "fp8" in only:
        from _gate_fp8 import fp8_kernel_checks, summarize_fp8
        guarded("fp8_kernel_checks", fp8_kernel_checks, check, DEV)
        guarded("qwen3fp8_figures", model_figures, "qwen3fp8", "configs/qwen3-30b-a3b-shape.yaml", bw, peak, True,
                {"model.quantization": "fp8"})
        # the FP8 KV cache (cache.kv_dtype: fp8_e4m3): decode attention at 16K and the model's graphs on it
        from _gate_kv_fp8 import kv_fp8_attention_checks, kv_fp8_model_checks
        guarded("kv_fp8_attention_checks", kv_fp8_attention_checks, sys.modules[__name__], bw)
        guarded("qwen3fp8_kvfp8_model_checks", kv_fp8_model_checks, sys.modules[__name__], bw)
        summarize_fp8(R["figures"], target, fig)        # after both: the tokens/s with and without the FP8 KV cache
    if "paper" in only:
        guarded("paper_figures", model_figures, "paper", "configs/h200-bench.yaml", bw, peak, True)
    if "profile" in only:
        guarded("profiles", profiles, out)
    if "smoke" in only:
        guarded("cuda_smoke", smoke, out)
    if "nccl" in only:
        guarded("nccl_section", nccl, out)
    if "spec" in only:
        guarded("spec_section", spec, out)
    if "bench" in only:
        # the plain D loop, then the overlapped one (scheduler.overlap_decode's default, auto, runs it
        # under normal and fine-grained; mixed-chunked has its own loop)
        guarded("qwen3_p1_bench", bench, out, args, sets=("scheduler.overlap_decode=false",))
        guarded("qwen3_p1_overlap_bench", bench, out, args, tag="_overlap", policies="normal,fine-grained",
                sets=("scheduler.overlap_decode=true",))
    # the same cell on the FP8 model: makespan against the bf16 run above; `--only benchfp8` runs it alone (a
    # gate its time limit cut there resumes with `--only benchfp8,mtp`: the ratio to bf16 is then not computed)
    if ("bench" in only and "fp8" in only) or "benchfp8" in only:
        guarded("qwen3_p1_fp8_bench", bench, out, args, tag="_fp8", policies="normal,fine-grained",
                sets=("scheduler.overlap_decode=false", "model.quantization=fp8"))
        f = R["figures"]
        if "qwen3_p1_fp8_makespan_s" in f and "qwen3_p1_makespan_s" in f:
            ratio = {v: round(t / f["qwen3_p1_makespan_s"][v], 3) for v, t in f["qwen3_p1_fp8_makespan_s"].items()}
            fig("qwen3_p1_fp8_over_bf16_makespan", ratio)
            target("fp8_p1_makespan_le_0.75x_bf16", max(ratio.values()) <= 0.75, f"{ratio}")
    if "mtp" in only:
        guarded("mtp_section", mtp, out)
    R["wall_s"] = round(time.time() - t0, 1)
    save()
    n_fail = sum(not v for v in R["checks"].values())
    print(f"GATE {'PASS' if R['passed'] else 'FAIL'}: {len(R['checks']) - n_fail}/{len(R['checks'])} checks passed "
          f"in {R['wall_s']} s; commit {args.commit}", flush=True)
    sys.exit(0 if R["passed"] else 1)


if __name__ == "__main__":
    main()
