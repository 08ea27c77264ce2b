"""The GPU gate's FP8 KV cache part (issue 37 item 4, ``cache.kv_dtype: fp8_e4m3``): run in
``gpu_gate.py``'s fp8 section, after the FP8 model's figures (that model is released first).

The pool is float8_e4m3fn with one float32 scale per layer for K and one for V (static 1.0 in
the engine, read by the kernels from a small device tensor: ``engine/attention/kv_fp8.py``).

(a) ``kv_fp8_attention_checks``: the paged decode kernel at the Qwen3-30B-A3B attention shape
    (H 32, Hk 4, hd 128), B = 64 rows of 16,384 keys each:
    * over an FP8 pool (the bf16 pool's values quantized with the engine's scales) against the
      same kernel over the bf16 pool: rel err <= 6e-2 and max abs err <= 1e-2 (the e4m3 rounding
      itself: 3.9e-2 rel and 2.4e-3 max abs on the CPU reference at B 4, for N(0, 1) K / V);
    * against float64 attention over the dequantized pool (4 rows): the gate's bf16 rule, rel err
      <= min(2e-2, 2x the torch reference path's + 1e-3);
    * replayed in a CUDA graph equal to eager, and a replay after the scales are rewritten in
      place equal to eager with the new scales (the graph reads them at replay);
    * time, eager and replayed, against the FP8 KV bytes bound (K + V at 1 byte, q and out in
      bf16): target <= 1.5x (``kv_fp8_decode_attention_b64_l16384_le_1.5x``), the bf16 pool's beside.
(b) ``kv_fp8_model_checks``: the Qwen3-30B-A3B-shape FP8 model (random init quantized at load)
    over an FP8 pool: the pool's dtype and scales, every decode bucket captured, graph replay
    equal to eager at B 64 ctx 2K and B 16 ctx 16K (with the decode iteration's time against its
    bound, KV at 1 byte), P graphs equal to eager; and, on the same weights with P graphs off, the
    logits of a 2,000-token prefill and 4 decode steps over the FP8 pool against a bf16 pool
    (a figure: rel err, argmax agreement, |logprob difference| of the bf16 argmax).

Both take ``gate``, the ``gpu_gate`` module (check / fig / target, bench_ms, the batch builders
and ``release``), and ``bw``, the measured HBM copy bandwidth (bytes/s).
"""
from __future__ import annotations

import time

import torch

from _cuda_timing import graph_of
from _gate_cases import dense_attention, rel_err, uniform_decode
from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq, TorchAttention
from ainfer_pd.engine.attention.kv_fp8 import KV_FP8, gather_kv, new_kv_scales, quantize_kv
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
from ainfer_pd.phase import Phase, PhaseContext

H, HK, HD = 32, 4, 128               # the Qwen3-30B-A3B attention shape
B, L = 64, 16384
DTYPE = torch.bfloat16               # the model dtype: q, out and the pool compared against
REL_TOL, ABS_TOL = 6e-2, 1e-2        # FP8 pool against the bf16 pool
CFG = "configs/qwen3-30b-a3b-shape.yaml"


def _rows(fb: ForwardBatch, n: int) -> ForwardBatch:
    """The first n decode rows of ``fb``."""
    d = fb.decode
    return ForwardBatch(fb.input_ids[:n], fb.positions[:n], fb.write_slots[:n], [],
                        DecodeMeta(None, d.ctx_lens[:n], block_table=d.block_table[:n], block_size=d.block_size),
                        None, block_size=fb.block_size)


def kv_fp8_attention_checks(gate, bw: float) -> None:
    _attention_checks(gate, bw)
    torch.cuda.empty_cache()                  # the pools and graphs went with the helper's frame


