"""The walk of one P epoch over the model's segments, onto the P stream.

The segments and their safe boundaries are the model's (:attr:`~.model.MoETransformer.segments`,
the sequence :meth:`~.model.MoETransformer.forward_batch` runs back to back). The walk enqueues
each segment on the P stream and adds only what is P's own, at the boundary before it:

* the entry (boundary 0, before ``embed``): a gated epoch publishes it and waits for its permit;
* an expert notification point (``2l + 1``, before layer l's ``experts``): per-layer gating
  publishes it, receive-count pacing waits for the layer's attention and router to complete
  (P's device progress paces its host), then per-layer gating waits for the permit;
* a layer end (``2l + 2``): per-layer gating publishes it and waits for the permit; the last
  one (before ``head``) is published as the epoch's final boundary.

Under attention tensor parallelism a layer's attention is three stream items: the attention
over this rank's heads, its all-reduce (routed by the ordering: the engine's hook) and the
router. The engine's :meth:`~.engine.Engine._run_epoch` owns the epoch around the walk (the
turnstile epoch, timing, completion, the tokens).
"""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Callable

from ...metrics.export import set_log_context
from ...sched.epoch_mode import EpochMode
from ..model.model import ATTENTION, EMBED, EXPERTS, HEAD, Segment
from ..model.sampler import DeviceSample, SampleRow, sample_on_device

P_ITEM = {"phase": "P", "kind": "compute"}

GATED_LANE = "gated"
"""The P stream's lane of a gated epoch's items (P beside D): ``device.p_stream_sms`` maps it to
a green context of that many SMs; an exclusive epoch's items run on the whole device."""

PSegments = tuple[tuple[Segment, str], ...]
"""Each segment with the label of its P stream item ("P.attn3")."""

COALESCE_MAX = 16
"""The most segments one P stream item runs while the walk passes boundaries without waiting:
segments passed back to back are submitted together (each item is a hand-off to the launcher
thread, ~100 an epoch of 48 layers one by one), at most this many, so the launcher starts on
the first ones while the walk goes on."""


def p_segments(segments: tuple[Segment, ...]) -> PSegments:
    """The P walk's view of a model's segments (built once per engine)."""
    return tuple((s, "P." + s.label) for s in segments)


