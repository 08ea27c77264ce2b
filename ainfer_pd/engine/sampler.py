"""Sampling: greedy, temperature, top-k, top-p, repetition penalty, per-request seed.

``sample(logits, rows)`` takes float32 logits [R, V] and one ``SampleRow`` per row;
returns token ids, their log-probabilities (host lists) and the rows that could not be
sampled. A row with a seed draws from its own generator, so its tokens do not depend on
what else is in the batch.

NOTE: one row never fails another. ``SamplingParams.validate`` keeps every accepted request
away from overflow (temperature floor, repetition-penalty range), and each row is still
checked here: a row whose distribution is not a distribution (NaN, +inf, no finite mass:
e.g. non-finite logits from the model) is reported in ``bad`` with the reason, its token is
a placeholder, and only that request fails (the engine ends it with ``SamplingError``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..request import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    history: list[int] | None = None      # tokens seen (for the repetition penalty)


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator | None:
    if params.greedy:
        return None
    return torch.Generator(device="cpu").manual_seed(params.seed if params.seed is not None else fallback_seed)


def _penalize(row: Tensor, history: list[int], penalty: float) -> Tensor:
    if penalty == 1.0 or not history:
        return row
    idx = torch.tensor(sorted(set(history)), dtype=torch.int64, device=row.device)
    vals = row.index_select(0, idx)
    row = row.clone()
    row.index_copy_(0, idx, torch.where(vals > 0, vals / penalty, vals * penalty))
    return row


def _bad_distribution(lp: Tensor) -> str | None:
    """Why the log-probabilities ``lp`` [V] are not a distribution (None if they are)."""
    if bool(torch.isnan(lp).any()):
        return "NaN in the sampling distribution"
    if bool(torch.isposinf(lp).any()):
        return "+inf in the sampling distribution"
    if not bool(torch.isfinite(lp).any()):
        return "no token has finite probability"
    return None


def sample(logits: Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float], dict[int, str]]:
    """logits [R, V] float32 -> (token ids, logprobs, bad rows: index -> reason)."""
    logits = logits.float()
    plain_greedy = all(r.params.greedy and r.params.repetition_penalty == 1.0 for r in rows)
    bad: dict[int, str] = {}
    if plain_greedy:
        lp = torch.log_softmax(logits, dim=-1)
        tok = lp.argmax(dim=-1)
        chosen = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        ok = torch.isfinite(chosen) & ~torch.isnan(lp).any(dim=-1)
        if not bool(ok.all()):
            for i in (~ok).nonzero().flatten().tolist():
                bad[i] = _bad_distribution(lp[i]) or "non-finite log-probability"
        return tok.tolist(), chosen.tolist(), bad
    logits = logits.cpu()
    toks: list[int] = []
    lps: list[float] = []
    for i, r in enumerate(rows):
        p = r.params
        row = _penalize(logits[i], r.history or [], p.repetition_penalty)
        if p.greedy:
            lp = torch.log_softmax(row, -1)
            why = _bad_distribution(lp)
            t = int(lp.argmax()) if why is None else 0
            if why is not None:
                bad[i] = why
            toks.append(t)
            lps.append(float(lp[t]))
            continue
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > p.top_p     # keep the smallest prefix reaching top_p
            row = row.index_fill(0, order[drop], float("-inf"))
        lp = torch.log_softmax(row, -1)
        why = _bad_distribution(lp)
        if why is not None:           # this request only: never reaches multinomial
            bad[i] = why
            toks.append(0)
            lps.append(float("nan"))
            continue
        t = int(torch.multinomial(lp.exp(), 1, generator=r.generator))
        toks.append(t)
        lps.append(float(lp[t]))
    return toks, lps, bad
