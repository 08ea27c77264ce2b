"""Shared by the speculation tests: an abort while a verify pass is on the device, then the resume; the
world's K of every verify round a rank agreed; the drafts a leader offered."""
from __future__ import annotations

import asyncio

from ainfer_pd import SamplingParams


async def abort_mid_verify_then_resume(w, prompt: list[int], n: int, greedy: dict, *, min_out: int,
                                       timeout: float):
    """Trajectory "F" decodes ``n`` greedy tokens whole; "A" the same, aborted once it has
    ``min_out`` tokens while an iteration is on the device (after a verify ran), then resumed: its
    tokens before and after the abort equal F's. Returns (tokens A had at the abort, the resume)."""
    full = await w.generate(prompt, SamplingParams(max_new_tokens=n, **greedy), trajectory_id="F")
    task = asyncio.ensure_future(w.generate(prompt, SamplingParams(max_new_tokens=n, **greedy), trajectory_id="A"))
    async with asyncio.timeout(timeout):
        while not (w.engine.d.in_flight and w.trajectories.get("A") is not None
                   and w.trajectories["A"].turn is not None
                   and len(w.trajectories["A"].turn.out_tokens) >= min_out):
            await asyncio.sleep(0)
    verifies = w.engine.spec.num_verifies
    assert await w.abort("A") is True
    part = await task
    k = len(part.token_ids)
    assert part.finish_reason == "abort" and min_out <= k < n and verifies > 0
    assert part.token_ids == full.token_ids[:k]
    async with asyncio.timeout(timeout):
        while w.trajectories["A"].draining is not None:
            await asyncio.sleep(0.001)
    rest = await w.continue_("A", [], SamplingParams(max_new_tokens=n - k, **greedy))
    assert part.token_ids + rest.token_ids == full.token_ids
    return k, rest


def spy_ks(dist) -> list:
    """The K of every verify round this rank agrees (``DistRanks.agree_verify``), in order."""
    ks, agree = [], dist.agree_verify

    async def spy(offer, epoch):
        ks.append(await agree(offer, epoch))
        return ks[-1]
    dist.agree_verify = spy
    return ks


def record_offers(sp) -> list:
    """Every row a replica leader's speculator offered drafts for (``Speculator.offer``, before the
    world's K trims them): (its sequence, its drafts, its cap), in order."""
    rec, offer = [], sp.offer

    def recording(rows):
        drafts, o = offer(rows)
        rec.extend((t.context + t.out_tokens, d, sp.cap(t)) for t, d in zip(rows, drafts))
        return drafts, o
    sp.offer = recording
    return rec