def _attention_checks(gate, bw: float) -> None:
    dev = gate.DEV
    tri, ref = TritonAttention(dev), TorchAttention()
    fb, q, kc, vc = uniform_decode(B, L, H, HK, HD, DTYPE, dev)
    scales = new_kv_scales(1, dev)[0]                         # the engine's: [K, V] = 1.0
    k8, v8 = quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])
    o16 = tri.decode(q, kc, vc, fb)
    o8 = tri.decode(q, k8, v8, fb, kv_scale=scales)
    torch.cuda.synchronize()
    err, mabs = rel_err(o8, o16), float((o8.float() - o16.float()).abs().max())
    gate.check(f"kv_fp8_decode_vs_bf16_kv_b{B}_l{L}", err <= REL_TOL and mabs <= ABS_TOL,
               f"rel err {err:.2e} (bound {REL_TOL:.0e}), max abs err {mabs:.2e} (bound {ABS_TOL:.0e}; "
               f"|out| max {float(o16.abs().max()):.2e})")
    # against float64 attention over the dequantized pool, beside the torch reference path's own error
    n = min(4, B)
    sub = _rows(fb, n)
    o_ref = ref.decode(q[:n], k8, v8, sub, kv_scale=scales)
    sub.decode.resolve()
    worst = worst_ref = 0.0
    for j in range(n):
        slots = sub.decode.key_slots[j, :L]
        keys = gather_kv(k8, slots, scales[0], torch.float64)
        vals = gather_kv(v8, slots, scales[1], torch.float64)
        d = dense_attention(q[j:j + 1], keys, vals, L - 1)
        worst = max(worst, rel_err(o8[j:j + 1], d))
        worst_ref = max(worst_ref, rel_err(o_ref[j:j + 1], d))
        del keys, vals
    bound = min(2e-2, 2 * worst_ref + 1e-3)
    gate.check(f"kv_fp8_decode_matches_dense_l{L}", worst <= bound,
               f"rel err {worst:.2e} (torch path {worst_ref:.2e}, bound {bound:.1e})")
    # a CUDA graph replays the eager result and reads the scales at replay
    box = {}
    g = graph_of(lambda: box.__setitem__("o", tri.decode(q, k8, v8, fb, kv_scale=scales)))
    g.replay()
    torch.cuda.synchronize()
    gate.check("kv_fp8_decode_graph_equals_eager", torch.equal(box["o"], o8))
    scales.copy_(torch.tensor([0.5, 3.0], device=dev))
    g.replay()
    eager = tri.decode(q, k8, v8, fb, kv_scale=scales)
    torch.cuda.synchronize()
    gate.check("kv_fp8_decode_graph_reads_scales_at_replay", torch.equal(box["o"], eager) and not torch.equal(eager, o8))
    scales.fill_(1.0)
    # time against the KV bytes bound, the bf16 pool's beside
    io = 2 * B * H * HD * 2
    row = {}
    for name, (kk, vv, ks, nbytes) in {"fp8": (k8, v8, scales, 1), "bf16": (kc, vc, None, 2)}.items():
        def step(kk=kk, vv=vv, ks=ks):
            return tri.decode(q, kk, vv, fb, kv_scale=ks)
        t_e = gate.bench_ms(step)
        gg = graph_of(step)
        t_g = gate.bench_ms(gg.replay)
        bound_ms = (2 * B * L * HK * HD * nbytes + io) / bw * 1e3
        row[name] = {"eager_ms": round(t_e, 4), "graph_ms": round(t_g, 4), "bound_ms": round(bound_ms, 4),
                     "eager_ratio": round(t_e / bound_ms, 3), "graph_ratio": round(t_g / bound_ms, 3)}
        del gg
    row["fp8_speedup_over_bf16"] = round(row["bf16"]["graph_ms"] / row["fp8"]["graph_ms"], 3)
    gate.fig(f"kv_fp8_decode_attention_b{B}_l{L}", row)
    worst_ratio = max(row["fp8"]["eager_ratio"], row["fp8"]["graph_ratio"])
    gate.target(f"kv_fp8_decode_attention_b{B}_l{L}_le_1.5x", worst_ratio <= 1.5,
                f"{row['fp8']['graph_ms']} ms replayed ({row['fp8']['eager_ms']} eager) vs FP8 KV bytes bound "
                f"{row['fp8']['bound_ms']} ms: {worst_ratio:.2f}x; bf16 pool {row['bf16']['graph_ms']} ms")


