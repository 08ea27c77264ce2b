"""The ``triton`` attention backend: paged decode (split-KV) and varlen paged prefill kernels.

No gather into dense copies, no GQA expansion: the kernels read each sequence's K/V in place
through its block table. Decode has fixed shapes for a given (rows, blocks per row), so it
replays inside CUDA graphs; prefill is one launch for every sequence of a P segment. A long prefill
pass on Hopper or newer reads its own keys and values contiguous, through TMA descriptors
(:mod:`.triton_prefill_tma`, when the plan says ``own_keys_tma`` and the model kept them: ``own_kv``).
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from ...errors import ConfigError
from .batch import ForwardBatch
from .kv_fp8 import is_fp8
from .plan import DecodePlan, PrefillPlan, decode_plan, prefill_plan
from .prologue_kernels import qkv_prologue_kernel, rms_norm_kernel
from .triton_kernels import decode_merge_kernel, paged_decode_kernel, paged_prefill_kernel
from ..tma import has_tma
from .triton_prefill_tma import prefill_tma, tma_layout_ok

_LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _heads_per_program(n: int) -> int:
    """Heads of one prologue program: a [16, head_dim] tile at most (Qwen3's 32 query heads: 2
    programs a token, its 4 KV heads: 1)."""
    return min(_pow2(n), 16)


def _kv_format(cache: Tensor, kv_scale: Tensor | None, dummy: Tensor) -> tuple[bool, Tensor]:
    """(the pool is FP8, the pointer the kernels read its [2] float32 scales from; ``dummy``, never
    read, for a pool in the model dtype)."""
    if not is_fp8(cache):
        return False, dummy
    if kv_scale is None or kv_scale.dtype != torch.float32 or kv_scale.numel() != 2 or not kv_scale.is_contiguous():
        raise ValueError("an FP8 KV pool needs its layer's scales: a contiguous [2] float32 tensor (K, V)")
    return True, kv_scale


class TritonAttention:
    name = "triton"

    def __init__(self, device: torch.device, *, decode_overrides: dict | None = None,
                 prefill_override: PrefillPlan | None = None, tma: bool | None = None) -> None:
        self.device = device
        self.decode_overrides = dict(decode_overrides or {})
        self.prefill_override = prefill_override
        self.tma = has_tma(device) if tma is None else tma
        """The device has TMA (Hopper or newer): long prefill passes may read their own K/V through it."""

    @staticmethod
    def check_head_dim(head_dim: int) -> None:
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ConfigError(f"the triton attention backend needs a power-of-two head_dim >= 16 (got {head_dim})")

    # ------------------------------------------------------------------ layer prologue / norms
    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        out = torch.empty_like(x)
        self._norm(x, None, w, eps, out, out)
        return out

    def add_rms_norm(self, x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        h = torch.empty_like(x)
        xn = torch.empty_like(x)
        self._norm(x, residual, w, eps, h, xn)
        return h, xn

    @staticmethod
    def _norm(x: Tensor, res: Tensor | None, w: Tensor, eps: float, h: Tensor, xn: Tensor) -> None:
        D = x.shape[-1]
        rows = x.numel() // D if D else 0
        if rows == 0:
            return
        assert x.stride(-1) == 1 and x.dim() == 2, "rows of [T, D] with unit stride"
        r = res if res is not None else x
        rms_norm_kernel[(rows,)](x, r, w, h, xn, x.stride(0), r.stride(0), h.stride(0), xn.stride(0), D, eps,
                                 HAS_RES=res is not None, BLOCK_D=_pow2(D), num_warps=4 if D <= 4096 else 8)

    def prologue(self, q: Tensor, k: Tensor, v: Tensor, q_w: Tensor | None, k_w: Tensor | None, eps: float,
                 rope: tuple[Tensor, Tensor], kv: Tensor, slots: Tensor, kv_scale: Tensor | None = None,
                 keep_k: bool = False) -> Tensor:
        """See :meth:`.backend.AttentionBackend.prologue`; ``keep_k``: the roped keys are stored back
        into ``k`` in place too (unquantized: what a prefill reading ``own_kv`` reads)."""
        T, H, hd = q.shape
        if T == 0:
            return q
        self.check_head_dim(hd)
        cos, sin = rope
        kc, vc = kv[0], kv[1]
        has_norm = q_w is not None
        fp8, ks = _kv_format(kc, kv_scale, cos)
        Hk = k.shape[1]
        qb, kb = _heads_per_program(H), _heads_per_program(Hk)
        qkv_prologue_kernel[(T, -(-H // qb) + -(-Hk // kb))](
            q, k, v, q_w if has_norm else q, k_w if has_norm else k, cos, sin, slots, kc, vc, ks,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), H, Hk, eps,
            HEAD_DIM=hd, HALF=cos.shape[-1], QB=qb, KB=kb, HAS_NORM=has_norm, KV_FP8=fp8,
            EXACT=fp8 and os.environ.get("TRITON_INTERPRET") == "1", KEEP_K=keep_k,
            num_warps=4 if max(qb, kb) * hd >= 1024 else 1)
        return q

    # ------------------------------------------------------------------ decode
    def decode_plan(self, max_keys: int) -> DecodePlan:
        return decode_plan(max_keys, **self.decode_overrides)

    def decode(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, kv_scale: Tensor | None = None) -> Tensor:
        d = fb.decode
        assert d.block_table is not None, "the paged decode kernel reads a block table"
        B, H, hd = q.shape
        Hk = kc.shape[1]
        G = H // Hk
        self.check_head_dim(hd)
        plan = self.decode_plan(d.max_keys)
        out = torch.empty_like(q)
        if B == 0:
            return out
        table = d.block_table
        ieee = q.dtype == torch.float32
        if plan.num_splits > 1:
            op = torch.empty(B, H, plan.num_splits, hd, dtype=torch.float32, device=q.device)
            lse = torch.empty(B, H, plan.num_splits, dtype=torch.float32, device=q.device)
        else:
            op, lse = out, out            # unused
        scale = _LOG2E / math.sqrt(hd)
        fp8, ks = _kv_format(kc, kv_scale, lse)
        width = d.group_width if d.lead_off is not None else 1
        paged_decode_kernel[(B, Hk, plan.num_splits)](
            q, kc, vc, table, d.ctx_lens, d.lead_off if width > 1 else d.ctx_lens, out, op, lse, ks, scale,
            plan.num_splits,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            table.stride(0), out.stride(0), out.stride(1),
            op.stride(0), op.stride(1), op.stride(2) if plan.num_splits > 1 else 0,
            lse.stride(0), lse.stride(1),
            GROUP=G, M_PAD=max(16, _pow2(G * width)), HEAD_DIM=hd, PAGE=d.block_size,
            BLOCK_N=plan.block_n, SPLIT_KEYS=plan.split_keys, MAX_SPLITS=plan.max_splits, SINGLE=plan.num_splits == 1,
            IEEE=ieee, KV_FP8=fp8, WIDTH=width,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
        if plan.num_splits > 1:
            decode_merge_kernel[(B, H)](
                op, lse, out, d.ctx_lens, plan.num_splits, op.stride(0), op.stride(1), op.stride(2), lse.stride(0),
                lse.stride(1), out.stride(0), out.stride(1),
                HEAD_DIM=hd, SPLITS_PAD=_pow2(plan.num_splits), SPLIT_KEYS=plan.split_keys,
                MAX_SPLITS=plan.max_splits, BLOCK_N=plan.block_n, num_warps=4)
        return out

    # ------------------------------------------------------------------ prefill
    def prefill_plan(self, head_dim: int, dtype: torch.dtype, tokens: int = 0, kv_fp8: bool = False,
                     cached: int = 0, seqs: int = 1) -> PrefillPlan:
        """The tile of a pass of ``tokens`` query tokens over ``cached`` pool keys in ``seqs`` sequences:
        ``prefill_override`` as given, else :func:`.plan.prefill_plan` (``own_keys_tma`` only where :attr:`tma`)."""
        return self.prefill_override or prefill_plan(head_dim, dtype == torch.float32, tokens, kv_fp8, tma=self.tma,
                                                     cached=cached, seqs=seqs)

    def reads_own_kv(self, tokens: int, dtype: torch.dtype, head_dim: int, kv_fp8: bool) -> bool:
        """Whether a prefill of ``tokens`` query tokens may read the pass's own K/V contiguous (TMA; a pass
        with no cached keys does): the model then keeps them (``prologue(keep_k=True)``) and hands them over
        (``ForwardBatch.own_kv``); the pass's plan (its cached keys) decides whether they are read."""
        return not kv_fp8 and self.prefill_plan(head_dim, dtype, tokens, kv_fp8).own_keys_tma

    def prefill(self, q: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, out: Tensor,
                kv_scale: Tensor | None = None, own_kv: tuple[Tensor, Tensor] | None = None) -> None:
        """Every prefill sequence of ``fb`` into ``out``. ``own_kv``: the pass's roped K and V
        [T, Hk, hd] (strided views of the QKV output) when the model kept them; read contiguous through
        TMA when the plan says ``own_keys_tma`` on a 16-bit pool, else every key through the block table."""
        T, H, hd = q.shape
        Hk = kc.shape[1]
        self.check_head_dim(hd)
        fp8, ks = _kv_format(kc, kv_scale, out)
        plan = self.prefill_plan(hd, q.dtype, T, fp8, cached=fb.prefill_cached_keys(), seqs=len(fb.prefill))
        if plan.own_keys_tma and own_kv is not None and not fp8 and all(map(tma_layout_ok, (q, *own_kv))):
            prefill_tma(q, own_kv[0], own_kv[1], kc, vc, fb, out, plan)
            return
        pm = fb.build_prefill_meta(plan.block_m, plan.heavy_first)
        NT = int(pm.tile_seq.shape[0])
        if NT == 0:
            return
        scale = _LOG2E / math.sqrt(hd)
        paged_prefill_kernel[(NT, H)](
            q, kc, vc, out, pm.block_table, pm.q_start, pm.q_len, pm.ctx_len, pm.tile_seq, pm.tile_m, ks, scale,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            out.stride(0), out.stride(1), pm.block_table.stride(0),
            GROUP=H // Hk, HEAD_DIM=hd, PAGE=fb.block_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            IEEE=q.dtype == torch.float32, KV_FP8=fp8, num_warps=plan.num_warps, num_stages=plan.num_stages)
