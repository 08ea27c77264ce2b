"""Warm-up passes of a runner (CUDA start-up): every kernel variant compiled before the first
request needs it, writing only the scratch slot."""
from __future__ import annotations

import torch

from ..attention import DecodeMeta, ForwardBatch, PrefillSeq
from ...phase import PhaseContext


def warmup_prefill(runner, ctx: PhaseContext, max_tokens: int, cached: int = 512) -> list[int]:
    """Run P passes of 16, 24, 32, 48 .. ``max_tokens`` tokens, as first turns and as
    continuations on ``cached`` keys, writing only the scratch slot. Returns the sizes."""
    dev, scratch, bs = runner.device, runner.scratch_slot, runner.kv.block_size
    sizes, n = [], 16
    while n < max_tokens:
        sizes += [n, n * 3 // 2]
        n *= 2
    sizes = sorted({min(s, max_tokens) for s in sizes} | {max_tokens})
    for n in sizes:
        for p0 in (0, cached):
            fb = ForwardBatch(
                input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
                positions=torch.arange(p0, p0 + n, dtype=torch.int64, device=dev),
                write_slots=torch.full((n,), scratch, dtype=torch.int64, device=dev),
                prefill=[PrefillSeq(0, n, p0 + n, block_ids=torch.full((-(-(p0 + n) // bs),), runner.scratch_block,
                                                                       dtype=torch.int64))],
                logits_rows=torch.tensor([n - 1], dtype=torch.int64, device=dev), block_size=bs)
            runner.forward_fb(fb, ctx)
    warmup_eager_decode(runner, ctx)
    return sizes


def warmup_eager_decode(runner, ctx: PhaseContext) -> list[int]:
    """Eager decode passes of one row at key lengths 16 .. max_context_len (doubling), over the
    scratch block: every split-count variant of the decode kernels is compiled before the first
    mixed batch or long row needs it. Writes only the scratch slot. Returns the lengths."""
    dev, bs = runner.device, runner.kv.block_size
    lens, n = [], 16
    while n < runner.sections.model.max_context_len:
        lens.append(n)
        n *= 2
    lens.append(runner.sections.model.max_context_len)
    for L in lens:
        nb = -(-L // bs)
        fb = ForwardBatch(
            input_ids=torch.zeros(1, dtype=torch.int64, device=dev),
            positions=torch.full((1,), L - 1, dtype=torch.int64, device=dev),
            write_slots=torch.full((1,), runner.scratch_slot, dtype=torch.int64, device=dev),
            decode=DecodeMeta(None, torch.full((1,), L, dtype=torch.int64, device=dev),
                              block_table=torch.full((1, nb), runner.scratch_block, dtype=torch.int64, device=dev),
                              block_size=bs),
            logits_rows=torch.zeros(1, dtype=torch.int64, device=dev), block_size=bs)
        runner.forward_fb(fb, ctx)
    return lens
