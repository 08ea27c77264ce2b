"""Sampling on the logits' device: greedy, temperature, top-k, top-p, repetition penalty, seeds.

``sample(logits, rows)`` takes logits [R, V] (on the device that computed them) and one
``SampleRow`` per row; returns token ids, their log-probabilities (host lists) and the rows that
could not be sampled. The whole batch is a handful of vectorised passes over [R, V] and one
device-to-host copy of 2R numbers: no per-row host loop, no [R, V] copy to the host (before, every
sampled row went through the CPU one at a time, with its own ``torch.Generator``).

Randomness is counter-based: a row draws one uniform number from a hash of (its seed, the index of
the token it draws in its turn) and takes the token where the cumulative distribution (float64)
crosses it (inverse CDF). So a seeded request's tokens depend on nothing else in the batch, on no
sampler state, and are the same on every rank and device.

NOTE: one row never fails another. ``SamplingParams.validate`` keeps every accepted request away
from overflow (temperature floor, repetition-penalty range), and each row is still checked here: a
row whose distribution is not a distribution (NaN, +inf, no finite mass: e.g. non-finite logits
from the model) is reported in ``bad`` with the reason, its token is a placeholder, and only that
request fails (the engine ends it with ``SamplingError``).

Shape legend: R = rows, V = vocabulary.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...request import SamplingParams

_M64 = (1 << 64) - 1


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    seed: int = 0                         # the request's seed, or the worker's fallback for it
    step: int = 0                         # index of the token drawn in this turn (the noise counter)
    history: Sequence[int] | None = None  # tokens seen (for the repetition penalty; array('q') from the engine)
    key: str | None = None
    """Set (the trajectory's id): ``history`` is the trajectory's live history, append-only, of which
    this row's are the first ``length`` tokens (no snapshot copy a step; a :class:`.seen_masks.SeenMasks`
    pool keeps its mask on the device). Read it through :func:`row_history`."""
    length: int = 0


def row_history(r: SampleRow) -> Sequence[int] | None:
    """The tokens ``r`` has seen, as a sequence of its own (a live history sliced at its length)."""
    if r.key is None or r.history is None:
        return r.history
    return r.history[:r.length]


def history_len(r: SampleRow) -> int:
    if r.history is None:
        return 0
    return r.length if r.key is not None else len(r.history)


def sample_seed(params: SamplingParams, fallback_seed: int) -> int:
    """The seed a request samples with: its own, else ``fallback_seed`` (0 <= seed < 2**64)."""
    return (params.seed if params.seed is not None else fallback_seed) & _M64


def uniform(seed: int, step: int) -> float:
    """A uniform number in (0, 1) from (seed, step): splitmix64 of the pair, 53 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED69) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return ((z >> 11) + 0.5) / float(1 << 53)


def _to_device(dev: torch.device, pinned: bool):
    """host tensor -> ``dev``. ``pinned`` (CUDA): through pinned memory without blocking: a copy
    from pageable memory waits for the stream's earlier work (here: the D iteration being sampled)."""
    if pinned and dev.type == "cuda":
        return lambda t: t.pin_memory().to(dev, non_blocking=True)
    return lambda t: t.to(dev)


def _on_rows(x: Tensor, idx: list[int], fn, to) -> Tensor:
    """x [R, V] with rows ``idx`` replaced by ``fn(x[idx])`` (the other rows as they are)."""
    sel = to(torch.tensor(idx, dtype=torch.int64))
    x = x.clone()
    x.index_copy_(0, sel, fn(x.index_select(0, sel)))
    return x


def history_with(history, extra) -> array:
    """A copy of ``history`` (ids) followed by ``extra`` (a verify position's history: the row's,
    then the drafts before it)."""
    out = array("q", history)
    out.extend(extra)
    return out


def _ids(history) -> Tensor:
    """A row's history as an int64 tensor (an ``array('q')``: one copy of its buffer, no Python
    loop over the tokens)."""
    if isinstance(history, array) and history.typecode == "q":
        return torch.frombuffer(history, dtype=torch.int64).clone()   # (the view goes: the array may grow)
    return torch.tensor(list(history), dtype=torch.int64)


def _penalize(x: Tensor, rows: list[SampleRow], to, seen_ids: Tensor | None = None, masks=None) -> Tensor:
    """x [R, V] with each row's repetition penalty applied to the tokens of its history. The
    tokens seen are a mask: with ``masks`` (a :class:`.seen_masks.SeenMasks` pool) and every
    penalized row keyed, the pool's, which uploads only what each slot has not seen yet; else
    scattered from the rows' whole histories, padded with an extra column V (duplicates set it
    once; no per-token Python work: 64 rows of 10K tokens took ~150 ms of host time a step as
    sorted sets and nested lists). ``seen_ids`` [R] (on the device): one more token each row has
    seen (the overlapped D loop: the token fed on the device, not in the host history yet)."""
    idx = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and history_len(r)]
    if not idx:
        return x
    V = x.shape[1]
    pen = to(torch.tensor([rows[i].params.repetition_penalty for i in idx], dtype=x.dtype))[:, None]
    extra = None
    if seen_ids is not None:
        extra = seen_ids.index_select(0, to(torch.tensor(idx, dtype=torch.int64)))[:, None]
    if masks is not None and all(rows[i].key is not None for i in idx):
        seen = masks.gather([rows[i].key for i in idx], [rows[i].history for i in idx],
                            [rows[i].length for i in idx], V, x.device, to)
        if extra is not None:
            seen.scatter_(1, extra, True)
    else:
        pad = to(torch.nn.utils.rnn.pad_sequence([_ids(row_history(rows[i])) for i in idx], batch_first=True,
                                                 padding_value=V))
        if extra is not None:
            pad = torch.cat([pad, extra], dim=1)
        seen = torch.zeros(len(idx), V + 1, dtype=torch.bool, device=x.device).scatter_(1, pad, True)[:, :V]

    def penalize(sub: Tensor) -> Tensor:
        return torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    return _on_rows(x, idx, penalize, to)


