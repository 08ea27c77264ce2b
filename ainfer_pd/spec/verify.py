"""Exact verification of drafted tokens: the target's logits at k + 1 positions per row decide how
many of the row's k drafts it keeps, and the one token after them (issue 38).

``verify_on_device(logits [R, K1, V], drafts, rows)``: position j of row r holds the target's
logits after the row's context and its first j drafts (K1 = k + 1; a row may bring fewer than k
drafts, its tail positions are ignored). Every position is sampled by the sampler itself
(:func:`~ainfer_pd.engine.model.sampler.sample_on_device` over the R * K1 positions, position j
drawing the row's token number ``step + j`` with the first j drafts in its repetition history), so
temperature, top-k, top-p, the repetition penalty, the logprobs and the bad-row checks are the
sampler's, not a copy of them. Then:

- **Drafts from a point mass** (``draft_probs=None``: the suffix drafter, a greedy MTP head): a
  draft is accepted while it equals the token the sampler drew at its position; the first
  position that differs (or the one after the last draft) emits the sampler's token. Greedy rows:
  accept while draft == argmax, so the output is greedy decoding's. Sampled rows: this is the
  rejection rule of Leviathan et al. / Chen et al. for q = a point mass at the draft d (accept
  with probability min(1, p(d) / 1) = p(d); on rejection the drawn token, conditioned on != d, is
  distributed as p without d, renormalised = norm(max(0, p - q))), coupled to the sampler's
  counter-based noise: the token at position j is exactly the one non-speculative decoding draws
  with noise (seed, step + j). So a seeded request's tokens do not depend on speculation.
- **Sampled drafts** (``draft_probs`` = q [R, k, V], the distribution each draft was drawn from,
  after the drafter's own processing): Leviathan's rule: accept draft d_j while
  u_j * q_j(d_j) < p_j(d_j), with u_j from noise (seed ^ ACCEPT_SALT, step + j); at the first
  rejection emit a draw from norm(max(0, p - q)) with the sampler's noise (seed, step + j); after
  the last accepted draft of a row that accepted all, the sampler's token. The emitted tokens are
  distributed as the target's; a seeded request is reproducible, but its tokens depend on the
  drafts (no rule can keep them equal to non-speculative decoding for every q).

Log-probabilities are always the target's at the emitted tokens (the sampler's processed
distribution), as non-speculative decoding reports them. :func:`read_verify` reads the host copy:
per row the accepted drafts then the one corrected or bonus token; a row whose distribution is not
one at an emitted position is reported in ``bad`` (the sampler's reason), its tokens end before it.

Shape legend: R = rows, K1 = k + 1 positions per row, V = vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.model.sampler import (SampleRow, _to_device, _why_not_a_distribution, history_with, row_history,
                                    sample_on_device, uniform)
from ..errors import SpecInputError

ACCEPT_SALT = 0xA5A5_5A5A_C3C3_3C3C
"""Mixed into a row's seed for the acceptance noise of sampled drafts (independent of the draws)."""
_PAD = -1                                  # a position with no draft (never equals a token)


@dataclass(slots=True)
class DeviceVerify:
    """A verification enqueued on the logits' device (:func:`verify_on_device`), not read yet."""

    tok: Tensor            # [R, K1] int64 emitted tokens on the device: accepted drafts, then the corrected one
    accepted: Tensor       # [R] int64 on the device: drafts accepted per row (it emits accepted + 1 tokens)
    host: Tensor           # [2, R * K1] float64 tokens and log-probabilities on the host (copied with the stream)
    x: Tensor              # [R * K1, V] the processed logits (the reason a row could not be sampled)
    drafts: list[list[int]]


@dataclass(slots=True)
class Verified:
    """A read verification: per row its emitted tokens (accepted drafts + one), their target
    log-probabilities, the drafts accepted, and the rows that could not be sampled (reason)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    accepted: list[int]
    bad: dict[int, str]


def expand_rows(rows: list[SampleRow], drafts: list[list[int]], width: int) -> list[SampleRow]:
    """The sampler's rows for ``width`` positions of each row: position j draws the row's token
    number ``step + j``, after the row's first j drafts (which join its repetition history)."""
    out = []
    for r, d in zip(rows, drafts):
        h = row_history(r)
        for j in range(width):
            out.append(SampleRow(r.params, r.seed, r.step + j, None if h is None else history_with(h, d[:j])))
    return out


