"""The overlapped D loop's pieces (``scheduler.overlap_decode``): which rows the next iteration
takes while the previous one is still on the device, and the launch that feeds them its tokens.

Without overlap, a D iteration is launched, completes, and its tokens are read and booked on the
host before the next one is built: the device idles for the host's part of every iteration (on
the H200, trace cell, e6dcdb0: 0.35 ms build, 0.8 ms post and ~1.5 ms between the launch call
and the host seeing completion, for ~11.4 ms of device time). With overlap, iteration n+1 is
built and launched while n runs. Its rows that were in n get their input token on the device,
from n's sampled tokens (n's sampling runs on the D stream right after n's graph, so the order
is the stream's); the host reads and books n while n+1 runs.

What the host does not know when it launches n+1 is which rows n ended:

* a row that n brings to its token or context limit is known ahead: it is left out of n+1;
* a row that n ends with a stop token runs once more in n+1. That pass writes one KV slot past
  the turn's end inside its own reservation, and its output is dropped: the book skips rows that
  are no longer decoding, and gives the turn's blocks back only once that pass drained
  (``TurnBook.pending_finish``; the trajectory drains meanwhile, so its next turn, a release or
  a sleep wait for it);
* a row with a repetition penalty needs its history, n's token included: the host history has
  the tokens read, and n's token is the row's input id in n+1, on the device, which the
  sampler's penalty mask takes too (``sample_on_device(seen_ids=)``), so such rows overlap as well.
  The rows' histories are not copied a step: each is the turn's live history with its length
  (``TurnBook.sample_row(live=True)``), and the runner's :class:`~..model.seen_masks.SeenMasks`
  keeps each trajectory's mask on the device, uploading only the tokens read since.

Seeded sampling stays exact: a row's noise counter is the index of the token it draws, which
counts the tokens still on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.runner import BatchPlan
from ..model.sampler import DeviceSample, SampleRow, sample_on_device
from ...spec.verify import DeviceVerify, verify_rows
from .state import Turn


@dataclass(slots=True)
class InFlightD:
    """A D iteration launched and not read yet."""

    plan: BatchPlan
    work: Any                      # the D stream item; its result is the iteration's DeviceSample
    rows: list[Turn]
    t_launch: float
    index: dict[int, int]          # id(turn) -> its row in this iteration (where its token is)
    hold: Any = None               # the rows' in-flight hold (TurnBook.in_flight), released once read


def ends_at(t: Turn, max_context_len: int) -> bool:
    """The token ``t`` draws next is its last by length (max_new_tokens or the context limit)."""
    return len(t.out_tokens) + 1 >= t.params.max_new_tokens or t.seq_len + 1 >= max_context_len


def rows_after(rows: list[Turn], prev: InFlightD | None, max_context_len: int) -> tuple[list[Turn], list[int]]:
    """The rows of the next iteration among ``rows`` while ``prev`` is unread, and for each whether
    its last token is still on the device (1: it was a row of prev). A row prev brings to its
    length limit is left out (it ends when prev is read)."""
    if prev is None:
        return rows, [0] * len(rows)
    out, ahead = [], []
    for t in rows:
        if id(t) in prev.index:
            if ends_at(t, max_context_len):
                continue
            out.append(t)
            ahead.append(1)
        else:
            out.append(t)
            ahead.append(0)
    return out, ahead


def feed_of(rows: list[Turn], ahead: list[int], prev: InFlightD | None, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dst, src): the rows of the next iteration whose input is prev's token at row src."""
    if prev is None or not any(ahead):
        return None
    dst = [i for i, a in enumerate(ahead) if a]
    src = [prev.index[id(rows[i])] for i in dst]
    return (torch.tensor(dst, dtype=torch.int64).to(device), torch.tensor(src, dtype=torch.int64).to(device))


def decode_sampled(runner, plan: BatchPlan, ctx, sample_rows: list[SampleRow],
                   feed: tuple[torch.Tensor, torch.Tensor] | None, prev_work=None) -> DeviceSample:
    """The D stream item of an iteration: the inputs prev left on the device (overlapped), the
    iteration (graph replay when a bucket fits), then the sampling of its ``sample_rows`` (the
    first logits rows: a multi-rank plan may pad more) and the non-blocking copy of the 2R
    results to the host. ``prev_work``: prev's D stream item; the stream is FIFO, so its launch
    call has returned when this one runs and its result (the sampled tokens on the device,
    produced earlier on this stream) is there without waiting. The plain D loop runs it too,
    without ``feed``: the host reads the tokens after the item completed, off the device."""
    if feed is not None:
        dst, src = feed
        prev_tok = prev_work.enqueued().result().tok
        plan.fb.input_ids.index_copy_(0, dst, prev_tok.index_select(0, src))
    logits = runner.decode(plan, ctx)[:len(sample_rows)]
    # a row's input id is its last token: for a row fed from prev, not in its host history yet
    # (a repetition penalty counts it from the device: such rows overlap too)
    seen = plan.fb.input_ids if any(r.params.repetition_penalty != 1.0 for r in sample_rows) else None
    return sample_on_device(logits, sample_rows, pinned=True, seen_ids=seen, masks=runner.seen_masks)


def verify_sampled(runner, plan: BatchPlan, ctx, sample_rows: list[SampleRow]) -> DeviceVerify | None:
    """The D stream item of a verify iteration (speculative decoding, plain loop): the pass, then
    the verification of ``plan.drafts`` on the D stream with a non-blocking copy to the host
    (``TurnBook.finish_verify(verified=)`` reads it); None for a plan without rows (a TP
    follower's: it verifies nothing)."""
    logits = runner.decode(plan, ctx)
    if not plan.drafts:
        return None
    return verify_rows(logits, plan.drafts, sample_rows, pinned=True)