def _seq_passes(runner, n: int, steps: int) -> torch.Tensor:
    """Eager: an n-token prefill over blocks 0.., then ``steps`` decode steps of fixed tokens; the
    logits of every pass [1 + steps, V] (slots below (n + steps) rounded up to a block only)."""
    dev, bs = runner.device, runner.kv.block_size
    blocks = torch.arange(-(-(n + steps) // bs))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, runner.sections.model.vocab_size, (n + steps,), generator=g)
    pos = torch.arange(n, device=dev)
    out = [runner.forward_fb(ForwardBatch(ids[:n].to(dev), pos, pos.clone(), [PrefillSeq(0, n, n, block_ids=blocks)],
                                          None, torch.tensor([n - 1], device=dev), block_size=bs),
                             PhaseContext(Phase.PREFILL, None))]
    for s in range(steps):
        p = torch.tensor([n + s], device=dev)
        d = DecodeMeta(None, p + 1, block_table=blocks[None].to(dev), block_size=bs)
        out.append(runner.forward_fb(ForwardBatch(ids[n + s:n + s + 1].to(dev), p, p.clone(), [], d,
                                                  torch.zeros(1, dtype=torch.int64, device=dev), block_size=bs),
                                     PhaseContext(Phase.DECODE, None)))
    return torch.cat(out)


def _against_bf16_pool(gate, runner) -> None:
    """The same weights over an FP8 and a bf16 pool (P graphs off: they were captured on the FP8 pool)."""
    n, steps = 2000, 4
    pg, pool8, scales = runner.pgraphs, runner.kv_cache, runner.model.kv_scales
    runner.pgraphs = None
    try:
        lg8 = _seq_passes(runner, n, steps)
        nslots = (-(-(n + steps) // runner.kv.block_size) + 1) * runner.kv.block_size
        runner.kv_cache = torch.zeros(*pool8.shape[:2], nslots, *pool8.shape[3:], dtype=runner.sections.model.torch_dtype,
                                      device=pool8.device)            # the model dtype's pool (bf16)
        runner.model.kv_scales = None
        lg16 = _seq_passes(runner, n, steps)
    finally:
        runner.pgraphs, runner.kv_cache, runner.model.kv_scales = pg, pool8, scales
    top = lg16.argmax(-1)
    dlp = (lg8.log_softmax(-1) - lg16.log_softmax(-1)).gather(1, top[:, None]).abs().squeeze(1)
    finite = bool(torch.isfinite(lg8).all())
    gate.check("qwen3fp8_kvfp8_logits_finite", finite)
    gate.fig("qwen3fp8_kvfp8_vs_bf16kv_logits", {
        "passes": f"prefill {n} + {steps} decode steps",
        "rel_err": [round(rel_err(a, b), 4) for a, b in zip(lg8, lg16, strict=True)],
        "argmax_agree": round(float((lg8.argmax(-1) == top).float().mean()), 3),
        "abs_dlogprob_of_bf16_argmax": [round(float(x), 4) for x in dlp]})


def kv_fp8_model_checks(gate, bw: float) -> None:
    dev = gate.DEV
    num_blocks = max(64 * 2048, 16 * 16384) // 16 + 1024
    cfg = gate.model_cfg(CFG, num_blocks, {"model.quantization": "fp8", "cache.kv_dtype": "fp8_e4m3"})
    mc = cfg.model
    t0 = time.time()
    runner = ModelRunner(RunnerSections.from_config(cfg), dev, KVCacheManager(num_blocks, 16))
    sc = runner.model.kv_scales
    gate.check("qwen3fp8_kvfp8_pool_is_fp8", runner.kv_cache.dtype == KV_FP8 and sc is not None
               and tuple(sc.shape) == (mc.num_layers, 2),
               f"pool {runner.kv_cache.dtype}, {runner.kv_cache.nbytes / 2**30:.1f} GiB for {num_blocks} blocks")
    for i in range(mc.num_layers):          # random KV (no float8 normal_): e4m3 of N(0, 1), a layer at a time
        runner.kv_cache[i].copy_(torch.randn(runner.kv_cache[i].shape, device=dev, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    gate.fig("qwen3fp8_kvfp8_model_build_s", round(time.time() - t0, 1))
    attn_b, exp_b, eh_b = gate.weight_bytes(runner.model)
    kv_tok = gate.kv_token_bytes(mc, elem_bytes=1)
    dctx, pctx = PhaseContext(Phase.DECODE, None), PhaseContext(Phase.PREFILL, None)
    with torch.inference_mode():
        gate.capture_graphs(runner, cfg, "qwen3fp8_kvfp8", dctx, pctx)
        for Bq, C in ((64, 2048), (128, 2048), (16, 16384)):
            fb = gate.decode_fb(runner, Bq, C, seed=Bq)
            r0 = runner.graphs.num_replays
            glog = runner.graphs.try_run(fb)
            replayed = glog is not None and runner.graphs.num_replays == r0 + 1
            eager = runner.forward_fb(gate.decode_fb(runner, Bq, C, seed=Bq), dctx)
            agree = float((glog.argmax(-1) == eager.argmax(-1)).float().mean()) if replayed else 0.0
            err = rel_err(glog, eager) if replayed else float("inf")
            gate.check(f"qwen3fp8_kvfp8_graph_decode_equals_eager_b{Bq}_l{C}", replayed and agree >= 0.95 and err < 2e-2,
                       f"{'replayed' if replayed else 'NOT replayed'}, argmax agreement {agree:.3f}, "
                       f"logits rel err {err:.2e}")
            if not replayed:
                continue
            touched = gate.touched_experts(runner, gate.decode_fb(runner, Bq, C, seed=Bq))
            bound = (attn_b + touched * exp_b + Bq * C * kv_tok + eh_b + Bq * mc.hidden_size * 2) / bw
            t_graph = gate.bench_ms(runner.graphs.graphs[runner.graphs.bucket(Bq, C)][0].replay, 300)
            gate.fig(f"qwen3fp8_kvfp8_decode_iteration_b{Bq}_l{C}",
                     {"graph_ms": round(t_graph, 3), "bound_ms": round(bound * 1e3, 3),
                      "ratio": round(t_graph / (bound * 1e3), 3)})
        pg = runner.pgraphs
        gate.check("qwen3fp8_kvfp8_prefill_graphs_captured", pg is not None and len(pg.graphs) > 0,
                   f"{len(pg.graphs) if pg else 0} token buckets; refusal: {runner.prefill_graphs_refusal()}")
        if pg is not None:
            for n_, cached in ((575, 1500), (2000, 100)):
                r0 = pg.num_replays
                glog = runner.forward_fb(gate.prefill_fb(runner, n_, cached, seed=n_), pctx)
                replayed = pg.num_replays == r0 + 1
                runner.pgraphs = None
                eager = runner.forward_fb(gate.prefill_fb(runner, n_, cached, seed=n_), pctx)
                runner.pgraphs = pg
                err = rel_err(glog, eager)
                gate.check(f"qwen3fp8_kvfp8_prefill_graph_equals_eager_{n_}_on_{cached}", replayed and err < 2e-2,
                           f"{'replayed' if replayed else 'NOT replayed'}, logits rel err {err:.2e}")
        _against_bf16_pool(gate, runner)
    gate.release(runner)
