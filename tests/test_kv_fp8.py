"""The FP8 KV cache (``cache.kv_dtype: fp8_e4m3``, issue 37 item 4): a float8_e4m3fn pool with one
float32 scale per layer for K and one for V (static 1.0 in the engine, held in ``model.kv_scales``).

* the store / load round trip is within the e4m3 bound, with any scale;
* the KV capacity doubles (blocks for the same memory) and the pool is allocated in FP8;
* the torch reference path with an FP8 pool matches the model-dtype pool within a stated
  tolerance (tiny model: logits rel err <= 0.1, measured 0.05; the same greedy tokens);
* the Triton kernels (CPU interpreter) match the reference FP8 path: the prologue writes the
  same e4m3 bytes, decode (split KV) and varlen prefill within 1e-5 with non-unit scales, and the
  whole model's logits within 2e-4;
* the worker runs on it: prefix sharing, KV reuse of a continuation, routing replay, sleep / wake;
* a bad ``cache.kv_dtype`` is a typed error naming the key.
"""
from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.config import ConfigError, WorkerConfig
from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq, TorchAttention, paged_attention
from ainfer_pd.engine.attention.kv_fp8 import FP8_MAX, KV_FP8, dequantize_kv, quantize_kv
from ainfer_pd.engine.attention.plan import PrefillPlan
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.kv.residency import kv_block_bytes, kv_blocks_for_budget
from ainfer_pd.engine.model.rope import rope_cos_sin
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
from ainfer_pd.errors import UnsupportedOptionError
from ainfer_pd.phase import Phase, PhaseContext
from tests.conftest import rand_ids, tiny_cfg
from tests.test_paged_attention import dense_reference, make_case

FP8_KV = {"cache.kv_dtype": "fp8_e4m3"}
SCALES = torch.tensor([0.37, 2.9])        # K, V: non-unit and unequal, so a misplaced or swapped scale shows
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- config and format
def test_kv_dtype_config_and_typed_error():
    assert tiny_cfg().cache.kv_dtype == "auto"
    assert tiny_cfg(**FP8_KV).cache.kv_dtype == "fp8_e4m3"
    for bad in ("fp8_e5m2", "int8", "bfloat16"):
        with pytest.raises(UnsupportedOptionError) as e:
            tiny_cfg(**{"cache.kv_dtype": bad})
        assert isinstance(e.value, ConfigError) and e.value.key == "cache.kv_dtype" and "cache.kv_dtype" in str(e.value)
    with pytest.raises(ConfigError, match="cache.kv_dtype"):
        WorkerConfig.from_dict({"cache": {"kv_dtype": "fp4"}})


def test_round_trip_within_the_e4m3_bound():
    """Normal range (|x / s| in [2^-6, 448]): relative error <= 2^-4 (3 mantissa bits, nearest
    even); below it, absolute <= 2^-10 s (half the subnormal step); past 448 s: saturated."""
    x = torch.randn(4096) * torch.logspace(-3, 2.5, 4096)
    for s in (1.0, 0.37, 2.9):
        st = torch.tensor(s)
        y = dequantize_kv(quantize_kv(x, st), st, torch.float32)
        u = (x / s).abs()
        normal = (u >= 2 ** -6) & (u <= FP8_MAX)
        assert ((y - x).abs() / x.abs())[normal].max() <= 2 ** -4
        assert (y - x).abs()[u < 2 ** -6].max() <= 2 ** -10 * s
        assert torch.all(y[u > FP8_MAX].abs() == FP8_MAX * st)
    assert quantize_kv(torch.tensor([1e6, -1e6]), torch.tensor(1.0)).float().tolist() == [448.0, -448.0]


