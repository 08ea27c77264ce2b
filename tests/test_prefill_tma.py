"""The TMA prefill kernel (``engine/attention/triton_prefill_tma.py``: a pass's own keys and values
through tensor descriptors, the cached prefix through the block table), in the interpreter:

* the kernel against the dense reference over strided q / k / v views of one fused QKV tensor
  (fresh prompts and cached prefixes, sequences shorter and longer than a tile, GQA);
* the backend's prefill with the pass's own K/V equals its paged path and takes the TMA launch
  only on a 16-bit pool (never on an FP8 one), and reads the own K/V (not the pool's copy);
* the QKV prologue with ``keep_k`` leaves K roped as written into the pool (else untouched);
* a tiny model's prefill pass with the TMA plan forced equals the same pass on the paged kernel;
* the plan: the long tile takes TMA only where the device has it, on a 16-bit pool.
"""
import pytest
import torch

import ainfer_pd.engine.attention.triton_backend as tb
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq, TorchAttention, attend
from ainfer_pd.engine.attention.kv_fp8 import quantize_kv, store_kv
from ainfer_pd.engine.attention.plan import LONG_PREFILL_TOKENS, TMA_PREFILL_TOKENS, PrefillPlan, prefill_plan
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from ainfer_pd.engine.attention.triton_prefill_tma import prefill_tma, tma_layout_ok
from ainfer_pd.engine.model.rope import rope_cos_sin
from tests.test_paged_attention import dense_reference, make_case

CPU = torch.device("cpu")
TMA16 = PrefillPlan(16, 16, 4, 1, own_keys_tma=True)


def fused_views(q, k, v):
    """q [T, H, hd], k / v [T, Hk, hd] copied into one [T, (H + 2 Hk) hd] tensor (the QKV projection's
    output) and returned as its strided views, as the model hands them over."""
    T, H, hd = q.shape
    Hk = k.shape[1]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1)
    return qs.view(T, H, hd), ks.view(T, Hk, hd), vs.view(T, Hk, hd)


@pytest.fixture
def tma_calls(monkeypatch):
    """The backend's TMA launches, counted (each still runs)."""
    calls = []

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return prefill_tma(*a, **kw)
    monkeypatch.setattr(tb, "prefill_tma", counted)
    return calls


@pytest.mark.parametrize("seqs,bm,bn,H,Hk", [
    ([(0, 37), (0, 5), (0, 20)], 16, 16, 4, 2),
    ([(0, 40), (9, 13), (30, 17)], 16, 8, 8, 2),
    ([(6, 33), (0, 16)], 32, 16, 4, 4),
], ids=["fresh", "cached-prefix", "one-head-a-group"])
def test_prefill_tma_on_strided_views_matches_dense(seqs, bm, bn, H, Hk):
    fb, q, knew, vnew, kv, refs = make_case(3, seqs, [], H, Hk, 16, num_blocks=96)
    kv[0][fb.write_slots] = knew          # the pass's keys, in the pool as the engine writes them
    kv[1][fb.write_slots] = vnew
    qs, ks, vs = fused_views(q, knew, vnew)
    assert qs.stride(0) == ks.stride(0) == (H + 2 * Hk) * 16 and not ks.is_contiguous()
    assert all(map(tma_layout_ok, (qs, ks, vs)))
    out = torch.full_like(q, float("nan"))
    prefill_tma(qs, ks, vs, kv[0], kv[1], fb, out, PrefillPlan(bm, bn, 4, 1, own_keys_tma=True))
    for t, n, cached, slots in refs:
        ref = dense_reference(q[t:t + n], kv[0][slots], kv[1][slots], cached)
        assert (out[t:t + n].double() - ref).abs().max().item() < 1e-5, (t, n, cached)