def verify_on_device(logits: Tensor, drafts: list[list[int]], rows: list[SampleRow], *,
                     draft_probs: Tensor | None = None, pinned: bool = False) -> DeviceVerify:
    """Enqueue the verification of ``drafts`` (row r: at most K1 - 1 token ids) against the
    target's ``logits`` [R, K1, V] on the current stream, with one :class:`SampleRow` per row
    (``step``: the index of the token the row's first position draws). ``draft_probs`` [R, K1 - 1,
    V]: the distributions sampled drafts came from (None: point masses). ``pinned``: as
    :func:`~ainfer_pd.engine.model.sampler.sample_on_device` (read the host copy after the stream)."""
    R, K1, V = _check(logits, drafts, rows, draft_probs)
    ds = sample_on_device(logits.reshape(R * K1, V), expand_rows(rows, drafts, K1), pinned=pinned)
    tok = ds.tok.view(R, K1)
    if K1 == 1 or not any(drafts):
        return DeviceVerify(tok, torch.zeros(R, dtype=torch.int64, device=tok.device), ds.host, ds.x, drafts)
    to = _to_device(tok.device, pinned)
    D = to(torch.tensor([d + [_PAD] * (K1 - 1 - len(d)) for d in drafts], dtype=torch.int64))
    if draft_probs is None or all(r.params.greedy for r in rows):
        return DeviceVerify(tok, _run_length(tok[:, :-1] == D), ds.host, ds.x, drafts)
    out, lp, accepted = _rejection(ds.x.view(R, K1, V), tok, D, draft_probs, rows, to)
    return DeviceVerify(out, accepted, _to_host(torch.stack([out.double(), lp.double()]).view(2, R * K1), pinned),
                        ds.x, drafts)


def verify_starts(drafts: list[list[int]]) -> list[int]:
    """Each row's first position in a verify pass's flat logits (row i feeds 1 + len(drafts[i]))."""
    out, at = [], 0
    for d in drafts:
        out.append(at)
        at += 1 + len(d)
    return out


def verify_rows(logits: Tensor, drafts: list[list[int]], rows: list[SampleRow], *, starts: list[int] | None = None,
                pinned: bool = False) -> DeviceVerify:
    """:func:`verify_on_device` over a verify pass's flat logits [positions, V]: row i's positions
    begin at ``starts[i]`` (default :func:`verify_starts`: the pass's own rows, in order), gathered
    to [R, 1 + the longest draft, V] (a row with fewer drafts repeats its last position, never
    read)."""
    if starts is None:
        starts = verify_starts(drafts)
    width = 1 + max((len(d) for d in drafts), default=0)
    idx = [s + min(j, len(d)) for s, d in zip(starts, drafts) for j in range(width)]
    x = logits[_to_device(logits.device, pinned)(torch.tensor(idx, dtype=torch.int64))].view(len(drafts), width, -1)
    return verify_on_device(x, drafts, rows, pinned=pinned)


def read_verify(dv: DeviceVerify) -> Verified:
    """The host view of a :class:`DeviceVerify` whose copy completed. Per row: tokens up to and
    including the first that is not its draft (or the one after the last draft); a position
    whose log-probability is not finite ends the row in ``bad`` before it."""
    R, K1 = len(dv.drafts), dv.tok.shape[1]
    toks = dv.host[0].view(R, K1).tolist()
    lps = dv.host[1].view(R, K1).tolist()
    res = Verified([], [], [], {})
    for r, d in enumerate(dv.drafts):
        out_t, out_l = [], []
        for j in range(K1):
            if not math.isfinite(lps[r][j]):
                res.bad[r] = _why_not_a_distribution(dv.x[r * K1 + j])
                break
            t = int(toks[r][j])
            out_t.append(t)
            out_l.append(lps[r][j])
            if j >= len(d) or t != d[j]:
                break
        res.tokens.append(out_t)
        res.logprobs.append(out_l)
        res.accepted.append(len(out_t) if r in res.bad else len(out_t) - 1)
    return res


