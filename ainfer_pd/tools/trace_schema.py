"""The trace's data: :class:`Turn`, :class:`Conversation`, :class:`Trace` (counts, percentiles,
transforms) and its JSONL form, plus the wait-pressure cells. The generators are
:mod:`.trace_gen`; :mod:`.trace` re-exports both.

A :class:`Trace` is a list of :class:`Conversation`; each conversation is a list of
:class:`Turn` ``(new_tokens, gen_tokens, tool_wait_s)``: the tokens appended to the
context before the turn (the initial prompt for turn 0, the tool observation after),
the tokens the model generates, and the client / tool wait that precedes the turn
(0 for turn 0). Wait-pressure cells (:func:`cell_wait_factor`): ``P1..P4`` multiply the
trace wait vector by 0, 0.01, 0.03, 0.10; ``trace`` keeps the original waits.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import InvalidRequestError

CELLS: dict[str, float] = {"P1": 0.0, "P2": 0.01, "P3": 0.03, "P4": 0.10, "trace": 1.0}


def cell_wait_factor(cell: str) -> float:
    """Multiplier of the trace wait vector for a wait-pressure cell."""
    try:
        return CELLS[cell]
    except KeyError:
        raise InvalidRequestError(f"unknown cell {cell!r}: expected one of {', '.join(CELLS)}") from None


# --------------------------------------------------------------------------- data
@dataclass(frozen=True, slots=True)
class Turn:
    new_tokens: int
    """Tokens appended to the context before this turn (prompt / observation)."""
    gen_tokens: int
    """Tokens generated in this turn (``max_new_tokens`` with ``ignore_eos``)."""
    tool_wait_s: float = 0.0
    """Client / tool wait before this turn (unused for turn 0)."""


@dataclass(slots=True)
class Conversation:
    turns: list[Turn]
    conv_id: int = 0

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def context_before(self) -> list[int]:
        """Retained context (tokens already in the trajectory) before each turn."""
        out, ctx = [], 0
        for t in self.turns:
            out.append(ctx)
            ctx += t.new_tokens + t.gen_tokens
        return out

    @property
    def total_context(self) -> int:
        return sum(t.new_tokens + t.gen_tokens for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        return {"conv_id": self.conv_id,
                "turns": [[t.new_tokens, t.gen_tokens, t.tool_wait_s] for t in self.turns]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Conversation":
        try:
            turns = [Turn(int(a), int(b), float(c)) for a, b, c in d["turns"]]
            conv = cls(turns=turns, conv_id=int(d.get("conv_id", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"malformed conversation record: {exc}") from None
        _validate_conversation(conv)
        return conv


def _validate_conversation(conv: Conversation) -> None:
    if not conv.turns:
        raise InvalidRequestError(f"conversation {conv.conv_id} has no turns")
    for i, t in enumerate(conv.turns):
        if t.new_tokens < 1 or t.gen_tokens < 1:
            raise InvalidRequestError(f"conversation {conv.conv_id} turn {i}: token counts must be >= 1")
        if not math.isfinite(t.tool_wait_s) or t.tool_wait_s < 0:
            raise InvalidRequestError(f"conversation {conv.conv_id} turn {i}: tool wait must be >= 0")


@dataclass(slots=True)
class Trace:
    conversations: list[Conversation]
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------ counts
    @property
    def num_requests(self) -> int:
        return sum(c.num_turns for c in self.conversations)

    @property
    def num_continuations(self) -> int:
        return self.num_requests - len(self.conversations)

    def max_context(self) -> int:
        return max((c.total_context for c in self.conversations), default=0)

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat per-request arrays: new / gen tokens, tool wait, retained context, prompt length, turn index."""
        new, gen, wait, ctx, turn = [], [], [], [], []
        for c in self.conversations:
            for i, (t, before) in enumerate(zip(c.turns, c.context_before())):
                new.append(t.new_tokens)
                gen.append(t.gen_tokens)
                wait.append(t.tool_wait_s)
                ctx.append(before)
                turn.append(i)
        a = {"new_tokens": np.asarray(new, dtype=np.int64), "gen_tokens": np.asarray(gen, dtype=np.int64),
             "tool_wait_s": np.asarray(wait, dtype=float), "retained_context": np.asarray(ctx, dtype=np.int64),
             "turn": np.asarray(turn, dtype=np.int64)}
        a["prompt_tokens"] = a["retained_context"] + a["new_tokens"]
        return a

    def percentiles(self, qs: Sequence[float] = (50, 90, 99)) -> dict[str, tuple[float, ...]]:
        """p50/p90/p99 of new tokens, generated tokens, tool wait and retained context.

        ``tool_wait_s`` and ``retained_context`` are taken over continuations only (turn 0
        has no wait and no retained context).
        """
        a = self.arrays()
        cont = a["turn"] > 0
        out: dict[str, tuple[float, ...]] = {}
        for key, vals in (("new_tokens", a["new_tokens"]), ("gen_tokens", a["gen_tokens"]),
                          ("tool_wait_s", a["tool_wait_s"][cont]),
                          ("retained_context", a["retained_context"][cont]),
                          ("prompt_tokens", a["prompt_tokens"])):
            out[key] = tuple(float(np.percentile(vals, q)) for q in qs) if len(vals) else tuple(0.0 for _ in qs)
        return out

    def summary(self) -> dict[str, Any]:
        a = self.arrays()
        turns = [c.num_turns for c in self.conversations]
        return {
            "conversations": len(self.conversations),
            "requests": self.num_requests,
            "continuations": self.num_continuations,
            "max_turns": max(turns, default=0),
            "input_tokens": int(a["prompt_tokens"].sum()),
            "new_input_tokens": int(a["new_tokens"].sum()),
            "output_tokens": int(a["gen_tokens"].sum()),
            "max_context": self.max_context(),
            "total_tool_wait_s": float(a["tool_wait_s"].sum()),
            "percentiles": {k: list(v) for k, v in self.percentiles().items()},
            "meta": dict(self.meta),
        }

    # ------------------------------------------------------------ transforms
    def scaled(self, *, token_scale: float = 1.0, wait_scale: float = 1.0,
               max_context: int | None = None) -> "Trace":
        """A copy with token counts / waits scaled and conversations truncated to ``max_context``."""
        convs = [_scale_conversation(c, token_scale, wait_scale, max_context) for c in self.conversations]
        n = self.samples_per_prompt
        if n > 1 and max_context is not None:
            # a group keeps one first prompt: truncation may have shrunk some members' own; all take
            # the shortest (each member's kept turns still fit: its context only shrinks)
            for g in range(0, len(convs), n):
                members = convs[g:g + n]
                p = min(c.turns[0].new_tokens for c in members)
                for c in members:
                    t0 = c.turns[0]
                    if t0.new_tokens != p:
                        c.turns[0] = Turn(p, t0.gen_tokens, t0.tool_wait_s)
        meta = dict(self.meta)
        meta["token_scale"] = meta.get("token_scale", 1.0) * token_scale
        meta["wait_scale"] = meta.get("wait_scale", 1.0) * wait_scale
        if max_context is not None:
            meta["max_context"] = max_context
        return Trace(conversations=convs, meta=meta)

    @property
    def samples_per_prompt(self) -> int:
        """Conversations per group sharing one first prompt (GRPO's n; 1 = independent prompts)."""
        return int(self.meta.get("samples_per_prompt", 1))

    def with_samples_per_prompt(self, n: int) -> "Trace":
        """GRPO-shaped: every conversation becomes a group of ``n`` consecutive ones (ids
        renumbered) with the same turn counts; the replay gives a group the same first-prompt
        ids and every member its own seeded sampling and observations, so the members share
        exactly their first prompt."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"samples_per_prompt must be a positive integer, got {n!r}")
        if self.samples_per_prompt != 1:
            raise InvalidRequestError("the trace already has groups (samples_per_prompt "
                                      f"{self.samples_per_prompt})")
        convs = [Conversation(turns=list(c.turns), conv_id=i * n + j)
                 for i, c in enumerate(self.conversations) for j in range(n)]
        return Trace(conversations=convs, meta={**self.meta, "samples_per_prompt": n})

    @property
    def response_budget(self) -> int | None:
        """Tokens each turn asks for (``max_new_tokens``), stopping at the model's EOS instead of
        at its ``gen_tokens``: an RL trainer's response budget (None: each turn asks for exactly
        its ``gen_tokens``, with ``ignore_eos``)."""
        r = self.meta.get("response_budget")
        return int(r) if r is not None else None

    def with_response_budget(self, tokens: int) -> "Trace":
        """A copy whose turns ask for ``tokens`` each and end at the model's EOS (sampled at
        temperature 1, one seed a turn: the replay's :func:`~ainfer_pd.tools.replay.turn_params`);
        the worker clamps a turn's budget to the room left in its context. The engine then does
        not know a turn's length in advance, as under a trainer; a random-weight model gets an EOS
        set with ``--eos-every``."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InvalidRequestError(f"response budget must be a positive integer, got {tokens!r}")
        return Trace(conversations=list(self.conversations), meta={**self.meta, "response_budget": tokens})

    def head(self, num_conversations: int) -> "Trace":
        return Trace(conversations=list(self.conversations[:num_conversations]), meta=dict(self.meta))

    def waits(self, cell: str = "trace", time_scale: float = 1.0) -> list[list[float]]:
        """Effective wait before each turn for a cell (turn 0: 0)."""
        f = cell_wait_factor(cell) * time_scale
        return [[0.0 if i == 0 else t.tool_wait_s * f for i, t in enumerate(c.turns)] for c in self.conversations]

    # ------------------------------------------------------------ JSONL
    def save_jsonl(self, path: str | Path) -> None:
        """One conversation per line; a first ``{"meta": ...}`` line carries the generator knobs."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps({"meta": self.meta}) + "\n")
            for c in self.conversations:
                f.write(json.dumps(c.to_dict()) + "\n")

    @classmethod
    def load_jsonl(cls, path: str | Path) -> "Trace":
        path = Path(path)
        meta: dict[str, Any] = {}
        convs: list[Conversation] = []
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read trace {path}: {exc.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{path}:{n}: malformed JSON ({exc.msg})") from None
            if not isinstance(d, dict):
                raise InvalidRequestError(f"{path}:{n}: expected a JSON object")
            if "meta" in d and "turns" not in d:
                meta = dict(d["meta"] or {})
                continue
            if "conv_id" not in d:
                d = {**d, "conv_id": len(convs)}
            convs.append(Conversation.from_dict(d))
        return cls(conversations=convs, meta=meta)


def save_jsonl(trace: Trace, path: str | Path) -> None:
    trace.save_jsonl(path)


def load_jsonl(path: str | Path) -> Trace:
    return Trace.load_jsonl(path)


def _scale_conversation(c: Conversation, token_scale: float, wait_scale: float,
                        max_context: int | None) -> Conversation:
    if token_scale <= 0 or wait_scale < 0:
        raise InvalidRequestError("token_scale must be > 0 and wait_scale >= 0")
    turns = [Turn(max(1, round(t.new_tokens * token_scale)), max(1, round(t.gen_tokens * token_scale)),
                  t.tool_wait_s * wait_scale) for t in c.turns]
    return Conversation(turns=truncate_turns(turns, max_context), conv_id=c.conv_id)


def truncate_turns(turns: list[Turn], max_context: int | None) -> list[Turn]:
    """Keep the leading turns whose context + generation stays within ``max_context``.

    The first turn is always kept, shrunk to fit when it alone does not.
    """
    if max_context is None:
        return turns
    if max_context < 2:
        raise InvalidRequestError("max_context must be >= 2")
    first = turns[0]
    if first.new_tokens + first.gen_tokens > max_context:
        gen = max(1, min(first.gen_tokens, max_context // 4))
        first = Turn(max(1, min(first.new_tokens, max_context - gen)), gen, first.tool_wait_s)
    out, ctx = [first], first.new_tokens + first.gen_tokens
    for t in turns[1:]:
        if ctx + t.new_tokens + t.gen_tokens > max_context:
            break
        out.append(t)
        ctx += t.new_tokens + t.gen_tokens
    return out