# 16-bit: float16 (the interpreter's bfloat16 dots are wrong, for the paged kernel too)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
@pytest.mark.parametrize("decode", [[], [5, 20]], ids=["prefill", "mixed"])
def test_backend_prefill_with_own_kv_equals_its_paged_path(tma_calls, dtype, tol, decode):
    """The same inputs through the backend with the pass's own K/V (the TMA launch) and without (the
    paged kernel): equal within the dtype's tolerance, mixed batches (decode rows after the prefill
    rows) included. Own keys that differ from the pool's change the output: the launch reads them."""
    be = TritonAttention(CPU, prefill_override=TMA16, tma=True)
    fb, q, kn, vn, kv, refs = make_case(5, [(0, 37), (20, 9), (3, 16)], decode, 4, 2, 16, num_blocks=96)
    q, kn, vn, kv = q.to(dtype), kn.to(dtype), vn.to(dtype), kv.to(dtype)
    kv[0][fb.write_slots], kv[1][fb.write_slots] = kn, vn
    qs, ks, vs = fused_views(q, kn, vn)
    n_p = fb.num_prefill_tokens
    outs = []
    for own in ((ks, vs), None):
        fb.prefill_meta = None
        out = torch.zeros_like(q)
        be.prefill(qs, kv[0], kv[1], fb, out, own_kv=own)
        outs.append(out)
    assert tma_calls == [q.shape[0]]                         # the own K/V took the TMA launch, once
    assert (outs[0][:n_p].float() - outs[1][:n_p].float()).abs().max().item() < tol
    for t, n, cached, slots in refs[:len(fb.prefill)]:
        ref = dense_reference(q[t:t + n], kv[0][slots], kv[1][slots], cached)
        assert (outs[0][t:t + n].double() - ref).abs().max().item() < tol
    # attend() hands fb.own_kv over (and clears it); altered own keys alter the rows that read them
    fb.own_kv = (ks, vs * 2)
    full = attend(qs, kv, fb, be)
    assert fb.own_kv is None and len(tma_calls) == 2
    assert (full[:n_p] - outs[0][:n_p]).abs().max().item() > 0.1
    fb.own_kv = (ks, vs)
    assert torch.equal(attend(qs, kv, fb, be)[:n_p], outs[0][:n_p])


def test_fp8_pool_never_takes_the_tma_path(tma_calls):
    be = TritonAttention(CPU, prefill_override=TMA16, tma=True)
    fb, q, kn, vn, kv, _ = make_case(6, [(0, 37), (9, 13)], [], 4, 2, 16, num_blocks=96)
    scales = torch.tensor([0.05, 0.04])
    kv8 = torch.stack([quantize_kv(kv[0], scales[0]), quantize_kv(kv[1], scales[1])])
    store_kv(kv8[0], fb.write_slots, kn, scales[0])
    store_kv(kv8[1], fb.write_slots, vn, scales[1])
    outs = []
    for own in ((kn, vn), None):
        out = torch.zeros_like(q)
        be.prefill(q, kv8[0], kv8[1], fb, out, kv_scale=scales, own_kv=own)
        outs.append(out)
    assert tma_calls == [] and torch.equal(outs[0], outs[1])
    assert not be.reads_own_kv(64, torch.bfloat16, 16, kv_fp8=True)
    assert be.reads_own_kv(64, torch.bfloat16, 16, kv_fp8=False)


@pytest.mark.parametrize("fp8", [False, True])
def test_prologue_keeps_the_roped_keys_when_asked(fp8):
    T, H, Hk, hd, S = 5, 4, 2, 16, 40
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * Hk) * hd, generator=g)
    qw, kw = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    rope = rope_cos_sin(torch.tensor([0, 3, 9, 10, 31]), hd, 10000.0, torch.float32)
    slots = torch.tensor([7, 0, 33, 12, 5])
    scale = torch.tensor([0.05, 0.04]) if fp8 else None
    kept = {}
    for be in (TritonAttention(CPU), TorchAttention()):
        for keep in (False, True):
            x = qkv.clone()
            q, k, v = (t.unflatten(-1, (-1, hd)) for t in x.split([H * hd, Hk * hd, Hk * hd], dim=-1))
            kv = torch.zeros(2, S, Hk, hd, dtype=torch.float8_e4m3fn if fp8 else torch.float32)
            be.prologue(q, k, v, qw, kw, 1e-6, rope, kv, slots, kv_scale=scale, keep_k=keep)
            if not keep:
                assert torch.equal(k, qkv[:, H * hd:(H + Hk) * hd].view(T, Hk, hd))      # K untouched
                continue
            kept[be.name] = k.clone()
            if fp8:       # the pool holds them quantized, K unquantized
                assert torch.equal(kv[0].view(torch.uint8)[slots], quantize_kv(k, scale[0]).view(torch.uint8))
            else:
                assert torch.equal(k, kv[0][slots])                 # what it wrote into the pool
            assert torch.equal(v, qkv[:, (H + Hk) * hd:].view(T, Hk, hd))              # V as given
    assert torch.allclose(kept["triton"], kept["torch"], atol=1e-5)