def verify(logits: Tensor, drafts: list[list[int]], rows: list[SampleRow], *,
           draft_probs: Tensor | None = None) -> Verified:
    """:func:`verify_on_device` then :func:`read_verify` (blocking)."""
    return read_verify(verify_on_device(logits, drafts, rows, draft_probs=draft_probs))


# ------------------------------------------------------------------------------------ internals
def _rejection(x: Tensor, tok: Tensor, D: Tensor, q: Tensor, rows: list[SampleRow], to):
    """Leviathan's rule for sampled drafts over the processed logits x [R, K1, V] and the
    sampler's tokens ``tok`` [R, K1]: (emitted tokens [R, K1], their log-probabilities, accepted)."""
    R, K1, V = x.shape
    k, dev = K1 - 1, x.device
    lp = torch.log_softmax(x, dim=-1)                                # as the sampler's (same op, same input)
    p = lp.exp()
    noise = to(torch.tensor([[uniform(r.seed ^ ACCEPT_SALT, r.step + j) for j in range(k)]
                             + [uniform(r.seed, r.step + j) for j in range(K1)] + [float(r.params.greedy)]
                             for r in rows], dtype=torch.float64))        # one host -> device copy
    greedy = noise[:, -1:] > 0
    d = D.clamp(min=0)
    q = q.to(dev, torch.float32)
    p_d = p[:, :k].gather(2, d[..., None]).squeeze(2)
    q_d = q.gather(2, d[..., None]).squeeze(2)
    ok = (D >= 0) & torch.where(greedy, tok[:, :k] == D, noise[:, :k] * q_d < p_d)
    accepted = _run_length(ok)
    a = accepted[:, None]
    at = a.clamp(max=k - 1)
    pa = p.gather(1, a[..., None].expand(R, 1, V)).squeeze(1)           # [R, V]
    qa = q.gather(1, at[..., None].expand(R, 1, V)).squeeze(1)
    da = d.gather(1, at)
    resid = (pa - qa).clamp_(min=0).scatter_(1, da, 0.0)                # norm(max(0, p - q)), never the draft
    resid = torch.where(resid.sum(1, keepdim=True) > 0, resid, pa.scatter(1, da, 0.0))
    cdf = resid.double().cumsum_(-1)
    u = noise[:, k:k + K1].gather(1, a)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=V - 1)   # [R, 1]
    rejected = (D.gather(1, at) >= 0) & (a < k) & ~greedy               # a draft at a, not accepted
    pos = torch.arange(K1, device=dev)[None, :]
    out = torch.where(pos < a, torch.cat([d, d[:, :1]], 1), tok)
    out = out.scatter(1, a, torch.where(rejected, drawn, tok.gather(1, a)))
    return out, lp.gather(2, out[..., None]).squeeze(2), accepted


def _run_length(ok: Tensor) -> Tensor:
    """[R, k] bool -> [R] int64: the leading run of True per row."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _to_host(t: Tensor, pinned: bool) -> Tensor:
    if pinned and t.is_cuda:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)
    return t.cpu()


def _check(logits: Tensor, drafts: list[list[int]], rows: list[SampleRow], q: Tensor | None):
    if logits.dim() != 3 or logits.shape[1] < 1:
        raise SpecInputError(f"logits must be [R, k + 1, V], got {tuple(logits.shape)}")
    R, K1, V = logits.shape
    if len(rows) != R or len(drafts) != R:
        raise SpecInputError(f"logits have {R} rows, but {len(rows)} sample rows and {len(drafts)} drafts")
    for r, d in enumerate(drafts):
        if len(d) > K1 - 1:
            raise SpecInputError(f"row {r}: {len(d)} drafts, but logits for {K1 - 1}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in d):
            raise SpecInputError(f"row {r}: draft tokens must be ids in [0, {V}), got {d}")
    if q is not None and tuple(q.shape) != (R, K1 - 1, V):
        raise SpecInputError(f"draft_probs must be [{R}, {K1 - 1}, {V}], got {tuple(q.shape)}")
    return R, K1, V