def test_capacity_doubles_and_the_pool_is_fp8():
    bf16 = tiny_cfg(**{"model.dtype": "bfloat16"})
    fp8 = tiny_cfg(**{"model.dtype": "bfloat16", **FP8_KV})
    assert kv_block_bytes(bf16) == 2 * kv_block_bytes(fp8)
    assert kv_block_bytes(tiny_cfg()) == 4 * kv_block_bytes(tiny_cfg(**FP8_KV))          # fp32 model: 4x
    args = dict(total_bytes=80 << 30, utilization=0.9, weight_bytes=20 << 30, reserve_bytes=2 << 30)
    n16 = kv_blocks_for_budget(block_bytes=kv_block_bytes(bf16), **args)
    n8 = kv_blocks_for_budget(block_bytes=kv_block_bytes(fp8), **args)
    assert n8 in (2 * n16, 2 * n16 + 1)
    pools = {}
    for name, c in (("bf16", bf16), ("fp8", fp8)):
        r = ModelRunner(RunnerSections.from_config(c.replace(**{"model.num_layers": 2})), CPU, KVCacheManager(32, 16))
        pools[name] = r.kv_cache
        if name == "fp8":
            assert r.kv_cache.dtype == KV_FP8 and r.kv_cache.element_size() == 1
            assert r.model.kv_scales.shape == (2, 2) and bool((r.model.kv_scales == 1.0).all())
            assert r.model.kv_scales[1].data_ptr() - r.model.kv_scales[0].data_ptr() == 16   # 16-byte aligned rows
        else:
            assert r.kv_cache.dtype == torch.bfloat16 and r.model.kv_scales is None
    assert pools["fp8"].shape == pools["bf16"].shape
    assert pools["bf16"].nbytes == 2 * pools["fp8"].nbytes


# ---------------------------------------------------------------------------- kernels
def _fp8_case(seed, seqs, dec, H=8, Hk=2, hd=16):
    """make_case (tests/test_paged_attention.py) with its pool quantized with SCALES."""
    fb, q, kn, vn, kv, refs = make_case(seed, seqs, dec, H, Hk, hd)
    kv8 = torch.stack([quantize_kv(kv[0], SCALES[0]), quantize_kv(kv[1], SCALES[1])])
    return fb, q, kn, vn, kv8, refs


@pytest.mark.parametrize("name,seqs,dec,be", [
    ("mixed", [(0, 6), (9, 2)], [3, 22, 8], {}),
    ("decode-split", [], [2, 40, 61], {"decode_overrides": {"block_n": 16, "split_keys": 16}}),
    ("prefill-tiles", [(0, 37), (50, 5)], [], {"prefill_override": PrefillPlan(16, 16, 4, 1)}),
])
def test_triton_kernels_match_reference_on_fp8_pool(name, seqs, dec, be):
    """Both backends on the same FP8 pool with non-unit scales: each within 1e-5 of the float64
    dense attention over the dequantized keys and values (the new tokens' K/V quantized too)."""
    outs = {}
    for bname, backend in (("torch", TorchAttention()), ("triton", TritonAttention(CPU, **be))):
        fb, q, kn, vn, kv8, refs = _fp8_case(7, seqs, dec)
        outs[bname] = paged_attention(q, kn, vn, kv8, fb, backend, kv_scale=SCALES)
        keys, vals = dequantize_kv(kv8[0], SCALES[0], torch.float64), dequantize_kv(kv8[1], SCALES[1], torch.float64)
        for (t, n, cached, slots) in refs:
            ref = dense_reference(q[t:t + n], keys[slots], vals[slots], cached)
            assert (outs[bname][t:t + n].double() - ref).abs().max() < 1e-5, (bname, t)
    assert torch.allclose(outs["triton"], outs["torch"], atol=1e-5)


@pytest.mark.parametrize("name,seqs,dec,be", [
    ("decode-split", [], [2, 40, 61], {"decode_overrides": {"block_n": 16, "split_keys": 16}}),
    ("prefill-tiles", [(0, 37), (50, 5)], [], {"prefill_override": PrefillPlan(16, 16, 4, 1)}),
])
@pytest.mark.parametrize("q_scale", [1.0, 2.0 ** 22])
def test_bf16_queries_on_an_fp8_pool_run_the_float16_mma(name, seqs, dec, be, q_scale):
    """bfloat16 queries on an FP8 pool: the kernels widen e4m3 to float16 and read the query tile
    in float16 scaled by a power of two (``_mma_query``). Within bfloat16's rounding of the float64
    attention over the same bfloat16 queries and dequantized keys and values, also for queries
    past float16's range (x 2^22, up to ~3e5: unscaled, float16 would turn them into inf and the output NaN)."""
    fb, q, kn, vn, kv8, refs = _fp8_case(11, seqs, dec)
    q = (q * q_scale / 64).to(torch.bfloat16)            # / 64: the scores stay O(1) at q_scale 1
    kv_scale = SCALES / torch.tensor([q_scale, 1.0])     # the same scores at every q_scale
    out = paged_attention(q, kn.to(torch.bfloat16), vn.to(torch.bfloat16), kv8, fb, TritonAttention(CPU, **be),
                          kv_scale=kv_scale)
    keys, vals = dequantize_kv(kv8[0], kv_scale[0], torch.float64), dequantize_kv(kv8[1], kv_scale[1], torch.float64)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    for (t, n, cached, slots) in refs:
        ref = dense_reference(q[t:t + n].double(), keys[slots], vals[slots], cached)
        err = (out[t:t + n].double() - ref).abs().max().item()
        assert err < 2e-2 * ref.abs().max().item(), (t, err)


