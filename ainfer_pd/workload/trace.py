"""Paper-shaped multi-turn agentic trace generator (SPEC section 5), JSONL in and out.

A :class:`Trace` is a list of :class:`Conversation`; each conversation is a list of
:class:`Turn` ``(new_tokens, gen_tokens, tool_wait_s)``: the tokens appended to the
context before the turn (the initial prompt for turn 0, the tool observation after),
the tokens the model generates, and the client / tool wait that precedes the turn
(0 for turn 0).

Each per-turn quantity is drawn from a fitted distribution: the quantile function is
interpolated log-linearly through ``(0, min), (0.5, p50), (0.9, p90), (0.99, p99), (1, max)``
and sampled by inverse CDF with a seeded :class:`numpy.random.Generator`. The uniforms are
*stratified* over the whole trace (one per stratum ``[i/n, (i+1)/n)``, randomly permuted),
so the empirical percentiles sit on the targets at every scale instead of wandering with
sampling noise. Each conversation's largest new-prompt draw becomes its first turn (the
task statement is the largest prompt): with that, the retained context at continuations
lands on the paper's p50 / p90 / p99 (4,716 / 8,828 / 12,507) within a few percent, as
do the totals (6.57M input / 0.22M output tokens at 128 conversations x 10 turns).

Wait-pressure cells (:func:`cell_wait_factor`): ``P1..P4`` multiply the trace wait
vector by 0, 0.01, 0.03, 0.10; ``trace`` keeps the original waits.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import InvalidRequestError

# --------------------------------------------------------------------------- targets
PAPER_REQUESTS = 1265
PAPER_CONVERSATIONS = 128
PAPER_CONTINUATIONS = 1137
PAPER_MAX_TURNS = 10
PAPER_INPUT_TOKENS = 6_574_104
PAPER_OUTPUT_TOKENS = 220_862

#: p50 / p90 / p99 targets of SPEC section 5.
PAPER_PERCENTILES: dict[str, tuple[float, float, float]] = {
    "new_tokens": (292, 2008, 3062),
    "gen_tokens": (88, 391, 1057),
    "retained_context": (4716, 8828, 12507),
    "tool_wait_s": (3.1, 3.9, 15.0),
}

#: Quantile knots ``(q, value)`` of the fitted per-turn distributions.
NEW_TOKENS_KNOTS = ((0.0, 8.0), (0.5, 292.0), (0.9, 2008.0), (0.99, 3062.0), (1.0, 4096.0))
GEN_TOKENS_KNOTS = ((0.0, 4.0), (0.5, 88.0), (0.9, 391.0), (0.99, 1057.0), (1.0, 2048.0))
TOOL_WAIT_KNOTS = ((0.0, 1.0), (0.5, 3.1), (0.9, 3.9), (0.99, 15.0), (1.0, 30.0))

#: Fraction of conversations that end before ``max_turns`` (paper: 1,265 of 1,280 slots).
SHORT_CONVERSATION_FRACTION = 0.04

CELLS: dict[str, float] = {"P1": 0.0, "P2": 0.01, "P3": 0.03, "P4": 0.10, "trace": 1.0}


def cell_wait_factor(cell: str) -> float:
    """Multiplier of the trace wait vector for a wait-pressure cell."""
    try:
        return CELLS[cell]
    except KeyError:
        raise InvalidRequestError(f"unknown cell {cell!r}: expected one of {', '.join(CELLS)}") from None


# --------------------------------------------------------------------------- distributions
class QuantileDistribution:
    """Piecewise log-linear quantile function through ``(q, value)`` knots.

    ``q`` must run from 0 to 1, strictly increasing; values positive and non-decreasing.
    """

    def __init__(self, knots: Sequence[tuple[float, float]]) -> None:
        qs = np.asarray([k[0] for k in knots], dtype=float)
        vs = np.asarray([k[1] for k in knots], dtype=float)
        if len(qs) < 2 or qs[0] != 0.0 or qs[-1] != 1.0 or np.any(np.diff(qs) <= 0):
            raise InvalidRequestError("quantile knots must start at q=0, end at q=1 and increase")
        if np.any(vs <= 0) or np.any(np.diff(vs) < 0):
            raise InvalidRequestError("quantile knot values must be positive and non-decreasing")
        self.knots = tuple((float(q), float(v)) for q, v in zip(qs, vs))
        self._q = qs
        self._logv = np.log(vs)

    def ppf(self, u: np.ndarray | float) -> np.ndarray:
        """Inverse CDF at ``u`` in [0, 1]."""
        return np.exp(np.interp(np.clip(u, 0.0, 1.0), self._q, self._logv))

    def sample(self, rng: np.random.Generator, n: int, *, stratified: bool = True) -> np.ndarray:
        return self.ppf(_uniforms(rng, n, stratified))

    def mean(self) -> float:
        """Exact mean of the piecewise log-linear quantile function."""
        total = 0.0
        for (q0, v0), (q1, v1) in zip(self.knots, self.knots[1:]):
            w = q1 - q0
            total += w * (v0 if math.isclose(v0, v1) else (v1 - v0) / math.log(v1 / v0))
        return total


def _uniforms(rng: np.random.Generator, n: int, stratified: bool) -> np.ndarray:
    if n <= 0:
        return np.zeros(0)
    if not stratified:
        return rng.random(n)
    return (rng.permutation(n) + rng.random(n)) / n


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
    return Conversation(turns=_truncate(turns, max_context), conv_id=c.conv_id)


def _truncate(turns: list[Turn], max_context: int | None) -> list[Turn]:
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


# --------------------------------------------------------------------------- generators
def make_trace(num_conversations: int = PAPER_CONVERSATIONS, max_turns: int = PAPER_MAX_TURNS, *,
               token_scale: float = 1.0, max_context: int | None = None, wait_scale: float = 1.0,
               seed: int = 0, short_fraction: float = SHORT_CONVERSATION_FRACTION,
               stratified: bool = True) -> Trace:
    """The paper-shaped trace (SPEC section 5) at any scale.

    Full scale (defaults) is 128 conversations of at most 10 turns (~1,265 requests).
    ``token_scale`` multiplies token counts (clamped to >= 1), ``wait_scale`` the waits,
    and ``max_context`` truncates each conversation's turns so its whole context plus
    generation stays within the model's limit.
    """
    if num_conversations < 1 or max_turns < 1:
        raise InvalidRequestError("num_conversations and max_turns must be >= 1")
    if not 0.0 <= short_fraction <= 1.0:
        raise InvalidRequestError("short_fraction must be in [0, 1]")
    rng = np.random.default_rng(seed)
    # turn counts: most conversations run to max_turns, a few stop in its upper half
    counts = np.full(num_conversations, max_turns, dtype=np.int64)
    if max_turns > 1:
        n_short = int(round(short_fraction * num_conversations))
        if n_short:
            idx = rng.choice(num_conversations, size=n_short, replace=False)
            lo = max(1, max_turns // 2)
            counts[idx] = rng.integers(lo, max_turns, size=n_short)
    total = int(counts.sum())
    new = np.maximum(1, np.round(QuantileDistribution(NEW_TOKENS_KNOTS).sample(rng, total, stratified=stratified)))
    gen = np.maximum(1, np.round(QuantileDistribution(GEN_TOKENS_KNOTS).sample(rng, total, stratified=stratified)))
    n_cont = total - num_conversations
    waits = QuantileDistribution(TOOL_WAIT_KNOTS).sample(rng, n_cont, stratified=stratified)
    convs: list[Conversation] = []
    pos = wpos = 0
    for ci, n in enumerate(counts):
        n = int(n)
        cn = new[pos:pos + n].astype(np.int64).copy()
        j = int(np.argmax(cn))                      # the task statement is the largest prompt
        cn[0], cn[j] = cn[j], cn[0]
        cg = gen[pos:pos + n].astype(np.int64)
        cw = [0.0] + [float(w) for w in waits[wpos:wpos + n - 1]]
        pos += n
        wpos += n - 1
        convs.append(Conversation(turns=[Turn(int(a), int(b), w) for a, b, w in zip(cn, cg, cw)], conv_id=ci))
    trace = Trace(conversations=convs, meta={"kind": "paper", "num_conversations": num_conversations,
                                             "max_turns": max_turns, "seed": seed})
    if token_scale != 1.0 or wait_scale != 1.0 or max_context is not None:
        trace = trace.scaled(token_scale=token_scale, wait_scale=wait_scale, max_context=max_context)
    return trace


def paper_trace(scale: float = 1.0, **kw: Any) -> Trace:
    """``make_trace`` with ``round(128 * scale)`` conversations (at least 1)."""
    return make_trace(max(1, round(PAPER_CONVERSATIONS * scale)), **kw)


def decode_only_trace(num_conversations: int = 32, *, gen_tokens: int = 128, prompt_tokens: int = 8,
                      turns: int = 1, observation_tokens: int = 1, tool_wait_s: float = 0.0,
                      seed: int = 0, jitter: float = 0.0) -> Trace:
    """Decode-dominated control: tiny prompts, only generation (activation regression check).

    With the default single turn every prefill is admitted at the start and the rest of
    the run is pure decode, so no P is ever concurrent with D after the first iterations.
    ``jitter`` (0..1) varies the generation lengths by up to that fraction (seeded).
    """
    if min(num_conversations, gen_tokens, prompt_tokens, turns, observation_tokens) < 1:
        raise InvalidRequestError("decode_only_trace: counts must be >= 1")
    rng = np.random.default_rng(seed)
    convs = []
    for ci in range(num_conversations):
        ts = []
        for i in range(turns):
            g = gen_tokens if jitter <= 0 else max(1, int(round(gen_tokens * (1 + jitter * (2 * rng.random() - 1)))))
            ts.append(Turn(prompt_tokens if i == 0 else observation_tokens, g, 0.0 if i == 0 else tool_wait_s))
        convs.append(Conversation(turns=ts, conv_id=ci))
    return Trace(conversations=convs, meta={"kind": "decode-only", "gen_tokens": gen_tokens,
                                            "prompt_tokens": prompt_tokens, "turns": turns, "seed": seed})


def p_heavy_trace(num_conversations: int = 8, max_turns: int = 3, *, prompt_tokens: int = 768,
                  observation_tokens: int = 384, gen_tokens: int = 12, tool_wait_s: float = 0.005,
                  seed: int = 0, jitter: float = 0.25, max_context: int | None = None) -> Trace:
    """P-heavy workload for the policy-ordering test: large prompts, short generations, small waits.

    Token counts vary by up to ``jitter`` (seeded) so the conversations fall out of phase
    and new P keeps arriving while other trajectories decode.
    """
    if min(num_conversations, max_turns, prompt_tokens, observation_tokens, gen_tokens) < 1:
        raise InvalidRequestError("p_heavy_trace: counts must be >= 1")
    rng = np.random.default_rng(seed)

    def vary(x: int) -> int:
        return max(1, int(round(x * (1 + jitter * (2 * rng.random() - 1))))) if jitter > 0 else x

    convs = []
    for ci in range(num_conversations):
        ts = [Turn(vary(prompt_tokens if i == 0 else observation_tokens), vary(gen_tokens),
                   0.0 if i == 0 else tool_wait_s * (1 + jitter * rng.random()))
              for i in range(max_turns)]
        convs.append(Conversation(turns=_truncate(ts, max_context), conv_id=ci))
    return Trace(conversations=convs, meta={"kind": "p-heavy", "seed": seed})


def check_percentiles(trace: Trace, *, rtol: float = 0.1,
                      targets: dict[str, tuple[float, float, float]] | None = None,
                      keys: Iterable[str] | None = None) -> dict[str, list[tuple[float, float, bool]]]:
    """Compare the trace's p50/p90/p99 with the paper targets; ``(got, want, ok)`` per percentile."""
    targets = targets or PAPER_PERCENTILES
    got = trace.percentiles()
    out = {}
    for key in (keys or targets):
        out[key] = [(g, w, abs(g - w) <= rtol * w) for g, w in zip(got[key], targets[key])]
    return out