def _top_k(x: Tensor, rows: list[SampleRow], to) -> Tensor:
    V = x.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < V and not r.params.greedy else 0 for r in rows]
    if not any(ks):
        return x
    kmax = max(ks)
    kth_idx = to(torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.int64))[:, None]
    kth = torch.topk(x, kmax, dim=-1).values.gather(1, kth_idx)
    on = to(torch.tensor([k > 0 for k in ks]))[:, None]
    return x.masked_fill(on & (x < kth), float("-inf"))


def _top_p(x: Tensor, rows: list[SampleRow], to) -> Tensor:
    """Keep the smallest prefix (by probability) reaching each row's top_p."""
    idx = [i for i, r in enumerate(rows) if r.params.top_p < 1.0 and not r.params.greedy]
    if not idx:
        return x
    tp = to(torch.tensor([rows[i].params.top_p for i in idx], dtype=torch.float32))[:, None]

    def nucleus(sub: Tensor) -> Tensor:
        srt, order = torch.sort(sub, dim=-1, descending=True)
        p = torch.softmax(srt, -1)
        drop = (p.cumsum(-1) - p) > tp
        return sub.scatter(1, order, srt.masked_fill(drop, float("-inf")))
    return _on_rows(x, idx, nucleus, to)


@dataclass(slots=True)
class DeviceSample:
    """A batch sampled on the logits' device (:func:`sample_on_device`), not read yet."""

    tok: Tensor           # [R] int64 token ids on the device: the next D iteration's inputs, without the host
    host: Tensor          # [2, R] float64 token ids and log-probabilities on the host (copied with the stream)
    x: Tensor             # [R, V] the distribution's logits, for the reason a row could not be sampled


def sample_on_device(logits: Tensor, rows: list[SampleRow], *, pinned: bool = False,
                     seen_ids: Tensor | None = None, masks=None) -> DeviceSample:
    """Enqueue the sampling of logits [R, V] on the current stream and the copy of its 2R
    results to the host. ``pinned`` (CUDA): every copy goes through pinned memory without
    blocking (the host launcher never waits for the iteration it samples), so the host may read
    :attr:`DeviceSample.host` only once the stream passed it (the engine's overlapped D loop reads
    it after the iteration's completion event); else the copies block. ``seen_ids``: a token per
    row its repetition history holds beyond ``rows[i].history``; ``masks``: the caller's
    :class:`.seen_masks.SeenMasks` pool for keyed rows (:func:`_penalize`)."""
    x = logits.float()
    R, V = x.shape
    dev = x.device
    if R == 0:
        e = torch.zeros(0, dtype=torch.int64, device=dev)
        return DeviceSample(e, torch.zeros(2, 0, dtype=torch.float64), x)
    to = _to_device(dev, pinned)
    x = _penalize(x, rows, to, seen_ids, masks)
    greedy = [r.params.greedy for r in rows]
    sampled = not all(greedy)
    if sampled:
        per_row = to(torch.tensor([[1.0 if g else r.params.temperature for g, r in zip(greedy, rows)],
                                   [0.5 if g else uniform(r.seed, r.step) for g, r in zip(greedy, rows)],
                                   greedy], dtype=torch.float64))                  # one host -> device copy
        x = _top_p(_top_k(x / per_row[0, :, None].float(), rows, to), rows, to)
    lp = torch.log_softmax(x, dim=-1)                                   # log-probabilities [R, V]
    tok = lp.argmax(dim=-1)
    if sampled:
        cdf = lp.double().exp_().cumsum_(-1)                            # float64: exact enough over V
        drawn = torch.searchsorted(cdf, per_row[1, :, None] * cdf[:, -1:]).squeeze(1).clamp_(max=V - 1)
        tok = torch.where(per_row[2] > 0, tok, drawn)
    chosen = lp.gather(1, tok[:, None]).squeeze(1)
    out = torch.stack([tok.double(), chosen.double()])
    if pinned and out.is_cuda:
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()          # the logits may be a graph's output buffer, which its next replay overwrites
    else:
        host = out.cpu()                                                # the one device -> host copy
    return DeviceSample(tok, host, x)


def read_sample(ds: DeviceSample) -> tuple[list[int], list[float], dict[int, str]]:
    """(token ids, logprobs, bad rows: index -> reason) of a :class:`DeviceSample` whose copy completed."""
    toks = [int(t) for t in ds.host[0].tolist()]
    lps = ds.host[1].tolist()
    # a NaN or +inf logit, or no finite one, makes the row's log-softmax NaN at every token
    bad = {i: _why_not_a_distribution(ds.x[i]) for i, v in enumerate(lps) if not math.isfinite(v)}
    for i in bad:
        toks[i], lps[i] = 0, float("nan")
    return toks, lps, bad


def sample(logits: Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float], dict[int, str]]:
    """logits [R, V] -> (token ids, logprobs, bad rows: index -> reason), on the logits' device."""
    return read_sample(sample_on_device(logits, rows))


def _why_not_a_distribution(row: Tensor) -> str:
    if bool(torch.isnan(row).any()):
        return "NaN in the sampling distribution"
    if bool(torch.isposinf(row).any()):
        return "+inf in the sampling distribution"
    if not bool(torch.isfinite(row).any()):
        return "no token has finite probability"
    return "non-finite log-probability"
