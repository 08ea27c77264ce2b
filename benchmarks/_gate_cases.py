"""Random paged-attention and MoE cases for the GPU gate and the kernel sweep (GPU host).

Shape legend: H / Hk query / KV heads, hd head dim, B decode rows, L keys per row.
"""
from __future__ import annotations

import math

import torch

from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, PrefillSeq


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has a NaN."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def dense_attention(q, keys, vals, cached):
    """float64 full recompute: q [n, H, hd] at positions cached.. over keys/vals [m, Hk, hd], causal."""
    H, Hk = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(H // Hk, dim=1)
    v = vals.double().repeat_interleave(H // Hk, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), k) / math.sqrt(q.shape[-1])
    n, m = q.shape[0], keys.shape[0]
    vis = torch.arange(m, device=q.device)[None, :] <= (cached + torch.arange(n, device=q.device))[:, None]
    return torch.einsum("hnm,mhd->nhd", s.masked_fill(~vis, float("-inf")).softmax(-1), v)


def paged_case(seqs, decode_lens, H, Hk, hd, dtype, device, bs=16, seed=0):
    """A flat batch over a random block table with holes; returns (fb, q, k, v, kv, refs)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = sum(-(-(c + n) // bs) + 1 for c, n in seqs) + sum(-(-L // bs) + 1 for L in decode_lens) + 4
    nblocks = need * 2
    kv = torch.randn(2, nblocks * bs, Hk, hd, generator=g).to(device, dtype)
    perm = iter(torch.randperm(nblocks, generator=g).tolist())
    prefill, write, refs, t = [], [], [], 0
    for cached, n in seqs:
        ctx = cached + n
        blocks = [next(perm) for _ in range(-(-ctx // bs))]
        next(perm)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(ctx)])
        prefill.append(PrefillSeq(t, n, ctx, block_ids=torch.tensor(blocks)))
        write.append(slots[cached:])
        refs.append((t, n, cached, slots))
        t += n
    tables = []
    for L in decode_lens:
        blocks = [next(perm) for _ in range(-(-L // bs))]
        next(perm)
        tables.append(blocks)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(L)])
        write.append(slots[-1:])
        refs.append((t, 1, L - 1, slots))
        t += 1
    q = torch.randn(t, H, hd, generator=g).to(device, dtype)
    kn = torch.randn(t, Hk, hd, generator=g).to(device, dtype)
    vn = torch.randn(t, Hk, hd, generator=g).to(device, dtype)
    decode = None
    if decode_lens:
        nb = max(len(b) for b in tables)
        table = torch.tensor([b + [0] * (nb - len(b)) for b in tables], device=device)
        decode = DecodeMeta(None, torch.tensor(decode_lens, device=device), block_table=table, block_size=bs)
    fb = ForwardBatch(torch.zeros(t, dtype=torch.int64, device=device), torch.zeros(t, dtype=torch.int64, device=device),
                      torch.cat(write).to(device), prefill, decode, None, block_size=bs)
    return fb, q, kn, vn, kv, refs


def uniform_decode(B, L, H, Hk, hd, dtype, device, bs=16, seed=0):
    """B rows of L keys each over a shuffled block pool (the roofline case): (fb, q, kc, vc)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = -(-L // bs)
    pool = B * nb
    kc = torch.randn(pool * bs, Hk, hd, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(pool, generator=g).view(B, nb).to(device)
    meta = DecodeMeta(None, torch.full((B,), L, device=device), block_table=table, block_size=bs)
    q = torch.randn(B, H, hd, device=device, dtype=dtype)
    fb = ForwardBatch(torch.zeros(B, dtype=torch.int64, device=device), torch.zeros(B, dtype=torch.int64, device=device),
                      torch.zeros(B, dtype=torch.int64, device=device), [], meta, None, block_size=bs)
    return fb, q, kc, vc


def verify_decode(B, w, L, H, Hk, hd, dtype, device, group_width, bs=16, seed=0):
    """A verify pass's rows: B turns of w rows at L .. L + w - 1 keys, one block table a turn, over a
    shuffled pool: (fb with the turns' groups, the same fb with every row alone, q, kc, vc)."""
    from ainfer_pd.engine.attention import lead_offsets
    g = torch.Generator(device="cpu").manual_seed(seed)
    nb = -(-(L + w) // bs)
    kc = torch.randn(B * nb * bs, Hk, hd, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    table = torch.randperm(B * nb, generator=g).view(B, nb).repeat_interleave(w, 0).to(device)
    lens = (L + torch.arange(w)).repeat(B).to(device)
    lead = torch.tensor(lead_offsets([w] * B, group_width), device=device)
    q = torch.randn(B * w, H, hd, device=device, dtype=dtype)
    z = torch.zeros(B * w, dtype=torch.int64, device=device)
    fbs = [ForwardBatch(z, z, z, [], DecodeMeta(None, lens, block_table=table, block_size=bs, lead_off=lo,
                                                group_width=group_width if lo is not None else 1), None, block_size=bs)
           for lo in (lead, None)]
    return (*fbs, q, kc, vc)


def topk_choice_error(idx: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor, norm: bool) -> tuple[float, float]:
    """A top-k router's choice against the exact router probabilities, up to ties.

    idx / weights [T, k] are the choice under test; probs [T, E] the reference probabilities (float64
    softmax of the same logits). Returns (the largest gap between the probabilities the choice took
    and the reference top-k, both sorted descending; the largest error of the weights against the
    probabilities taken, renormalised when norm). Both are 0 for any exact top-k: two experts whose
    logits tie may be taken in either order, which an index-by-index comparison would count as a
    different choice (torch.topk on CUDA breaks ties arbitrarily). inf when an expert repeats in a row."""
    if idx.numel() == 0:
        return 0.0, 0.0
    srt = idx.sort(dim=-1).values
    if (srt[:, 1:] == srt[:, :-1]).any():
        return math.inf, math.inf
    took = probs.double().gather(1, idx)
    ref = probs.double().topk(idx.shape[1], dim=-1).values
    gap = float((took.sort(dim=-1, descending=True).values - ref).abs().max())
    want = took / took.sum(dim=-1, keepdim=True) if norm else took
    return gap, float((weights.double() - want).abs().max())


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in e4m3 steps, elementwise (codes ordered by value: sign-magnitude to signed)."""
    def code(t):
        u = t.view(torch.uint8).int()
        return torch.where(u >= 128, -(u & 0x7F), u & 0x7F)
    return (code(a) - code(b)).abs()
