"""How much KV a turn's output holds, and when (pure): ``cache.reserve_output``.

* ``all``: a turn reserves its whole ``max_new_tokens`` at admission and never grows. Nothing is
  ever preempted, but every live turn holds its whole budget whatever it generates: an RL
  trainer's response budget (verl's ``response_length``, or the room left in the context) is
  held by each live turn, and the unwritten blocks evict other trajectories' idle contexts.
* ``estimate`` (SGLang's new-token ratio): a turn reserves its prompt and its first output
  token; its output's blocks are taken as it decodes (before each D iteration). Admission keeps
  room for what the admitted turns are still expected to write, ``ratio`` x the tokens each may
  still generate, where ``ratio`` decays from ``output_ratio_init`` to ``output_ratio_min`` over
  ``output_ratio_decay_iters`` D iterations and is set back to ``output_ratio_init`` when a full
  pool preempted a decoding row (the engine's mechanism: ``engine.loop.kv_growth``).

Token counts here are KV positions: a turn of ``seq`` tokens holds ``seq`` positions once its
next token is fed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

RESERVE_OUTPUT = ("all", "estimate")


@dataclass(frozen=True, slots=True)
class OutputReserve:
    mode: str = "all"
    init: float = 0.7
    min: float = 0.14
    decay_iters: int = 600

    @property
    def grows(self) -> bool:
        """Output blocks are taken as a turn decodes (and a full pool preempts)."""
        return self.mode == "estimate"


def reserve_tokens(r: OutputReserve, prompt_len: int, remaining: int) -> int:
    """Positions a turn's reservation holds at admission: its prompt (``prompt_len``) plus, under
    ``all``, the ``remaining`` output tokens it may still generate, else one (its first token)."""
    return prompt_len + (remaining if r.mode == "all" else min(1, remaining))


def expected_tokens(r: OutputReserve, seq_len: int, remaining: int, ratio: float) -> int:
    """Positions a turn of ``seq_len`` with ``remaining`` output tokens left is expected to hold
    at its end: everything under ``all``, else ``ceil(ratio * remaining)`` more (at least one
    while any is left)."""
    if r.mode == "all" or remaining <= 0:
        return seq_len + max(0, remaining)
    return seq_len + max(1, math.ceil(ratio * remaining))


def headroom_blocks(r: OutputReserve, rows: Iterable[tuple[int, int, int]], ratio: float, block_size: int) -> int:
    """Blocks the admitted turns are expected to take beyond what they hold: ``rows`` =
    (positions now, output tokens left, blocks held) of each. 0 under ``all`` (they hold it)."""
    if r.mode == "all":
        return 0
    total = 0
    for seq_len, remaining, held in rows:
        total += max(0, -(-expected_tokens(r, seq_len, remaining, ratio) // block_size) - held)
    return total


def next_ratio(r: OutputReserve, ratio: float, *, preempted: bool) -> float:
    """The ratio after one D iteration: back at ``init`` when it preempted a row, else one step
    of the linear decay to ``min``."""
    if preempted:
        return r.init
    step = (r.init - r.min) / max(1, r.decay_iters)
    return max(r.min, ratio - step)


def growth_target(seq_len: int, extra: int, context_len: int, max_new_tokens: int, max_context_len: int) -> int:
    """Positions a decoding row must hold before an iteration that may write ``extra`` positions
    past its last token (a token fed ahead of the host, draft tokens): never past the last
    position its turn can write (its submitted prompt, ``context_len``, plus ``max_new_tokens``;
    the context limit)."""
    return min(seq_len + extra, context_len + max_new_tokens, max_context_len)
