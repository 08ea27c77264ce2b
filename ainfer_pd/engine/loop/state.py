"""Per-trajectory and per-turn state owned by the engine (one rank)."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from ...request import SamplingParams


class TurnState(enum.Enum):
    WAITING = "waiting"        # queued for prefill (maybe partly prefilled)
    DECODING = "decoding"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(slots=True)
class Trajectory:
    tid: str
    tokens: list[int] = field(default_factory=list)   # committed context (prompts + generations)
    turn: "Turn | None" = None                         # the turn in flight
    draining: "Turn | None" = None                     # an aborted turn whose device work has not drained
    num_turns: int = 0
    releasing: bool = False                            # RolloutWorker.release is waiting for the drain
    group: str = ""                                    # priority group: siblings of one first prompt share it
    first_prompt: int = 0                              # tokens of its first prompt (what siblings share)
    block_hashes: tuple | None = None
    """(the tokens, their full blocks' chained hashes) of its last turn's prompt: the next turn
    hashes only the blocks past them (``KVCacheManager.prompt_hashes(known=)``)."""


class SeqTokens:
    """The token ids of a turn's sequence (its prompt, then what it generated), sliceable without
    concatenating: the KV cache hashes the blocks a turn completes from it."""

    __slots__ = ("turn",)

    def __init__(self, turn: "Turn") -> None:
        self.turn = turn

    def __len__(self) -> int:
        return len(self.turn.context) + len(self.turn.out_tokens)

    def __getitem__(self, s: slice) -> list[int]:
        ctx, out = self.turn.context, self.turn.out_tokens
        start, stop, _ = s.indices(len(ctx) + len(out))
        if stop <= len(ctx):
            return ctx[start:stop]
        return ctx[start:] + out[max(0, start - len(ctx)):stop - len(ctx)]


@dataclass(eq=False, slots=True)
class Turn:
    request_id: str
    traj: Trajectory
    params: SamplingParams
    context: list[int]                  # the whole prompt of this turn
    prev_tokens: list[int]              # trajectory tokens before this turn (restored on abort)
    num_cached: int                     # prompt tokens served from retained KV
    future: asyncio.Future
    t_submit: float
    seed: int = 0                       # the sampling seed (engine.sampler: counter-based noise)
    state: TurnState = TurnState.WAITING
    lifetime: int = 0                   # KV reservation lifetime (0 = not admitted)
    prefilled: int = 0                  # prompt tokens whose KV is computed
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    t_first: float | None = None
    in_flight: int = 0                  # submitted device work touching this turn's KV
    abort_requested: bool = False
    commit_on_abort: bool = True        # an abort keeps the partial output in the trajectory (not a cancel)
    p_mark: int = 0                     # the engine's admitted prefill tokens when it was submitted
    drained: asyncio.Event = field(default_factory=asyncio.Event)   # set once no device work touches it
    prompt_hashes: list | None = None   # chained block hashes of the prompt (computed once, for the prefix cache)
    history: Any = None                 # context + out_tokens as array('q') (repetition penalty: TurnBook.sample_row)
    routed_experts: torch.Tensor | None = None   # gathered when the turn ends (routing replay)
    prefix_view: tuple | None = None    # (kv version, its prompt's AdmissionView, a demand, the view at it): memoized
    resumed: list[int] | None = None    # preempted (a full KV pool): its prompt then, context + output so far
    preemptions: int = 0

    @property
    def tid(self) -> str:
        return self.traj.tid

    @property
    def prompt(self) -> list[int]:
        """The tokens its admission prefills: the submitted context, or once preempted the
        context and its output then (its next token is sampled from the last one's logits)."""
        return self.context if self.resumed is None else self.resumed

    @property
    def remaining_prompt(self) -> int:
        return len(self.prompt) - self.prefilled

    @property
    def seq_len(self) -> int:
        """Tokens whose position is taken (prompt + generated)."""
        return len(self.context) + len(self.out_tokens)


class InFlight:
    """Turns counted as touched by submitted device work (:meth:`TurnBook.in_flight`): the one
    place a turn's ``in_flight`` count changes while it is served."""

    __slots__ = ("turns",)

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = turns
        for t in turns:
            t.in_flight += 1

    def release(self) -> None:
        """The work was read (or will never be): idempotent."""
        turns, self.turns = self.turns, []
        for t in turns:
            t.in_flight = max(0, t.in_flight - 1)    # a failed / closed turn was reset to 0

    def __enter__(self) -> "InFlight":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
