"""Which rows the speculator drafts: a trajectory whose recent drafts came back empty is skipped
for a while (issue 38; pure policy, the :class:`~.speculator.Speculator` keeps one per trajectory).

Drafting is host time (a suffix lookup per row) paid before the launch, and a D iteration that
drafts gives up its overlap with the previous one. A row with nothing to suggest (its sampled
output rarely repeats) would pay that every iteration for no draft, so after an empty draft the
row is skipped (it decodes one token, a zero-length draft) for ``wait`` iterations, then probed
again; each further empty draft doubles ``wait`` up to :data:`MAX_WAIT`, a non-empty one resets it.
The wait is counted in the row's own tokens: every iteration it is a row of gives it at least one,
so ``probe_at`` (a sequence length) is reached after at most ``wait`` of its iterations, and a row
that is not scheduled does not use its wait up. Drafts are only suggestions: skipping a row never
changes what is emitted.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecInputError

MAX_WAIT = 32
"""The most iterations a row is skipped between two probes of its drafter."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """A row's empty-draft backoff: ``wait`` iterations skipped after its last empty draft (0: its
    last draft was not empty), drafted again once its sequence reaches ``probe_at`` tokens."""

    wait: int = 0
    probe_at: int = 0

    def probes(self, seq_len: int) -> bool:
        """Is a row of ``seq_len`` tokens drafted now?"""
        return seq_len >= self.probe_at


NO_BACKOFF = Backoff()


def after_draft(b: Backoff, seq_len: int, drafted: int, *, max_wait: int = MAX_WAIT) -> Backoff:
    """``b`` after the row was drafted ``drafted`` tokens at ``seq_len``: reset by a draft, else
    the wait doubled (1, 2, 4, ... ``max_wait``) and the next probe that many iterations on."""
    if drafted < 0 or seq_len < 0 or max_wait < 1:
        raise SpecInputError(f"after_draft: drafted={drafted}, seq_len={seq_len}, max_wait={max_wait} "
                             "(need drafted >= 0, seq_len >= 0, max_wait >= 1)")
    if drafted:
        return NO_BACKOFF
    wait = min(max_wait, max(1, 2 * b.wait))
    return Backoff(wait, seq_len + wait + 1)          # skipped at seq_len + 1 ... seq_len + wait


MAX_REST = 32
"""The most D iterations the whole speculator rests between two fruitless tries."""


@dataclass(slots=True)
class Rest:
    """The speculator's own backoff, over the D iterations it is asked about (its
    ``worth_drafting`` calls): a try that bought nothing (the cost table kept K = 0, a stale probe
    gave no reason to give the overlap up, a plan gave no verify, a verify accepted nothing) rests
    it ``wait`` iterations, with no check at all, and each further fruitless try doubles ``wait`` up
    to ``max_wait``; a verify that accepted a draft resets it. The row backoff above spares a row's
    drafts; this spares the iteration the check itself, which on a host-bound D loop is paid on
    the launch's path every iteration (``max_wait`` 0: never rests)."""

    max_wait: int = MAX_REST
    wait: int = 0
    until: int = 0
    now: int = 0

    def tick(self) -> bool:
        """A D iteration asks: is the speculator resting at it?"""
        self.now += 1
        return self.now < self.until

    def resting(self) -> bool:
        """Would the next :meth:`tick` rest (no side effect)?"""
        return self.now + 1 < self.until

    def fruitless(self) -> None:
        """The try at the current iteration bought nothing: rest ``wait`` iterations, doubled."""
        self.wait = min(self.max_wait, max(1, 2 * self.wait))
        self.until = self.now + self.wait + 1          # rests at now + 1 ... now + wait

    def paid(self) -> None:
        """A verify accepted a draft: try at every iteration again."""
        self.wait = self.until = 0
