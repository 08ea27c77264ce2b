"""The engine's speculator: which rows of a D iteration verify drafts, and how many (issue 38).

One per rank, owned by the D driver (and the mixed-chunked loop), touched only from the event
loop. Its drafter is the :class:`~.suffix.SuffixDrafter` (``spec.method: suffix``) or the
:class:`~.mtp.MtpDrafter` (``mtp``: drafts on the device, :meth:`Speculator.prepare` before
:meth:`Speculator.plan`). It keeps the suffix drafter in step with the turns: a trajectory's sequence
(its turn's prompt, then what the turn generated) is extended lazily, the tokens it does not hold
yet, each time the trajectory is a row (:meth:`Speculator.sync`), and forgotten when the worker
releases the trajectory. Drafts are suggestions: verification keeps the output exact whatever they
are, so a sequence the drafter holds stale (a cancelled turn's tokens) only costs acceptance.

:meth:`Speculator.plan` gives a batch's drafts: each row's draft is capped at the tokens it has
left less one (``max_new_tokens`` and the context limit: the K + 1 positions a verify writes stay
inside the turn's KV reservation, and the tokens it emits never pass the turn's limit), then
:func:`~.adaptive.choose` takes K from the measured verify cost at the batch's size and the rows'
acceptance (``spec.adaptive``; else every row verifies its whole draft). On several ranks a
leader drafts up to the caps and offers them (:meth:`Speculator.offer`); K is the world's, the
same on every rank (:func:`~.verify_shape.world_k`), and :meth:`Speculator.plan_at` trims the
drafts to it. :meth:`observe` feeds the
acceptance back. :meth:`worth_drafting` says, before any drafting, whether the cost table could
let the batch speculate at all (at high batch it cannot: the D loop then stays overlapped).
A row whose recent host drafts came back empty is skipped (:mod:`~.backoff`: not drafted, a
zero-length draft) until its re-probe (an MTP row never is: its empty drafts are transient), and
:meth:`worth_drafting` counts only the rows it would probe now: a batch of rows all in backoff stays overlapped, with no host drafting at all;
overlapped, :meth:`stale_hit` probes them on the tokens already read, and the D driver reads the
iteration in flight (giving up the overlap, before its turnstile round) only when one of them has a
draft. That draft's first token foretold the token in flight; the plan books it, once read, as one
draft judged in the row's acceptance, so a row that samples away from its drafts stops costing
the overlap without ever verifying.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..config_spec import SpecConfig
from ..engine.loop.state import SeqTokens, Turn
from .adaptive import Acceptance, VerifyCosts, choose, could_pay, observe, relative_costs
from .backoff import NO_BACKOFF, Backoff, Rest, after_draft
from .overhead import DraftOverhead
from .verify_shape import DraftOffer
from .suffix import SuffixDrafter


@dataclass(slots=True)
class SpecBatch:
    """A verify batch: ``drafts[i]`` for ``rows[i]`` (empty: the row decodes one token), ``k`` the
    longest, ``gain`` the expected tokens per unit of time over plain decoding (1.0: not adaptive)."""

    rows: list[Turn]
    drafts: list[list[int]]
    k: int
    gain: float
    host_s: float = 0.0
    """Host seconds :meth:`Speculator.plan` took (the drafts; the D driver adds the verify's build)."""


class Speculator:
    def __init__(self, cfg: SpecConfig, max_context_len: int, costs: VerifyCosts | None, rec, drafter=None) -> None:
        self.cfg, self.max_context_len, self.costs, self.rec = cfg, max_context_len, costs, rec
        self.k_max = cfg.num_draft_tokens
        self.drafter = drafter if drafter is not None else SuffixDrafter()
        """``extend`` / ``release`` / ``forget`` / ``draft`` (host), and ``prepare`` for one that drafts on the
        device (:class:`~.mtp.MtpDrafter`); the suffix drafter by default."""
        self.on_device = callable(getattr(self.drafter, "prepare", None))
        """The drafter runs on the device (MTP): its empty drafts are transient (no hidden state
        stashed yet), so no row backs off; a host drafter's rows do (:mod:`.backoff`)."""
        self.held: dict[str, tuple[Turn, int]] = {}        # tid -> (the turn last given, tokens the drafter holds)
        self.pending: dict[object, dict[str, Turn]] = {}   # group -> {tid: its turn noted, not given yet}
        self.pending_group: dict[str, object] = {}         # tid -> its group, while noted in pending
        self.acc: dict[str, Acceptance] = {}
        self._best_rate: float | None = None  # the best rate in acc (None: to be recomputed)
        self._stale: dict[str, tuple[Turn, int, int]] = {}   # tid -> (turn, position, token) a stale probe foretold
        self.backoff: dict[str, tuple[Turn, Backoff]] = {}  # tid -> (the turn drafted empty, its backoff)
        self.rest = Rest() if cfg.adaptive and not self.on_device else Rest(max_wait=0)
        """The whole speculator's backoff over D iterations after fruitless tries (:class:`~.backoff.Rest`):
        adaptive host drafting only (not adaptive, every row verifies its whole draft; a device
        drafter's empty drafts are transient)."""
        self.num_verifies = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_emitted = 0
        self.overhead = DraftOverhead()
        """What a drafting iteration costs besides its verify (its host time, the device idle it
        causes: :mod:`.overhead`), counted against speculating; it fades while nothing is drafted."""
        self.num_empty_plans = 0              # plan() calls that gave no verify (no row had a draft, or K = 0)
        self.num_rows_skipped = 0             # rows of a plan not drafted: in backoff
        self._offer_s = 0.0                   # host seconds of the last offer's drafts (several ranks)

    # ------------------------------------------------------------------ the drafter's sequences
    def sync(self, t: Turn) -> None:
        """The drafter is to hold ``t``'s sequence. A host drafter is given it lazily: the turn is
        noted and its tokens are indexed only when a row of its group is drafted (:meth:`_flush`),
        so a rollout that never drafts indexes nothing and its releases forget nothing."""
        if self.on_device:                  # its extend is a no-op: a rollback's forget stays eager
            self._give(t)
            return
        tid = t.tid
        g = self.pending_group.get(tid)
        if g is None:
            g = self.pending_group[tid] = self._group(t)
        self.pending.setdefault(g, {})[tid] = t

    def _group(self, t: Turn) -> object:
        """The drafter's group of ``t``'s sequence: its GRPO siblings' (``spec.siblings``), else its own."""
        return (t.traj.group or t.tid) if self.cfg.siblings else t.tid

    def _flush(self, t: Turn) -> None:
        """Give the drafter the tokens of every sequence of ``t``'s group noted since (``t`` first
        noted by :meth:`sync`): ``t`` is drafted next."""
        g = self.pending_group.get(t.tid)           # None: given already (a device drafter's, eagerly)
        for s in (self.pending.pop(g).values() if g is not None else ()):
            del self.pending_group[s.tid]
            self._give(s)

    def _give(self, t: Turn) -> None:
        """Give the drafter the tokens of ``t``'s sequence it does not hold yet."""
        tid = t.tid
        turn, n = self.held.get(tid, (None, 0))
        total = t.seq_len
        if n > total or (turn is not t and n > len(t.context)):     # rolled back (a cancelled turn): start again
            self.drafter.forget(tid)
            n = 0
        if n < total:
            self.drafter.extend(tid, SeqTokens(t)[n:total], group=self._group(t))
        self.held[tid] = (t, total)

    def release(self, tid: str) -> None:
        """The trajectory was released: its acceptance and backoff go, and the drafter is told
        (:meth:`~.suffix.SuffixDrafter.release`: its tokens stay for its live siblings). A sequence
        only noted, never given, is not given now."""
        g = self.pending_group.pop(tid, None)
        if g is not None:
            noted = self.pending[g]
            del noted[tid]
            if not noted:
                del self.pending[g]
        self.drafter.release(tid)
        self.held.pop(tid, None)
        if self.acc.pop(tid, None) is not None:
            self._best_rate = None
        self.backoff.pop(tid, None)

    # ------------------------------------------------------------------ a batch
    def rates(self, rows: list[Turn]) -> list[float]:
        default = Acceptance().rate
        return [self.acc[t.tid].rate if t.tid in self.acc else default for t in rows]

    def probes(self, t: Turn) -> bool:
        """Is ``t`` drafted now? (No while it is in backoff after empty drafts; a new turn of the
        trajectory is probed at once: its prompt may bring what the drafter can match.)"""
        if self.on_device:
            return True
        turn, b = self.backoff.get(t.tid, (t, NO_BACKOFF))
        return turn is not t or b.probes(t.seq_len)

    def worth_drafting(self, rows: list[Turn], world_rows: int = 0) -> bool:
        """Could the batch speculate, were every row probed now to bring a whole draft (its cap)?
        (False: no drafting, the iteration decodes one token per row; so when every row is in
        backoff. A batch the cost table stopped fades the host-time estimate; it and every
        fruitless try rest the speculator, :class:`~.backoff.Rest`: no check at all then.)
        ``world_rows`` (several ranks): the most rows any replica runs in the iteration
        (:func:`~.adaptive.choose`)."""
        if self.rest.tick():
            self.overhead.fade()
            return False
        worth, costed = self._worth(rows, world_rows)
        if costed and not worth:
            self.overhead.fade()
            self.rest.fruitless()
        return worth

    def _worth(self, rows: list[Turn], world_rows: int) -> tuple[bool, bool]:
        """(worth drafting, the cost table decided it). A table that keeps K = 0 even were every
        row to bring a whole draft at the best acceptance any trajectory has decides it at once,
        with no per-row work (:func:`~.adaptive.could_pay`): a batch that cannot speculate costs
        one pass over the known acceptances and O(K)."""
        if self.cfg.adaptive and self.costs is not None and rows:
            if self._best_rate is None:
                self._best_rate = max(max((a.rate for a in self.acc.values()), default=0.0), Acceptance().rate)
            if not could_pay(self.costs, self._best_rate, len(rows), k_max=self.k_max, host_s=self.overhead.total_s,
                             world_rows=world_rows):
                return False, True
        probing, caps = probing_rows(rows, self.backoff, self.k_max, self.max_context_len, self.on_device)
        if not probing:
            return False, False
        if not self.cfg.adaptive:
            return True, False
        if self.costs is None:
            return False, False
        return choose(self.costs, self.rates(probing), caps, k_max=self.k_max, host_s=self.overhead.total_s,
                      world_rows=world_rows, plain_rows=len(rows) - len(probing)).k > 0, True

    def stale_hit(self, rows: list[Turn]) -> bool:
        """Overlapped, before reading the iteration in flight (which holds each row's next token):
        would any row be worth settling for? A host drafter probes each row it would draft now on
        the tokens it has (one short of the fresh context); a row with no draft there books the
        empty probe (:mod:`.backoff`) and gives no reason to settle. A fresh draft's match ends at
        the in-flight token, so one that begins there is missed until the row's next probe; a
        device drafter (MTP) always says yes (its drafts need the settled tokens). Adaptive, the
        drafts found must also pay: each row's stale draft is taken up to its cap plus the token
        in flight, and what follows that token (the fresh draft, were it foretold right) goes to
        :func:`~.adaptive.choose` with the rows' acceptance and the overhead (the overlap this read
        gives up is in it); K = 0 there keeps the overlap, as a probe with no draft does, and rests
        the speculator. Drafts stay suggestions: this only decides whether the overlap is given up
        for them."""
        if self.on_device:
            return True
        self._stale.clear()
        priced = self.cfg.adaptive and self.costs is not None     # else the foretold token is all it needs
        lens = []
        for t, c in zip(*probing_rows(rows, self.backoff, self.k_max, self.max_context_len, self.on_device)):
            self.sync(t)
            self._flush(t)
            d = self.drafter.draft(t.tid, c + 1 if priced else 1)
            if d:
                self._stale[t.tid] = (t, t.seq_len, d[0])
                lens.append(len(d) - 1)
            else:
                self._after_draft(t, 0)
        hit = bool(self._stale) and (not priced or choose(
            self.costs, self.rates([s[0] for s in self._stale.values()]), lens, k_max=self.k_max,
            host_s=self.overhead.total_s, plain_rows=len(rows) - len(lens)).k > 0)
        if not hit:
            self.rest.fruitless()
        return hit

    def _judge_stale(self, t: Turn) -> None:
        """A stale probe's draft foretold the token ``t`` had in flight: now read, it is one draft
        token judged (accepted when equal: under sampling that happens with the target's
        probability of the draft, as a verify's acceptance does), booked in ``t``'s acceptance.
        Rows that sample freely then stop settling the overlap for drafts that never verify."""
        turn, pos, tok = self._stale.pop(t.tid, (None, 0, 0))
        if turn is t and t.seq_len > pos:
            self.acc[t.tid] = observe(self.acc.get(t.tid, Acceptance()), 1, int(SeqTokens(t)[pos:pos + 1] == [tok]))
            self._best_rate = None

    def cap(self, t: Turn) -> int:
        """The most drafts ``t`` may verify: its tokens left (length, context) less one."""
        left = min(t.params.max_new_tokens - len(t.out_tokens), self.max_context_len - t.seq_len)
        return max(0, min(self.k_max, left - 1))

    async def prepare(self, rows: list[Turn], world: tuple[int, int] | None = None, share=None) -> None:
        """Before :meth:`plan` / :meth:`offer`: a drafter that runs on the device (MTP) drafts
        ``rows`` now, each up to its cap (one D stream item; ``world`` = (rows, depth) on several
        ranks, ``share`` the chain's way to the TP followers: :meth:`~.mtp.MtpDrafter.prepare`); a
        model-free one has nothing to do."""
        if self.on_device:
            await self.drafter.prepare(rows, [self.cap(t) for t in rows], world, share)

    def plan(self, rows: list[Turn]) -> SpecBatch | None:
        """The drafts of a batch of ``rows`` on one rank (:meth:`_plan`), with the host time they
        took: a plan that gives no verify counts it here (spent for nothing), a verify batch
        carries it to the D driver, which adds the verify's build."""
        t0 = time.perf_counter()
        batch = self._plan(rows)
        if batch is None:
            self.overhead.observe_host(time.perf_counter() - t0)        # spent, for no verify
            self.rest.fruitless()
        else:
            batch.host_s = time.perf_counter() - t0
        return batch

    def _plan(self, rows: list[Turn]) -> SpecBatch | None:
        """The drafts of a batch of ``rows``; None when no row verifies any (plain decoding)."""
        drafts = self._draft_rows(rows)
        gain = 1.0
        if self.cfg.adaptive:
            choice = choose(self.costs, self.rates(rows), [len(d) for d in drafts], k_max=self.k_max,
                            host_s=self.overhead.total_s)
            drafts = [d[:n] for d, n in zip(drafts, choice.per_row)]
            gain = choice.gain
        return self._batch(rows, drafts, gain)

    def _draft_rows(self, rows: list[Turn]) -> list[list[int]]:
        """Each row's draft up to its cap. A row in backoff is synced (its tokens serve its
        siblings' drafts, once one of them is drafted) but not drafted."""
        drafts = []
        for t in rows:
            self.sync(t)
            if self._stale:
                self._judge_stale(t)
            c = self.cap(t)
            if c == 0:
                drafts.append([])
            elif not self.probes(t):
                self.num_rows_skipped += 1
                drafts.append([])
            else:
                self._flush(t)
                drafts.append(self.drafter.draft(t.tid, c))
                self._after_draft(t, len(drafts[-1]))
        self._stale.clear()
        return drafts

    def _batch(self, rows: list[Turn], drafts: list[list[int]], gain: float) -> SpecBatch | None:
        if max((len(d) for d in drafts), default=0) == 0:
            self.num_empty_plans += 1
            return None
        return SpecBatch(rows, drafts, max(len(d) for d in drafts), gain)

    # ------------------------------------------------------------------ several ranks: the world's K
    def offer(self, rows: list[Turn]) -> tuple[list[list[int]], DraftOffer]:
        """A replica leader's drafts for ``rows``, each up to its cap, and what it announces
        (:class:`~.verify_shape.DraftOffer`); the world's K then trims them (:meth:`plan_at`)."""
        t0 = time.perf_counter()
        drafts = self._draft_rows(rows)
        self._offer_s = time.perf_counter() - t0
        return drafts, DraftOffer.of(self.rates(rows), [len(d) for d in drafts], self.k_max, self.overhead.total_s)

    def plan_at(self, rows: list[Turn], drafts: list[list[int]], k: int) -> SpecBatch | None:
        """The verify batch of :meth:`offer`'s ``drafts`` at the world's K = ``k`` (None: K = 0, or
        no row of this replica drafts at it), with the host time the drafts took."""
        batch = self._batch(rows, [d[:k] for d in drafts], 1.0)
        if batch is None:
            self.overhead.observe_host(self._offer_s)      # spent, for no verify of this replica's
            self.rest.fruitless()
        else:
            batch.host_s = self._offer_s
        return batch

    def _after_draft(self, t: Turn, drafted: int) -> None:
        if self.on_device:
            return
        turn, b = self.backoff.get(t.tid, (t, NO_BACKOFF))
        b = after_draft(b if turn is t else Backoff(b.wait), t.seq_len, drafted)
        if b == NO_BACKOFF:
            self.backoff.pop(t.tid, None)
        else:
            self.backoff[t.tid] = (t, b)

    def observe(self, batch: SpecBatch, accepted: list[int | None]) -> None:
        """A verify was read: row i accepted ``accepted[i]`` of its drafts (None: the row was not
        booked, ended or aborted since the launch); the drafter gets the rows' new tokens."""
        self.num_verifies += 1
        if self._paid(batch, accepted):
            self.rest.paid()
        else:
            self.rest.fruitless()
        for t, d, a in zip(batch.rows, batch.drafts, accepted):
            if a is None:
                continue
            self.num_drafted += len(d)
            self.num_accepted += a
            self.num_emitted += a + 1
            if d:
                self.acc[t.tid] = observe(self.acc.get(t.tid, Acceptance()), len(d), a)
                self._best_rate = None
            self.sync(t)
        self.rec.count("spec_verifies")

    def _paid(self, batch: SpecBatch, accepted: list[int | None]) -> bool:
        """Did the verify pay for itself: its booked rows emitted more tokens than plain decoding of
        them would have in its time, at the cost table's price (width ``batch.k`` + 1 at its rows, with
        the host overhead :func:`~.adaptive.choose` counted)? One accepted draft among 64 rows does not
        pay for a verify 1.5x a plain pass, and must not end the speculator's rest (it would try again
        at every iteration). Without a table (not adaptive): any accepted draft. None (a row not
        booked) and 0 alike buy nothing."""
        got = [a for a in accepted if a is not None]
        if not any(got):
            return False
        if self.costs is None or not self.cfg.adaptive:
            return True
        cost = dict(relative_costs(self.costs, len(got), batch.k, self.overhead.total_s)).get(batch.k)
        return cost is None or (len(got) + sum(got)) >= len(got) * cost

    def metrics(self) -> dict[str, float]:
        """Drafts verified and accepted so far, the tokens a verifying row emitted per pass, the
        plans that gave no verify and the rows a plan skipped (in backoff)."""
        rows = self.num_emitted - self.num_accepted                  # one row-verify emits accepted + 1
        return {"spec_verifies": self.num_verifies, "spec_drafted": self.num_drafted,
                "spec_empty_plans": self.num_empty_plans, "spec_rows_skipped": self.num_rows_skipped,
                "spec_accepted": self.num_accepted, "spec_host_ms": 1e3 * self.overhead.host_s,
                "spec_lost_ms": 1e3 * self.overhead.lost_s,
                "spec_acceptance": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                "spec_tokens_per_row_pass": self.num_emitted / rows if rows else 0.0}


def probing_rows(rows: list[Turn], backoff: dict, k_max: int, max_context_len: int,
                 on_device: bool) -> tuple[list[Turn], list[int]]:
    """The rows :meth:`Speculator.probes` would draft now with a cap > 0 (:meth:`Speculator.cap`),
    and their caps: one pass with both inlined (every D iteration runs it, over every row)."""
    probing, caps = [], []
    for t in rows:
        n = len(t.context) + len(t.out_tokens)
        if not on_device:
            b = backoff.get(t.tid)
            if b is not None and b[0] is t and n < b[1].probe_at:
                continue
        c = min(k_max, t.params.max_new_tokens - len(t.out_tokens) - 1, max_context_len - n - 1)
        if c > 0:
            probing.append(t)
            caps.append(c)
    return probing, caps