def test_triton_prologue_writes_the_reference_bytes():
    """QK-norm + RoPE + K/V quantized into an FP8 pool: the same e4m3 bytes as the torch path
    (at most one e4m3 step on a rounding tie of the float32 rotation), only the batch's slots."""
    T, H, Hk, hd, S = 6, 4, 2, 16, 40
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * Hk) * hd, generator=g) * 3
    qw, kw = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    rope = rope_cos_sin(torch.tensor([0, 3, 9, 10, 31, 2]), hd, 10000.0, torch.float32)
    slots = torch.tensor([7, 0, 33, 12, 5, 21])
    outs = []
    for be in (TritonAttention(CPU), TorchAttention()):
        q, k, v = qkv.clone().split([H * hd, Hk * hd, Hk * hd], dim=-1)
        kv = torch.zeros(2, S, Hk, hd, dtype=KV_FP8)
        outs.append((be.prologue(q.view(T, H, hd), k.view(T, Hk, hd), v.view(T, Hk, hd), qw, kw, 1e-6, rope, kv,
                                 slots, kv_scale=SCALES), kv.view(torch.uint8).int()))
    (qt, kt), (qr, kr) = outs
    assert torch.allclose(qt, qr, atol=1e-5)
    steps = (kt - kr).abs()
    assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= 2, int((steps > 0).sum())
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert (kt[:, untouched] == 0).all() and (kt[:, slots] != 0).any()


def test_fp8_pool_without_scales_is_refused():
    fb, q, kn, vn, kv8, _ = _fp8_case(1, [], [5])
    for be in (TorchAttention(), TritonAttention(CPU)):
        with pytest.raises(ValueError, match="scale"):
            paged_attention(q, kn, vn, kv8, fb, be)


# ---------------------------------------------------------------------------- the model
def _passes(runner, steps: int) -> torch.Tensor:
    """A 40-token prefill, then ``steps`` decode steps of fixed tokens; every pass's logits."""
    g = torch.Generator().manual_seed(0)
    n, bs = 40, 16
    blocks = torch.arange(4)
    ids = torch.randint(2, 512, (n,), generator=g)
    fbs = [ForwardBatch(ids, torch.arange(n), torch.arange(n), [PrefillSeq(0, n, n, block_ids=blocks)], None,
                        torch.tensor([n - 1]), block_size=bs)]
    for s in range(steps):
        L = n + s + 1
        fbs.append(ForwardBatch(torch.tensor([(37 * s + 11) % 500 + 2]), torch.tensor([L - 1]), torch.tensor([L - 1]),
                                [], DecodeMeta(None, torch.tensor([L]), block_table=blocks[None], block_size=bs),
                                torch.tensor([0]), block_size=bs))
    with torch.inference_mode():
        return torch.cat([runner.forward_fb(fb, PhaseContext(Phase.DECODE if fb.decode else Phase.PREFILL, None))
                          for fb in fbs])


def _runner(layers: int, attn: str, **kw) -> ModelRunner:
    cfg = tiny_cfg(**{"model.num_layers": layers, "cache.num_blocks": 16, "device.attention_backend": attn,
                      "device.moe_backend": "torch", **kw})
    return ModelRunner(RunnerSections.from_config(cfg), CPU, KVCacheManager(16, 16))


