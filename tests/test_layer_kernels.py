"""The fused layer kernels (Triton, CPU interpreter) against the torch reference ops:
add + RMS norm, the QKV prologue (QK-norm, full and partial RoPE, K/V written to the cache slots),
and the two-launch MoE block alignment."""
import pytest
import torch

from ainfer_pd.engine.attention import TorchAttention
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from ainfer_pd.engine.fused_moe import align_blocks, align_blocks_triton
from ainfer_pd.engine.model.moe import route
from ainfer_pd.engine.model.rope import rope_cos_sin

TRI, REF = TritonAttention(torch.device("cpu")), TorchAttention()


@pytest.mark.parametrize("D", [64, 100])
def test_rms_norm_and_residual_add(D):
    g = torch.Generator().manual_seed(D)
    x, res, w = torch.randn(7, D, generator=g), torch.randn(7, D, generator=g), torch.randn(D, generator=g)
    assert torch.allclose(TRI.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), atol=1e-5)
    h, xn = TRI.add_rms_norm(x, res, w, 1e-6)
    h_ref, xn_ref = REF.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, h_ref)
    assert torch.allclose(xn, xn_ref, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotary", [16, 8])          # full and partial (glm4_moe) rotary width
@pytest.mark.parametrize("H,Hk", [(4, 2), (20, 3)])  # one tile of heads; two query tiles, the last and the KV one padded
def test_prologue_matches_reference(qk_norm, rotary, H, Hk):
    T, hd, S = 5, 16, 40
    g = torch.Generator().manual_seed(rotary + qk_norm + H)
    qkv = torch.randn(T, (H + 2 * Hk) * hd, generator=g)
    qw, kw = (torch.randn(hd, generator=g), torch.randn(hd, generator=g)) if qk_norm else (None, None)
    rope = rope_cos_sin(torch.tensor([0, 3, 9, 10, 31]), rotary, 10000.0, torch.float32)
    slots = torch.tensor([7, 0, 33, 12, 5])
    outs = []
    for be in (TRI, REF):
        q, k, v = qkv.clone().split([H * hd, Hk * hd, Hk * hd], dim=-1)
        q, k, v = q.view(T, H, hd), k.view(T, Hk, hd), v.view(T, Hk, hd)
        kv = torch.full((2, S, Hk, hd), 7.0)
        outs.append((be.prologue(q, k, v, qw, kw, 1e-6, rope, kv, slots), kv))
    (qt, kvt), (qr, kvr) = outs
    assert torch.allclose(qt, qr, atol=1e-5)
    assert torch.allclose(kvt, kvr, atol=1e-5)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert (kvt[:, untouched] == 7.0).all()                      # only the batch's slots written


@pytest.mark.parametrize("T,E,k,bm", [(11, 6, 2, 4), (40, 8, 2, 16), (3, 16, 4, 16)])
def test_triton_alignment_is_a_valid_layout(T, E, k, bm):
    r = route(torch.randn(T, 8), torch.randn(E, 8), k)
    ref_ids, ref_be, ref_post = align_blocks(r, bm)
    ids, be, post = align_blocks_triton(r, bm)
    N = T * k
    assert int(post) == int(ref_post) and ids.shape == ref_ids.shape
    used = int(post)
    assert torch.equal(be[:used // bm], ref_be[:used // bm])      # same expert for every used block
    flat = r.topk_idx.reshape(-1)
    for b in range(used // bm):                                   # each block: its expert's pairs, same set
        a = sorted(i for i in ids[b * bm:(b + 1) * bm].tolist() if i < N)
        c = sorted(i for i in ref_ids[b * bm:(b + 1) * bm].tolist() if i < N)
        assert all(int(flat[i]) == int(be[b]) for i in a)
    assert sorted(i for i in ids.tolist() if i < N) == list(range(N))
    assert all(i == N for i in ids[used:].tolist())
