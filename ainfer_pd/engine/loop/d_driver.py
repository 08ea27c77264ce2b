"""The D driver: one D iteration per step, with an optional previous iteration in flight.

Plain, an iteration is launched, completes and its tokens are booked before the next one is
built. Overlapped (``scheduler.overlap_decode``, one rank: :mod:`~ainfer_pd.engine.loop.d_overlap`),
iteration n+1 is launched before n is read, its rows that were in n fed on the device from n's
tokens, and n is read and booked while n+1 runs; every step that runs no iteration reads the one
in flight first (:meth:`DDriver.settle`). Inside a gated epoch the launch is a turnstile round:
P's next boundary first (rendezvous 1), the enqueue ACK after the launch (rendezvous 2).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from ...sched.planner import plan_decode
from .d_overlap import InFlightD, decode_sampled, feed_of, rows_after, verify_sampled
from .kv_growth import write_ahead
from ..runtime.runner import BatchPlan
from .state import Turn, TurnState
from .timings import EngineTimings

D_ITEM = {"phase": "D", "kind": "iter"}


class DDriver:
    """D iterations of one rank. ``dist``: the multi-rank parts (None on one rank): the padded,
    shared batch, D's collectives around the launch."""

    def __init__(self, *, sched, max_context_len: int, rec, book, runner, ctx, turnstile, timings: EngineTimings,
                 faults, p,
                 notify: Callable[[], None], overlap: bool, dist=None, spec=None) -> None:
        self.sched, self.max_context_len = sched, max_context_len       # the scheduler config section
        self.rec, self.book, self.runner, self.ctx = rec, book, runner, ctx
        self.turnstile, self.timings, self.faults, self.p = turnstile, timings, faults, p
        self.notify, self.overlap, self.dist = notify, overlap, dist
        self.spec = spec                      # the Speculator (spec.method), or None
        self.prev: InFlightD | None = None    # overlapped: the iteration launched and not read yet
        self.in_flight = False                # a D iteration is on the device, not read yet
        self.last = None                      # the D stream item launched last
        self.t_wanted: float | None = None    # since when D has had rows it could not run
        self.num_iters = 0
        self.device_delay_s = 0.0             # fault injection: replicas out of phase on the device
        # the overlap given up for a draft (a stale hit's early read, a verify read before the next
        # launch): (P's epoch, the time) then, and the launch that starts after the gap the
        # speculator is charged (:meth:`_charge_gap`)
        self._broke: tuple[int, float] | None = None
        self._gap_launch = None
        self._last_end: float | None = None   # the device end of the iteration read last

    # ------------------------------------------------------------------ rows
    def live_rows(self) -> list[Turn]:
        return [t for t in self.book.decoding if not t.abort_requested]

    def rows(self, limit: int | None = None) -> list[Turn]:
        """The rows of the next iteration (by priority when more are ready than fit)."""
        cap = self.sched.max_decode_batch
        ready = self.book.decoding
        if len(ready) > cap:
            ready = self.book.by_priority(list(ready), waiting=False)
        rows = [t for t in plan_decode(ready, cap) if not t.abort_requested]
        return rows if limit is None else rows[:limit]

    def would_draft(self) -> bool:
        """Several ranks: this replica leader's speculator would draft for its next rows (what it
        announces at a step: :attr:`~ainfer_pd.sched.step.StepInputs.d_drafting`), its K costed at
        the most rows any rank had at the last step, or its own if more (this step's are not agreed
        yet). Asked once a step, it is the speculator's iteration: it fades the overhead and
        ticks its rest as :meth:`~ainfer_pd.spec.speculator.Speculator.worth_drafting` does on one
        rank (a leader whose announcement is fruitless rests, and comes back)."""
        if self.dist is None or self.spec is None:
            return False
        rows = self.rows()
        return self.spec.worth_drafting(rows, max(len(rows), self.dist.world_rows))

    def wanted(self) -> None:
        """D has rows but may not run at this step (its wait counts from the first such step)."""
        if self.t_wanted is None:
            self.t_wanted = self.rec.now()

    # ------------------------------------------------------------------ one iteration
    async def iteration(self, *, limit: int | None = None, verify: bool = False) -> None:
        """One D iteration of this rank's rows (at most ``limit``; a multi-rank rank runs it even
        with none: every rank joins D's collectives), through the turnstile round when a gated
        epoch is active. ``verify`` (several ranks: the step's
        :attr:`~ainfer_pd.sched.step.StepDecision.verify`): the iteration may verify drafts, every
        rank agrees its shape first; without it no rank drafts."""
        t_ready = self.t_wanted if self.t_wanted is not None else self.rec.now()
        self.t_wanted = None
        await self._make_room(limit)
        if self._broke is not None and self.rec.now() - self._broke[1] > self.timings.d_iter_ema:
            self._broke = None    # a verify's read, then D waited (rows, P): not a gap drafting made
        drafting = self.dist is None and self.spec is not None and await self._will_draft(limit)
        rnd = await self.turnstile.before_decode()
        rows = self._grown(self.rows(limit))
        batch = None
        if self.dist is not None:
            if verify:                       # inside the round: P is released after the verify's launch
                batch = await self._agreed_drafts(rows, rnd)
        elif drafting:
            await self.spec.prepare(rows)    # a device drafter (MTP) drafts on the D stream first
            batch = self.spec.plan(rows)     # its host time: the drafts, and the build below
        ahead = [0] * len(rows)
        if self.overlap and batch is None:
            rows, ahead = rows_after(rows, self.prev, self.max_context_len)
        if not rows and self.dist is None:
            self._broke = None
            if rnd is not None:
                await self.turnstile.after_decode(rnd)
            await self.settle()
            return
        try:
            if batch is not None:
                await self._plain(rows, rnd, t_ready, batch)
            elif self.overlap:
                await self._overlapped(rows, ahead, rnd, t_ready)
            else:
                await self._plain(rows, rnd, t_ready)
        finally:
            if self.dist is not None:
                self.dist.d_iteration_done()
        self.num_iters += 1
        self.notify()

    async def _make_room(self, limit: int | None) -> None:
        """``cache.reserve_output: estimate``: every row of the next iteration takes the blocks it
        may write (one position fed ahead of an overlapped read, the drafts); when the pool cannot
        give them, the iteration in flight is read (a preempted row's KV must be untouched) and
        rows are preempted until the rest fit (:mod:`.kv_growth`)."""
        book = self.book
        if not book.reserve.grows:
            return
        if not book.grow_rows(self.rows(limit), write_ahead(self.spec)):
            return
        await self.settle()
        if book.fit_rows(lambda: self.rows(limit), write_ahead(self.spec)):
            self.rec.event("kv_preempt", rows=len(book.decoding), waiting=len(book.waiting))

    def _grown(self, rows: list[Turn]) -> list[Turn]:
        """``rows`` as the iteration runs them (after the awaits since :meth:`_make_room`, a P
        epoch may have added rows): those whose blocks the pool cannot give now wait for the next
        iteration, whose :meth:`_make_room` preempts for them."""
        if not self.book.reserve.grows:
            return rows
        short = self.book.grow_rows(rows, write_ahead(self.spec), step=False)
        return [t for t in rows if t not in short] if short else rows

    async def _will_draft(self, limit: int | None) -> bool:
        """One rank, before the iteration's turnstile round: does it draft? The speculator's
        cost check, then (overlapped) its probe on the tokens already read, and the read of the
        iteration in flight a hit asks for (drafts continue the rows' last tokens). Done before
        the round, that host work and that wait for the device overlap P's walk instead of
        holding P's release (inside the round P waits for the launch's ACK)."""
        rows = self.rows(limit)
        if not self.spec.worth_drafting(rows):
            return False
        if self.prev is not None:
            if not self.spec.stale_hit(rows):
                return False
            await self.settle()
            self._broke = (self.p.epoch, self.rec.now())
        return True

    async def _agreed_drafts(self, rows: list[Turn], rnd):
        """Several ranks, a drafting iteration: a replica leader drafts ``rows`` up to their caps
        (when its speculator could speculate at the step's :attr:`~.ranks.DistRanks.world_rows`),
        every rank offers what its rows would verify and gain at each K, and verifies at the
        world's K (:meth:`~.ranks.DistRanks.agree_verify`; no overlapped iteration is in flight
        here). A device drafter (MTP) runs its chain on every rank, drafting or not: the world's
        depth over the step's padded rows (its collectives join every rank's). Returns this
        replica's verify batch (None: its rows decode plainly). Under attention TP the leader's
        chain goes to its TP followers, which run it too (:class:`~.mtp_replica.MtpReplica`)."""
        spec, dist = self.spec, self.dist
        drafts, offer = None, dist.plain_offer(len(rows))
        drafting = spec is not None and spec.worth_drafting(rows, dist.world_rows)
        if dist.spec_cfg.mtp:
            depth = dist.spec_cfg.num_draft_tokens
            dist.book_chain(depth, rnd)
            if spec is None:                 # a TP follower: its leader's chain
                await dist.mtp.follow_chain(dist.rows_agreed, depth)
            else:
                await spec.prepare(rows if drafting else [], world=(dist.rows_agreed, depth),
                                   share=dist.mtp.share_chain if dist.mtp is not None else None)
        elif drafting:
            await spec.prepare(rows)
        if drafting:
            drafts, offer = spec.offer(rows)
        k = await dist.agree_verify(offer, self.p.epoch)
        return None if drafts is None else spec.plan_at(rows, drafts, k)

    async def _plain(self, rows: list[Turn], rnd, t_ready: float, batch=None) -> None:
        """An iteration launched, read and booked; ``batch`` (a :class:`~ainfer_pd.spec.speculator.SpecBatch`):
        the rows verify their drafts in it (one pass of 1 + len(draft) positions per row)."""
        t_build = self.rec.now()
        drafts = batch.drafts if batch is not None else None
        if self.dist is not None:       # padded to the agreed rows, shared with the TP followers
            plan = await self.dist.decode_plan(rows, drafts)
        else:
            plan = self.runner.build([], rows, drafts=drafts)
        if batch is not None:
            self.spec.overhead.observe_host(batch.host_s + self.rec.now() - t_build)     # on the launch's path now
        self.rec.sample("d_build_s", self.rec.now() - t_build)
        hold = self.book.in_flight(rows)
        try:
            # sampled (verified) by the item, on the D stream: the read touches no device
            if batch is None:
                fn, args, key = decode_sampled, ([self.book.sample_row(t, live=True) for t in plan.logit_turns],
                                                 None), "sampled"
            else:
                fn, args, key = verify_sampled, ([self.book.sample_row(t) for t in plan.decode],), "verified"
            w, t_launch = await self._launch(rows, rnd, t_ready, fn, self.runner, plan, self.ctx, *args)
            out = {key: await w.done()}
        finally:
            self.in_flight = False
            hold.release()
        self._book(w, t_launch, plan, batch=batch, **out)
        if batch is not None and self.overlap:     # read before the next launch is built: a gap
            self._broke = (self.p.epoch, self.rec.now())

    async def _overlapped(self, rows: list[Turn], ahead: list[int], rnd, t_ready: float) -> None:
        prev = self.prev
        t_build = self.rec.now()
        plan = self.runner.build([], rows, ahead)
        sample_rows = [self.book.sample_row(t, a, live=True) for t, a in zip(rows, ahead)]
        feed = feed_of(rows, ahead, prev, self.runner.device)
        self.rec.sample("d_build_s", self.rec.now() - t_build)
        self.rec.count("d_rows_fed", sum(ahead))
        hold = self.book.in_flight(rows)
        try:
            w, t_launch = await self._launch(rows, rnd, t_ready, decode_sampled, self.runner, plan, self.ctx,
                                             sample_rows, feed, prev.work if prev is not None else None)
        except BaseException:
            self.in_flight = False
            hold.release()
            raise
        launched = InFlightD(plan, w, rows, t_launch, {id(t): i for i, t in enumerate(rows)}, hold)
        if prev is not None:
            self.prev = None
            await self._read(prev)
        self.prev = launched

    async def _launch(self, rows: list[Turn], rnd, t_ready: float, fn, *args):
        """Submit the iteration ``fn(*args)`` on the D stream inside the round ``rnd`` (when one is
        open: its enqueue ACK follows the launch). Returns (the item, launch time)."""
        if self.faults.active:
            skew = self.faults.d_skew_s()
            if skew:
                await asyncio.sleep(skew)
            fn = self.faults.d_item(fn)
        if self.dist is not None:
            self.dist.before_d_launch(rnd)
        w = self.ctx.stream.submit(fn, *args, label="D.iter", attrs={**D_ITEM, "epoch": rnd.epoch if rnd else None},
                                   delay_s=self.device_delay_s)
        if self._broke is not None:
            # no P epoch since (it would fill the gap): the device idles from the last read end to w
            clean = self._broke[0] == self.p.epoch and not self.p.running
            self._gap_launch, self._broke = (w if clean else None), None
        self.in_flight = True
        self.last = w
        if rows:
            self.rec.sample("d_wait_s", self.rec.now() - t_ready)
        self.rec.event("d_launch", rows=len(rows), round=rnd is not None, epoch=self.p.epoch)
        t_launch = self.rec.now()
        if rnd is not None:
            await self.turnstile.after_decode(rnd)
            p_running = self.p.ctx.stream.num_pending
            if p_running:
                # the enqueue ACK came while P work was still running: not a completion fence
                self.rec.count("delayed_ack_rounds")
            self.rec.event("ack", epoch=rnd.epoch, boundary=rnd.boundary, p_running=p_running)
        return w, t_launch

    # ------------------------------------------------------------------ reading
    async def settle(self) -> None:
        """Read the iteration in flight, if any (a step that runs no iteration)."""
        prev, self.prev = self.prev, None
        if prev is not None:
            await self._read(prev)

    async def _read(self, it: InFlightD) -> None:
        """Wait for the overlapped iteration ``it``, then book its tokens."""
        try:
            ds = await it.work.done()
        finally:
            if self.last is it.work:
                self.in_flight = False
            it.hold.release()
        self._book(it.work, it.t_launch, it.plan, sampled=ds)
        self.notify()

    def _charge_gap(self, w) -> None:
        """The speculator is charged the device idle before ``w`` when ``w`` is the launch after
        the overlap was given up for a draft: from the device end of the iteration read before it
        to ``w``'s device start (the host's build and launch, no longer hidden behind the device)."""
        iv = w.interval
        if iv is None:
            return
        if w is self._gap_launch:
            self._gap_launch = None
            if self._last_end is not None and self.spec is not None:
                self.spec.overhead.observe_lost(max(0.0, iv[0] - self._last_end))
        self._last_end = iv[1]

    def _book(self, w, t_launch: float, plan: BatchPlan, batch=None, **out) -> None:
        """An iteration read: its timing samples, its tokens booked (``out``: the logits, or the
        tokens sampled on the device; a verify batch's runs through the speculator), the cleanups
        it unblocked, and the host time that took."""
        t_done = self.rec.now()
        self.timings.d_read(w, t_launch, t_done, overlapped=self.overlap, p_running=self.p.running)
        self._charge_gap(w)
        if batch is not None:
            self.spec.observe(batch, self.book.finish_verify(plan, **out))
        else:
            self.book.finish_decode(plan, **out)
            if self.spec is not None:       # ended rows' last tokens reach their siblings' drafts
                for t in plan.decode:
                    if t.state is TurnState.DONE:
                        self.spec.sync(t)
        self.book.drain_cleanups()
        self.rec.sample("d_post_s", self.rec.now() - t_done)

    def abandon(self) -> None:
        """The loop stopped with an iteration unread: nothing books it."""
        prev, self.prev = self.prev, None
        if prev is not None:
            prev.hold.release()
            self.in_flight = False
            self.book.drain_cleanups()