def test_model_prefill_with_tma_plan_equals_the_paged_plan(tma_calls):
    """The tiny model (2 layers, fp32): a prefill pass of a fresh prompt and a continuation on a
    cached prefix, with the TMA plan forced (the prologue keeps K, the prefill reads it) and with
    the paged kernel of the same tile: the same logits and KV pool (to fp32 rounding)."""
    from ainfer_pd.engine.model.model import build_model
    from tests.conftest import tiny_cfg
    mc = tiny_cfg(**{"model.num_layers": 2}).model
    model = build_model(mc)
    bs, S = 16, 16 * 16
    g = torch.Generator().manual_seed(2)
    kv0 = torch.randn(2, 2, S, mc.num_kv_heads, mc.head_dim, generator=g)
    ids = torch.randint(2, 512, (33 + 12,), generator=g)
    b0, b1 = torch.tensor([3, 7, 1]), torch.tensor([5, 9, 2, 11])            # 33 fresh; 12 on 40 cached
    pos = torch.cat([torch.arange(33), torch.arange(40, 52)])
    write = torch.cat([(b0[:, None] * bs + torch.arange(bs)).reshape(-1)[:33],
                       (b1[:, None] * bs + torch.arange(bs)).reshape(-1)[40:52]])
    res = {}
    for name, plan in (("tma", TMA16), ("paged", PrefillPlan(16, 16, 4, 1))):
        model.attn_backend = TritonAttention(CPU, prefill_override=plan, tma=True)
        fb = ForwardBatch(ids, pos, write, [PrefillSeq(0, 33, 33, block_ids=b0), PrefillSeq(33, 12, 52, block_ids=b1)],
                          None, torch.tensor([32, 44]), block_size=bs)
        kv = kv0.clone()
        with torch.inference_mode():
            res[name] = (model.forward_batch(fb, kv), kv)
        assert fb.own_kv is None                              # handed over and cleared each layer
    assert tma_calls == [45, 45]                              # the TMA launch in both layers of the TMA run
    (lt, kvt), (lp, kvp) = res["tma"], res["paged"]
    assert torch.allclose(lt, lp, atol=1e-4, rtol=1e-4), (lt - lp).abs().max()
    assert torch.equal(kvt[0], kvp[0])                        # layer 0's K/V: the same prologue, bitwise
    assert torch.allclose(kvt, kvp, atol=1e-5)               # layer 1's: from layer 0's (near-equal) output


def test_long_plan_takes_tma_only_with_tma_on_a_16_bit_pool():
    long, tma = LONG_PREFILL_TOKENS, TMA_PREFILL_TOKENS
    assert prefill_plan(128, False, tma, tma=True) == PrefillPlan(128, 128, 8, 3, own_keys_tma=True)
    assert prefill_plan(128, False, long, tma=True) == PrefillPlan(128, 128, 8, 3, own_keys_tma=True)
    assert prefill_plan(128, False, long) == PrefillPlan(128, 128, 8, 3)               # no TMA on the device
    assert prefill_plan(128, False, tma) == PrefillPlan(64, 64, 4, 2)                  # ... nor its long tile below 4K
    assert not prefill_plan(128, False, tma - 1, tma=True).own_keys_tma               # short passes
    assert prefill_plan(128, False, tma, tma=True, cached=tma).own_keys_tma           # as many cached keys as new
    long_cached = PrefillPlan(128, 128, 8, 3)                                          # more cached: the paged long tile
    assert prefill_plan(128, False, tma, tma=True, cached=tma + 1) == long_cached
    assert prefill_plan(128, False, long, tma=True, cached=2 * long, seqs=4) == long_cached
    assert prefill_plan(128, False, 1024, cached=4096) == long_cached                  # TMA or not (the paged kernel)
    assert prefill_plan(128, False, 1150, tma=True, cached=3000, seqs=2) == PrefillPlan(64, 64, 4, 2)  # 575 a sequence
    assert prefill_plan(128, False, 1023, tma=True, cached=4096) == PrefillPlan(64, 64, 4, 2)
    assert not prefill_plan(128, False, long, kv_fp8=True, tma=True).own_keys_tma     # FP8 pool
    assert not prefill_plan(128, True, long, tma=True).own_keys_tma                   # fp32
    assert not prefill_plan(256, False, long, tma=True).own_keys_tma                  # head_dim > 128
    assert TritonAttention(CPU).tma is False                                           # no TMA on a CPU
    be = TritonAttention(CPU, tma=True)
    assert be.reads_own_kv(tma, torch.bfloat16, 128, False)
    assert not be.reads_own_kv(tma, torch.bfloat16, 128, True)
    assert not be.reads_own_kv(tma - 1, torch.bfloat16, 128, False)
    assert not TritonAttention(CPU).reads_own_kv(long, torch.bfloat16, 128, False)