class EpochWalk:
    """One P epoch's walk. The walk also carries the segment state between the items of the
    FIFO P stream (``st``, ``notified``, ``o``: written by one item, read by the next).

    ``ep``: the turnstile's :class:`~ainfer_pd.turnstile.turnstile.EpochHandle` of the epoch;
    ``all_reduce(tensor, after=, epoch=, boundary=, gated=)``: enqueue a layer's attention
    all-reduce (attention TP; None: this rank holds every head); ``sample_rows``: the sampler's
    row of each logits row (the prompts the epoch completes), sampled by the head item on the P
    stream, so the event loop reads the first tokens without touching the device."""

    __slots__ = ("epoch", "plan", "ep", "runner", "ctx", "rec", "faults", "faults_on", "timeout_s", "all_reduce",
                 "gated", "lane", "st", "notified", "o", "items", "head", "waited", "counts_waited", "seg_b",
                 "mtp_routed", "mtp", "sample_rows")

    def __init__(self, epoch: int, plan, ep, *, runner, ctx, rec, faults, timeout_s: float,
                 all_reduce: Callable[..., Any] | None = None, sample_rows: list[SampleRow] | None = None) -> None:
        self.epoch, self.plan, self.ep = epoch, plan, ep
        self.sample_rows = sample_rows if sample_rows is not None else []
        self.runner, self.ctx, self.rec, self.faults = runner, ctx, rec, faults
        self.faults_on = faults.active
        self.timeout_s = timeout_s
        self.all_reduce = all_reduce
        self.gated = False
        self.lane: str | None = None   # GATED_LANE while the epoch is gated
        self.st: Any = None
        self.notified: Any = None
        self.o: Any = None
        self.items: list = []          # every item enqueued before the head: a failed one fails the epoch
        self.head = None               # the head's item (its logits rows sampled)
        self.waited = 0.0              # host seconds spent at boundaries (permits and receive counts)
        self.counts_waited = 0.0       # of those, for receive counts
        self.seg_b = 0                 # the boundary P last passed: its communication's segment
        # under attention TP the MTP catch-up (spec.method mtp) after the last layer is walked as
        # items too, its all-reduce routed as the layers' are (else it runs inside the last experts)
        self.mtp_routed = (all_reduce is not None and runner.after_layers is not None
                           and getattr(plan, "catch_up", None) is not None)
        self.mtp: Any = None           # its pending state between the MTP attention and the rest

    async def enqueue(self, segments: PSegments, mode: EpochMode, counts: bool) -> None:
        """Enqueue every segment, passing each boundary as ``mode`` says; ``counts``: wait for the
        receive counts at every expert notification point."""
        self.gated = gated = mode.gated
        self.lane = lane = GATED_LANE if gated else None
        fine = mode.per_layer
        ep, stream, items = self.ep, self.ctx.stream, self.items
        if not fine and not counts and self.all_reduce is None:
            # no boundary past the entry is used: the body is one stream item, not one per segment
            # (each item is a hand-off to the launcher thread: ~100 per epoch of 48 layers)
            if gated:
                ep.publish(segments[0][0].boundary)
                await self._permit(segments[0][0].boundary)
            items.append(stream.submit(self._body, segments[:-1], label="P.body", attrs=P_ITEM, lane=lane))
            self.head = stream.submit(self._head, label=segments[-1][1], attrs=P_ITEM, lane=lane)
            return
        # Segments passed without a wait are submitted together (COALESCE_MAX at most), and
        # whatever is pending is submitted before any wait: the walk yields to the event loop (where
        # the D loop runs) only at a wait, so P's items and D's reach the streams in the same order
        # as one item a segment. Under attention TP a layer's all-reduce sits between its items:
        # one a segment.
        coalesce = self.all_reduce is None
        pending: list[tuple[Segment, str]] = []

        def flush():
            if pending:
                run = tuple(pending)
                pending.clear()
                items.append(stream.submit(self._body, run, label=run[0][1], attrs=P_ITEM, lane=lane))
            return items[-1] if items else None
        last = None                    # the latest attention's last item: done = its counts are on their way
        for seg, label in segments:
            kind, b = seg.kind, seg.boundary
            if kind == HEAD and self.mtp_routed:      # still inside the last layer's segment
                self._mtp_catch_up()
            if b is not None:
                if kind == EMBED:                      # the entry
                    if gated:
                        ep.publish(b)
                        await self._permit(b)
                elif kind == HEAD:                     # the last layer end
                    if fine:
                        ep.publish(b, final=True)
                else:                                  # a notification point or a layer end
                    if fine:
                        ep.publish(b)
                    if counts and kind == EXPERTS:
                        if coalesce:
                            last = flush()             # it ends with this layer's attention
                        await self._counts(last, b)
                    if fine:
                        if coalesce and not ep.passes(b):
                            flush()
                        await self._permit(b)
            if kind == HEAD:
                flush()
                self.head = stream.submit(self._head, label=label, attrs=P_ITEM, lane=lane)
            elif coalesce:
                pending.append((seg, label))
                if kind == EMBED or len(pending) >= COALESCE_MAX:     # the launcher starts at once
                    flush()
            elif kind == ATTENTION:
                last = self._attention(seg.layer, label)
            elif kind == EXPERTS:
                items.append(stream.submit(self._experts, seg.layer, label=label, attrs=P_ITEM, lane=lane))
            else:
                items.append(stream.submit(self._embed, label=label, attrs=P_ITEM, lane=lane))

    async def done(self) -> DeviceSample | None:
        """The head's result (the logits rows sampled) once it completed, raising the first failure
        of the items before it (the stream runs on after a failed item, so a failure is only seen
        by looking)."""
        try:
            result = await self.head.done()
        except BaseException:
            self._raise_first_failure()
            raise
        self._raise_first_failure()
        return result

    def _raise_first_failure(self) -> None:
        for w in self.items:
            f = w.enqueued()
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()

    # ------------------------------------------------------------------ boundaries (event loop)
    async def _permit(self, b: int) -> None:
        rec = self.rec
        t0 = rec.now()
        await self.ep.permit(b)
        self.waited += rec.now() - t0
        self.seg_b = b
        rec.event("p_permit", epoch=self.epoch, boundary=b)
        set_log_context(epoch=self.epoch, boundary=b)

    async def _counts(self, last, b: int) -> None:
        """Receive counts: P's device progress paces its host."""
        rec = self.rec
        t0 = rec.now()
        await last.done()
        if self.notified is not None:
            await self.notified.wait(timeout=self.timeout_s)
        if self.faults.slow_counts_ms:
            await asyncio.sleep(self.faults.slow_counts_ms / 1e3)
        rec.event("p_counts", epoch=self.epoch, boundary=b)
        rec.sample("p_counts_wait_s", rec.now() - t0)
        self.waited += rec.now() - t0
        self.counts_waited += rec.now() - t0

    def _attention(self, layer: int, label: str):
        """Enqueue layer ``layer``'s attention and router (the expert notification); returns the
        item whose completion means the receive counts are on their way. Under attention TP the
        partial output is all-reduced by its own item in between (``seg_b``: its segment)."""
        ctx = self.ctx
        if self.all_reduce is None:
            w = ctx.stream.submit(self._attn_route, layer, label=label, attrs=P_ITEM, lane=self.lane)
            self.items.append(w)
            return w
        return self._all_reduced(partial(self._attention_only, layer), label, lambda: self.o,
                                 partial(self._route, layer), f"P.route{layer}")

    def _mtp_catch_up(self) -> None:
        """Enqueue the MTP catch-up after the last layer as the layers' attention is under TP: the
        MTP layer's attention, its all-reduce, the rest."""
        self._all_reduced(self._mtp_attention, "P.mtp_attn", lambda: self.mtp.o, self._mtp_rest, "P.mtp_rest")

    def _all_reduced(self, first: Callable[[], None], first_label: str, partial_sum: Callable[[], Any],
                     then: Callable[[Any], None], then_label: str):
        """Enqueue ``first`` (it leaves a sum over this rank's heads: ``partial_sum()``), the sum's
        all-reduce (routed by the ordering: the engine's hook; ``seg_b``: its segment), then
        ``then(all_reduce_item)`` after it; returns the last item."""
        ctx = self.ctx
        wa = ctx.stream.submit(first, label=first_label, attrs=P_ITEM, lane=self.lane)
        self.items.append(wa)
        ar = self.all_reduce(partial_sum, after=wa, epoch=self.epoch, boundary=self.seg_b, gated=self.gated)
        self.items.append(ar)
        w = ctx.stream.submit(then, ar, label=then_label, attrs=P_ITEM, lane=self.lane,
                              deps=(ar,) if ar.stream is not ctx.stream else ())
        self.items.append(w)
        return w

    # ------------------------------------------------------------------ segments (on the P stream)
    def _body(self, segments: PSegments) -> None:
        """``segments`` back to back: every one but the head (an epoch that passes no boundary
        inside), or a run the walk passed without a wait (:data:`COALESCE_MAX`)."""
        for seg, _ in segments:
            kind = seg.kind
            if kind == ATTENTION:
                self._attn_route(seg.layer)
            elif kind == EXPERTS:
                self._experts(seg.layer)
            else:
                self._embed()

    def _embed(self) -> None:
        self.st = self.runner.embed(self.plan)

    def _attn_route(self, layer: int) -> None:
        if self.faults_on:
            self.faults.on_p_segment(self.epoch, layer)
        self.st = self.runner.attn_route(layer, self.st, self.plan)
        self.notified = self.runner.notify(self.ctx, self.st)      # the expert notification

    def _attention_only(self, layer: int) -> None:
        if self.faults_on:
            self.faults.on_p_segment(self.epoch, layer)
        self.o = self.runner.attention(layer, self.st, self.plan)

    def _route(self, layer: int, ar) -> None:
        self.st = self.runner.after_attention(layer, self.st, ar.enqueued().result(), self.plan)
        self.notified = self.runner.notify(self.ctx, self.st)

    def _experts(self, layer: int) -> None:
        r = self.runner
        self.st = r.experts(layer, self.st, self.ctx, self.notified)
        if r.after_layers is not None and layer == r.num_layers - 1 and not self.mtp_routed:
            r.after_layers(self.st, self.plan, self.ctx)        # inside the last layer's segment

    def _mtp_attention(self) -> None:
        self.mtp = self.runner.after_layers_attention(self.st, self.plan, self.ctx)

    def _mtp_rest(self, ar) -> None:
        self.runner.after_layers_rest(self.mtp, ar.enqueued().result(), self.ctx)

    def _head(self) -> DeviceSample | None:
        """The logits rows sampled (None: the epoch completes no prompt, nothing to sample)."""
        logits = self.runner.head(self.st, self.plan)
        return sample_on_device(logits, self.sample_rows, pinned=True) if self.sample_rows else None