def test_reference_fp8_kv_matches_model_dtype_kv():
    """The tiny model (fp32, 4 layers, K / V magnitudes up to ~4): a prefill and 6 decode steps
    over an FP8 pool against the fp32 pool: logits rel err <= 0.1 (measured 0.05; e4m3 keeps 3
    mantissa bits: ~3.6% rms per element), the same greedy token at every step."""
    ref = _passes(_runner(4, "torch"), 6)
    r8 = _runner(4, "torch", **FP8_KV)
    out = _passes(r8, 6)
    err = float((out - ref).norm() / ref.norm())
    assert err <= 0.1, err
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    lp = (out.log_softmax(-1) - ref.log_softmax(-1)).abs()
    assert float(lp.max()) <= 1.0
    assert r8.kv_cache.dtype == KV_FP8 and (r8.kv_cache[:, :, :46].view(torch.uint8) != 0).any()


def test_triton_model_on_fp8_kv_matches_reference_fp8_kv():
    """The whole model (2 layers) with the Triton attention backend over an FP8 pool: the
    torch reference path's logits on the same FP8 pool (the same bytes written)."""
    r_ref, r_tri = _runner(2, "torch", **FP8_KV), _runner(2, "triton", **FP8_KV)
    a, b = _passes(r_ref, 2), _passes(r_tri, 2)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.equal(r_ref.kv_cache.view(torch.uint8), r_tri.kv_cache.view(torch.uint8))


# ---------------------------------------------------------------------------- the worker
GREEDY = dict(temperature=0.0, ignore_eos=True)


async def test_worker_on_fp8_kv_shares_prefixes_reuses_kv_replays_routing_and_sleeps():
    cfg = tiny_cfg(**{"cache.num_blocks": 128, "cache.routed_experts": True, **FP8_KV})
    rng = random.Random(4)
    prompt = rand_ids(rng, 40)
    obs = rand_ids(rng, 9)
    sp = SamplingParams(max_new_tokens=4, return_routed_experts=True, **GREEDY)

    async def turns(w):
        a, b = await asyncio.gather(w.generate(prompt, sp), w.generate(prompt, sp))     # GRPO siblings
        c = await w.continue_(a.trajectory_id, obs, sp)
        for o in (a, b):
            await w.release(o.trajectory_id)
        return a, b, c

    async with RolloutWorker(cfg) as w:
        assert w.engine.runner.kv_cache.dtype == KV_FP8
        scales = w.engine.runner.model.kv_scales
        a, b, c = await turns(w)
        assert a.token_ids == b.token_ids
        assert max(a.num_cached_tokens, b.num_cached_tokens) >= 32            # a sibling's prefix blocks shared
        assert c.num_cached_tokens >= len(prompt)                            # the continuation reused its KV
        assert a.routed_experts is not None and len(a.routed_experts) > 0
        await w.sleep(1)
        assert w.engine.runner.kv_cache is None
        await w.wake_up()
        assert w.engine.runner.kv_cache.dtype == KV_FP8 and w.engine.runner.model.kv_scales is scales
        a2, b2, c2 = await turns(w)
        assert (a2.token_ids, b2.token_ids, c2.token_ids, c2.logprobs) == (a.token_ids, b.token_ids, c.token_ids,
                                                                           c.logprobs)
        assert w.kv_leak_free()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from Linux's /proc")
def test_a_cpu_pool_is_zero_writable_and_owns_its_memory():
    """The CPU pool is anonymous memory (zero until written, so an untouched pool costs no fill):
    zero in both formats, the shape and dtype asked for, writable through any view, and its pages
    live as long as a view of it does."""
    import gc

    from ainfer_pd.engine.attention.kv_fp8 import new_kv_pool
    pool = new_kv_pool((3, 2, 64, 2, 8), "auto", torch.float32, "cpu")
    assert pool.shape == (3, 2, 64, 2, 8) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.count_nonzero() == 0
    pool[1, 0, 5] = 3.0
    flat = pool.view(-1)
    del pool
    gc.collect()
    churn = [torch.randn(1 << 16) for _ in range(64)]           # reuse of freed memory would show
    assert flat.sum().item() == 3.0 * 2 * 8 and len(churn) == 64
    fp8 = new_kv_pool((2, 2, 16, 1, 16), "fp8_e4m3", torch.bfloat16, "cpu")
    assert fp8.dtype == KV_FP8 and fp8.float().count_nonzero() == 0

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = resident()
    big = new_kv_pool((4, 2, 4096 * 16, 2, 32), "auto", torch.float32, "cpu")    # the tiny config's 268 MB
    big[2, 1, 100] = 1.0                                                           # one page touched
    assert resident() - before < (32 << 20), "the pool was filled at allocation"
