"""The cost tables of speculative decoding, measured on this device (issue 38): one D iteration
of B rows verifying w - 1 drafts each, as the D loop runs it (graph replay where a bucket fits),
and (``spec.method: mtp``) the MTP layer's draft chain of k steps over B rows. The speculator's
:class:`~ainfer_pd.spec.adaptive.VerifyCosts` are built from them when the config gives none.

On several ranks every rank (replica leaders and TP followers) runs the same grid at the same
time: the batch is synthetic (seeded tokens, the scratch block's slots, a block table that is a function
of B, w and the pool's size), so each rank builds it locally and ``pad`` (``DistRanks.padded_rows``) pads
it exactly as a real iteration is (every replica the same positions, a multiple of ATP, the graph
bucket where graphs run): D's DP-attention gather, attention reduce-scatter and expert exchange of
every pass pair up across ranks in the same order."""
from __future__ import annotations

import time

import torch

from ..attention import DecodeMeta, ForwardBatch, lead_offsets
from ...phase import PhaseContext
from .replica import pad_decode
from .runner import BatchPlan


def measure_slots(runner, n: int) -> torch.Tensor:
    """Where the ``n`` rows of a measurement write their keys: the scratch block's slots after its first, never
    read by a live row. Not the first (``runner.scratch_slot``): that one marks a padding row, which a
    replayed graph routes to no expert (``MoETransformer.route_rows``), and a measurement of padding
    rows timed no expert at all (a verify's cost without its MoE)."""
    bs = runner.kv.block_size
    first = runner.scratch_slot
    if bs < 2:
        raise ValueError("a cost measurement needs a KV block of 2 slots or more (block_size 1)")
    return first + 1 + torch.arange(n, device=runner.device) % (bs - 1)


def _decode_batch(runner, B: int, w: int, L: int, grouped: bool = True) -> ForwardBatch:
    """B rows of w positions each at ``L`` keys (each row's own blocks, read, never written; every
    write goes to the scratch block: :func:`measure_slots`), as a verify pass lays them out (a row's w
    positions one group: ``DecodeMeta.lead_off``). The tokens are drawn from the vocabulary with a seed
    of (B, w), the same on every rank: the experts a pass touches are a real batch's."""
    dev, bs = runner.device, runner.kv.block_size
    n, nb = B * w, -(-(L + w) // bs)
    lens = torch.tensor([L + j for _ in range(B) for j in range(w)], dtype=torch.int64, device=dev)
    table = (torch.arange(B)[:, None] * nb + torch.arange(nb)) % runner.kv.alloc.num_blocks
    ids = torch.randint(runner.sections.model.vocab_size, (n,), generator=torch.Generator().manual_seed(B * 64 + w))
    W = runner.sections.verify_width      # ungrouped: every row a group of its own (verify graphs, rows alone)
    offs = lead_offsets([w] * B, W) if grouped else [0] * n
    lead = torch.tensor(offs, dtype=torch.int64, device=dev) if w > 1 < W else None
    return ForwardBatch(
        input_ids=ids.to(dev),
        positions=lens - 1,
        write_slots=measure_slots(runner, n),
        decode=DecodeMeta(None, lens, block_table=table.repeat_interleave(w, 0).to(dev), block_size=bs,
                          lead_off=lead, group_width=W),
        logits_rows=torch.arange(n, dtype=torch.int64, device=dev), block_size=bs)


def _median_time(fn, dev: torch.device, reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn`` after one warm-up (device synchronized)."""
    times = []
    for i in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_verify_costs(runner, ctx: PhaseContext, batches: tuple[int, ...], widths: tuple[int, ...],
                         context_len: int, reps: int = 3, pad=None,
                         grouped: bool = True) -> dict[int, dict[int, float]]:
    """Seconds of one D iteration of B rows verifying w - 1 drafts each (B * w decode rows at
    ``context_len`` keys: graph replay where a bucket fits, as the D loop runs it), the median of
    ``reps`` after one warm-up: the speculator's cost table ``{B: {w: s}}``. ``pad`` (several
    ranks): positions -> the rows every replica runs (module docstring). Writes only the scratch
    block. ``grouped`` False: every row's attention reads its keys alone (a benchmark's comparison)."""
    L = max(1, min(context_len, runner.sections.model.max_context_len - max(widths)))
    out: dict[int, dict[int, float]] = {}
    for B in batches:
        out[B] = {}
        for w in widths:
            fb = _decode_batch(runner, B, w, L, grouped)
            if pad is not None:
                fb = pad_decode(fb, pad(B * w), runner.scratch_slot, runner.scratch_block)
            plan = BatchPlan(fb, [], [], [])
            out[B][w] = _median_time(lambda: runner.decode(plan, ctx), runner.device, reps)
    runner.decode_paths = {k: 0 for k in runner.decode_paths}      # the measurement is not the rollout's
    return out


@torch.no_grad()
def measure_draft_costs(runner, ctx: PhaseContext, batches: tuple[int, ...], ks: tuple[int, ...],
                        context_len: int, reps: int = 3, pad=None) -> dict[int, dict[int, float]]:
    """Seconds of the MTP layer's draft chain of k steps over B rows at ``context_len`` keys (its
    own KV layer; each step the layer, its head and the argmax, as
    :meth:`~ainfer_pd.spec.mtp.MtpDrafter.prepare` runs it): ``{B: {k: s}}``, the median of
    ``reps`` after one warm-up. Writes only the scratch block. On several ranks every rank runs the
    same grid (the MTP layer's collectives pair up: ``ctx``'s hooks), B rows padded by ``pad`` as a
    world chain's (every replica the same rows, a multiple of ATP)."""
    from ..model.mtp_layer import mtp_forward, mtp_logits
    model = runner.model
    kv = runner.kv_cache[model.cfg.num_layers]
    L = max(1, min(context_len, runner.sections.model.max_context_len - max(ks) - 1))
    out: dict[int, dict[int, float]] = {}
    for B in batches:
        fb = _decode_batch(runner, B, 1, L)
        if pad is not None:
            fb = pad_decode(fb, pad(B), runner.scratch_slot, runner.scratch_block)
        h0 = torch.zeros(fb.positions.shape[0], model.cfg.hidden_size, dtype=model.embed.dtype, device=runner.device)

        def chain(k: int) -> None:
            h = h0
            for _ in range(k):
                h = mtp_forward(model, fb, h, kv, ctx.comm.hooks)
                fb.input_ids = mtp_logits(model, h).argmax(dim=-1)
        out[B] = {k: _median_time(lambda: chain(k), runner.device, reps) for k in ks}
    return out
