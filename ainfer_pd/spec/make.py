"""The engine's speculator, built from the config (``spec.method``), with its cost tables: given,
or measured on the D stream at start (and agreed over the ranks)."""
from __future__ import annotations

import logging

from .adaptive import VerifyCosts
from .speculator import Speculator

log = logging.getLogger("ainfer_pd.spec")


def make_speculator(cfg, runner, decode_ctx, recorder, dist) -> Speculator | None:
    """The engine's speculator (``spec.method``; None: off), with its cost tables: the config's,
    or measured now on the D stream (``spec.adaptive`` without a table): the verify's, and under
    ``mtp`` the MTP chain's (``spec.draft_costs``). On several ranks (``dist``) every
    rank measures the verify table (and the chain's), its passes padded as a real iteration's, the world's tables are
    agreed (``DistRanks.agree_costs``) and every rank keeps it for the world's K
    (``DistRanks.use_spec``); a replica leader's speculator only (a TP follower gets None: it runs
    its leader's verify batches and, under ``mtp``, its catch-ups and draft chains, on its drafter)."""
    sc = cfg.spec
    if not sc.enabled:
        return None
    if sc.mtp:                          # the runner's passes already feed it (engine.runtime.mtp_runner)
        runner.drafter.ctx = decode_ctx
    pad = None if dist is None else (lambda n: dist.padded_rows(n, runner.graphs))
    times, drafts = sc.verify_costs, sc.draft_costs or None
    top = cfg.scheduler.max_decode_batch
    batches = tuple(sorted(times) if times else sorted({b for b in (1, 4, 16, 64, 128) if b < top} | {top}))
    context = min(2048, cfg.model.max_context_len // 2)
    if not times and sc.adaptive:
        from ..engine.runtime.verify_costs import measure_verify_costs
        widths = sorted({w for w in (1, 2, 3, 5, 9) if w <= sc.num_draft_tokens + 1} | {sc.num_draft_tokens + 1})
        times = decode_ctx.stream.submit(
            lambda: measure_verify_costs(runner, decode_ctx, batches, tuple(widths), context, pad=pad),
            label="D.verify_costs").enqueued().result()
        log.info("verify costs (s) by batch and width: %s", times)
        if dist is not None:
            times = dist.agree_costs(times)
            log.info("the world's verify costs (s), the most any rank measured: %s", times)
    if sc.mtp and sc.adaptive and drafts is None and sc.verify_costs:
        log.warning("spec.verify_costs given without spec.draft_costs: the MTP chain's device time is not "
                    "counted against speculation (give both, or neither to measure both)")
    elif sc.mtp and sc.adaptive and drafts is None:          # the chain runs on the device: its cost counts
        from ..engine.runtime.verify_costs import measure_draft_costs
        drafts = decode_ctx.stream.submit(
            lambda: measure_draft_costs(runner, decode_ctx, batches, tuple(range(1, sc.num_draft_tokens + 1)),
                                        context, pad=pad), label="D.draft_costs").enqueued().result()
        log.info("MTP draft chain costs (s) by batch and drafts: %s", drafts)
        if dist is not None:
            drafts = dist.agree_costs(drafts)
    costs = VerifyCosts.from_times(times, drafts if sc.mtp else None) if times else None
    if dist is not None:                 # every rank decides the world's K from the same table
        dist.use_spec(sc, costs)
        if not dist.is_leader:
            return None                  # a TP follower never drafts: it runs its leader's verify batch
    return Speculator(sc, cfg.model.max_context_len, costs, recorder, runner.drafter if sc.mtp else None)
