"""Paper-shaped multi-turn agentic trace generator (SPEC section 5) and the other workload shapes.

Each per-turn quantity is drawn from a fitted distribution: the quantile function is
interpolated log-linearly through ``(0, min), (0.5, p50), (0.9, p90), (0.99, p99), (1, max)``
and sampled by inverse CDF with a seeded :class:`numpy.random.Generator`. The uniforms are
*stratified* over the whole trace (one per stratum ``[i/n, (i+1)/n)``, randomly permuted),
so the empirical percentiles sit on the targets at every scale instead of wandering with
sampling noise. Each conversation's largest new-prompt draw becomes its first turn (the
task statement is the largest prompt): with that, the retained context at continuations
lands on the paper's p50 / p90 / p99 (4,716 / 8,828 / 12,507) within a few percent, as
do the totals (6.57M input / 0.22M output tokens at 128 conversations x 10 turns).

The trace's data types (:class:`~.trace_schema.Trace` of :class:`~.trace_schema.Conversation`
of :class:`~.trace_schema.Turn`), its JSONL form and the wait-pressure cells are :mod:`.trace_schema`.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import InvalidRequestError
from .trace_schema import Conversation, Trace, Turn, truncate_turns

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
        convs.append(Conversation(turns=truncate_turns(ts, max_context), conv_id=ci))
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
