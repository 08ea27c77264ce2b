"""The verify cost table of speculative decoding, measured on this device (issue 38): one D
iteration of B rows verifying w - 1 drafts each, as the D loop runs it (graph replay where a
bucket fits). The speculator's :class:`~ainfer_pd.spec.adaptive.VerifyCosts` are built from it
when the config gives none, and ``benchmarks/spec_verify_cost_bench.py`` prints it."""
from __future__ import annotations

import time

import torch

from ..attention import DecodeMeta, ForwardBatch
from ...phase import PhaseContext
from .runner import BatchPlan


def measure_verify_costs(runner, ctx: PhaseContext, batches: tuple[int, ...], widths: tuple[int, ...],
                         context_len: int, reps: int = 3) -> dict[int, dict[int, float]]:
    """Seconds of one D iteration of B rows verifying w - 1 drafts each (B * w decode rows at
    ``context_len`` keys: graph replay where a bucket fits, as the D loop runs it), the median of ``reps`` after one warm-up: the speculator's cost table
    ``{B: {w: s}}``. Writes only the scratch slot."""
    dev, bs = runner.device, runner.kv.block_size
    L = max(1, min(context_len, runner.sections.model.max_context_len - max(widths)))
    out: dict[int, dict[int, float]] = {}
    for B in batches:
        out[B] = {}
        for w in widths:
            n, nb = B * w, -(-(L + w) // bs)
            lens = torch.tensor([L + j for _ in range(B) for j in range(w)], dtype=torch.int64, device=dev)
            # each row's own blocks (read, never written), shared by its w positions as in a verify
            table = (torch.arange(B)[:, None] * nb + torch.arange(nb)) % runner.kv.alloc.num_blocks
            fb = ForwardBatch(
                input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
                positions=lens - 1,
                write_slots=torch.full((n,), runner.scratch_slot, dtype=torch.int64, device=dev),
                decode=DecodeMeta(None, lens, block_table=table.repeat_interleave(w, 0).to(dev), block_size=bs),
                logits_rows=torch.arange(n, dtype=torch.int64, device=dev), block_size=bs)
            plan = BatchPlan(fb, [], [], [])
            times = []
            for i in range(reps + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                runner.decode(plan, ctx)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:
                    times.append(time.perf_counter() - t0)
            out[B][w] = sorted(times)[len(times) // 2]
    runner.decode_paths = {k: 0 for k in runner.decode_paths}      # the measurement is not the rollout's
    return out
