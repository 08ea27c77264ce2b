"""Output KV taken as rows decode, and preemption when the pool is full (``cache.reserve_output:
estimate``; the policy, pure: :mod:`ainfer_pd.sched.output_reserve`). A mixin of
:class:`~ainfer_pd.engine.loop.turns.TurnBook` (its state is the book's).

Before each D iteration every row it runs takes the blocks that iteration may write
(:meth:`KVGrowth.grow_rows`). When the pool (free blocks and every cached one, evicted least
recently released first) cannot give them, the engine reads the iteration in flight and
preempts decoding rows, the last in the order D serves them first, until the rest fit
(:meth:`KVGrowth.fit_rows`). A preempted turn keeps its output; what it wrote stays cached as
content; it goes to the front of the waiting queue with its prompt plus that output as the
prompt its next admission prefills (``Turn.resumed``), sharing whatever of it is still cached, and
samples its next token from the last one's logits with the same sampler counter, so its tokens
are those it would have made without the preemption. Under ``all`` nothing here acts: a turn
holds its whole budget from admission on.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from ...sched.output_reserve import OutputReserve, growth_target, headroom_blocks, next_ratio
from ..kv import prefix
from .state import Turn, TurnState

if TYPE_CHECKING:
    from ...metrics.recorder import Recorder
    from ..kv.kv_cache import KVCacheManager


def write_ahead(spec) -> int:
    """Positions past its last token a row of an iteration may write: one fed ahead of an
    overlapped read, and the drafts of the speculator ``spec`` (None: no speculation)."""
    return 1 + (spec.k_max if spec is not None else 0)


class KVGrowth:
    """Growth of decoding rows' blocks, the admission headroom it needs, and preemption."""

    waiting: deque[Turn]
    decoding: list[Turn]
    kv: "KVCacheManager"
    rec: "Recorder"
    max_context_len: int
    reserve: OutputReserve
    ratio: float
    num_preemptions: int
    notify: Callable[[], None]
    by_priority: Callable[..., list[Turn]]       # the book's order (TurnBook.by_priority)

    _headroom: int | None = None
    """:meth:`headroom` as of this D iteration (None: computed at the next call)."""

    def headroom(self) -> int:
        """Blocks admission leaves for the admitted turns' expected output (0 under ``all``).
        Computed once a D iteration (every row's term moves with its length and the ratio) and
        kept: a turn admitted since adds its own term (:meth:`headroom_admitted`); a row that
        ended, grew or wrote since still counts as it did, which only leaves more room than
        needed until the next iteration. A preemption (the ratio back at its start) recomputes it."""
        if not self.reserve.grows:
            return 0
        if self._headroom is None:
            self._headroom = self._headroom_now()
        return self._headroom

    def headroom_admitted(self, t: Turn) -> None:
        """``t`` was just reserved: its expected output joins the kept :meth:`headroom`."""
        if self._headroom is None or not self.reserve.grows:
            return
        s = self.kv.trajectories.get(t.tid)
        if s is not None and s.lifetime == t.lifetime:
            self._headroom += headroom_blocks(self.reserve, [(len(t.prompt), prefix.left(t), len(s.blocks))],
                                              self.ratio, self.kv.block_size)

    def _headroom_now(self) -> int:
        seqs, rows = self.kv.trajectories, []
        for t in self.decoding:
            s = seqs.get(t.tid)
            if s is not None and s.lifetime == t.lifetime:
                rows.append((t.seq_len, prefix.left(t), len(s.blocks)))
        for t in self.waiting:
            s = seqs.get(t.tid) if t.lifetime else None
            if s is not None and s.lifetime == t.lifetime:
                rows.append((len(t.prompt), prefix.left(t), len(s.blocks)))
        return headroom_blocks(self.reserve, rows, self.ratio, self.kv.block_size)

    def grow_rows(self, rows: list[Turn], extra: int, *, step: bool = True) -> list[Turn]:
        """Give each of the decoding ``rows`` the blocks an iteration writing up to ``extra``
        positions past its last token needs (a token fed ahead of the read, draft tokens).
        Returns those the pool could not serve. ``step``: this is a D iteration's call (the
        ratio decays one step)."""
        if not self.reserve.grows:
            return []
        if step:
            self.ratio = next_ratio(self.reserve, self.ratio, preempted=False)
            self._headroom = None
        short, seqs, bs = [], self.kv.trajectories, self.kv.block_size
        for t in rows:
            s = seqs.get(t.tid)                  # most rows hold their next positions already: no call
            if s is not None and s.lifetime == t.lifetime and len(s.blocks) * bs >= t.seq_len + extra:
                continue
            need = growth_target(t.seq_len, extra, len(t.context), t.params.max_new_tokens, self.max_context_len)
            if not self.kv.grow(t.tid, t.lifetime, need):
                short.append(t)
        return short

    def fit_rows(self, rows_of: Callable[[], list[Turn]], extra: int) -> int:
        """Preempt decoding rows until every row ``rows_of()`` gives holds its blocks (see
        :meth:`grow_rows`); called with no device work touching a decoding row. Returns how many
        were preempted."""
        n = 0
        short = self.grow_rows(rows_of(), extra, step=False)
        while short:
            victim = self.preemptable()
            if victim is None:
                break
            self.preempt(victim)
            n += 1
            short = self.grow_rows(rows_of(), extra, step=False)
        return n

    def preemptable(self) -> Turn | None:
        """The row a full pool preempts: the last, in the order D serves them, of the decoding
        rows no device work touches."""
        rows = [t for t in self.decoding if not t.abort_requested and t.in_flight == 0]
        return self.by_priority(rows, waiting=False)[-1] if rows else None

    def preempt(self, t: Turn) -> None:
        """Send the decoding ``t`` back to the front of the waiting queue, its blocks released
        (what it wrote stays cached), its prompt now its context plus its output."""
        self.decoding.remove(t)
        self.kv.finish_turn(t.tid, t.lifetime, t.seq_len - 1, self.rec.now())
        old_prompt, old_hashes = t.prompt, t.prompt_hashes
        t.resumed = t.context + t.out_tokens
        known = (old_prompt[:len(old_hashes) * self.kv.block_size], old_hashes) if old_hashes else None
        t.prompt_hashes = self.kv.prompt_hashes(t.resumed, tid=t.tid, known=known)
        t.state, t.lifetime, t.prefilled, t.prefix_view = TurnState.WAITING, 0, 0, None
        t.preemptions += 1
        self.waiting.appendleft(t)
        self.num_preemptions += 1
        self.ratio = next_ratio(self.reserve, self.ratio, preempted=True)
        self._headroom = None
        self.rec.count("kv_preemptions")
        self.notify()
