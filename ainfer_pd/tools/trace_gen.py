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


# --------------------------------------------------------------------------- GRPO long-context agentic
#: Quantile knots of the retained context at continuations (SPEC section 5's p50 / p90 / p99), up to
#: 14,800 tokens so that a last turn still fits a 16K model (:data:`GRPO_CONTEXT_LIMIT`).
CONTEXT_KNOTS = ((0.0, 600.0), (0.5, 4716.0), (0.9, 8828.0), (0.99, 12507.0), (1.0, 14800.0))
#: The group's shared prompt (system + tools + task) of the latent chains.
GRPO_PROMPT_KNOTS = ((0.0, 600.0), (0.5, 2400.0), (0.9, 4000.0), (1.0, 5000.0))
#: Tool observations of the latent chains (larger than the paper's new tokens per turn: fewer turns
#: reach the same contexts).
GRPO_OBSERVATION_KNOTS = ((0.0, 16.0), (0.5, 1100.0), (0.9, 2800.0), (0.99, 4000.0), (1.0, 5000.0))
#: Whole-context limit (prompt + every turn) the full-scale workload is built for: a 16K model.
GRPO_CONTEXT_LIMIT = 16384
#: Defaults of :func:`grpo_agentic_trace`: 8 groups of 8 siblings, 2 to 6 turns each.
GRPO_GROUPS, GRPO_GROUP_SIZE, GRPO_MIN_TURNS, GRPO_MAX_TURNS = 8, 8, 2, 6


def grpo_agentic_trace(num_groups: int = GRPO_GROUPS, group_size: int = GRPO_GROUP_SIZE,
                       max_turns: int = GRPO_MAX_TURNS, *, min_turns: int = GRPO_MIN_TURNS,
                       token_scale: float = 1.0, max_context: int | None = None, wait_scale: float = 1.0,
                       seed: int = 0, context_limit: int = GRPO_CONTEXT_LIMIT,
                       stratified: bool = True) -> Trace:
    """A GRPO-style long-context agentic workload: ``num_groups`` groups of ``group_size`` siblings.

    The siblings of a group share one first prompt (``samples_per_prompt`` = ``group_size``: the
    replay gives them the same prompt ids, so prefix sharing sees them) and then diverge: each
    has its own turn count (``min_turns`` .. ``max_turns``), generation lengths, observations and
    tool waits. The retained context at continuations follows SPEC section 5 (p50 / p90 / p99
    4,716 / 8,828 / 12,507; :data:`CONTEXT_KNOTS`, up to 14,800).

    How: latent chains are drawn first (the group's prompt, then per sibling and turn a
    generation from the paper's distribution and an observation, all stratified over the trace
    as :func:`make_trace` does). The latent retained contexts are then replaced, rank for rank,
    by a stratified draw of the target distribution (a monotone map: every chain still grows),
    and each observation becomes what takes its chain from one mapped context to the next after
    the turn's generation; a group's prompt is the median of what its siblings' first mapped
    contexts leave after their first generation. Generations and tool waits keep the paper's
    distributions (:data:`GEN_TOKENS_KNOTS`, :data:`TOOL_WAIT_KNOTS`); each last turn is clamped
    to ``context_limit``. ``token_scale`` multiplies token counts (clamped to >= 1: a tiny CPU
    version), ``wait_scale`` the waits, and ``max_context`` truncates each sibling's turns so its
    whole context stays within the model's (the group keeps one prompt length).
    """
    _check_grpo_args(num_groups, group_size, max_turns, min_turns, context_limit)
    rng = np.random.default_rng([seed, 0x6770])
    n_conv = num_groups * group_size
    turns = rng.integers(min_turns, max_turns + 1, size=n_conv)
    total = int(turns.sum())
    prompts = np.round(QuantileDistribution(GRPO_PROMPT_KNOTS).sample(rng, num_groups, stratified=stratified))
    gen = np.maximum(1, np.round(QuantileDistribution(GEN_TOKENS_KNOTS).sample(rng, total, stratified=stratified)))
    n_cont = total - n_conv
    obs = np.maximum(1, np.round(QuantileDistribution(GRPO_OBSERVATION_KNOTS).sample(rng, n_cont, stratified=stratified)))
    waits = QuantileDistribution(TOOL_WAIT_KNOTS).sample(rng, n_cont, stratified=stratified)
    chains = _latent_chains(turns.tolist(), prompts, gen, obs, waits, group_size)
    mapped = _mapped_contexts(rng, chains[3], n_cont, stratified)
    convs: list[Conversation] = []
    for gi in range(num_groups):
        convs += _group_conversations(gi, group_size, chains, mapped, int(prompts[gi]), context_limit)
    trace = Trace(conversations=convs, meta={
        "kind": "grpo-long", "num_groups": num_groups, "group_size": group_size, "min_turns": min_turns,
        "max_turns": max_turns, "seed": seed, "context_limit": context_limit, "samples_per_prompt": group_size})
    if token_scale != 1.0 or wait_scale != 1.0 or max_context is not None:
        trace = trace.scaled(token_scale=token_scale, wait_scale=wait_scale, max_context=max_context)
    return trace


def _check_grpo_args(num_groups: int, group_size: int, max_turns: int, min_turns: int, context_limit: int) -> None:
    """:class:`InvalidRequestError` for counts that are not positive integers, ``min_turns`` above
    ``max_turns``, or a context limit the target distribution does not fit in."""
    for name, v in (("num_groups", num_groups), ("group_size", group_size), ("max_turns", max_turns),
                    ("min_turns", min_turns)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidRequestError(f"grpo_agentic_trace: {name} must be a positive integer, got {v!r}")
    if min_turns > max_turns:
        raise InvalidRequestError(f"grpo_agentic_trace: min_turns {min_turns} > max_turns {max_turns}")
    if context_limit <= CONTEXT_KNOTS[-1][1]:
        raise InvalidRequestError(f"grpo_agentic_trace: context_limit must be > {CONTEXT_KNOTS[-1][1]:.0f} "
                                  "(the largest retained context); use max_context to truncate")


def _latent_chains(turns: list[int], prompts: np.ndarray, gen: np.ndarray, obs: np.ndarray, waits: np.ndarray,
                   group_size: int) -> tuple[list, list, list, list]:
    """Per sibling: its generations, observations, tool waits and latent retained context before
    each continuation (the group's prompt, then generation + observation per turn)."""
    gens, observations, tool_waits, latent = [], [], [], []
    pos = opos = 0
    for i, t in enumerate(turns):
        g, o, w = gen[pos:pos + t], obs[opos:opos + t - 1], waits[opos:opos + t - 1]
        pos, opos = pos + t, opos + t - 1
        ctx = np.cumsum(np.concatenate([[prompts[i // group_size] + g[0]], o + g[1:]]))[:-1]
        gens.append(g.astype(np.int64))
        observations.append(o.astype(np.int64))
        tool_waits.append([float(x) for x in w])
        latent.append(ctx)
    return gens, observations, tool_waits, latent


def _mapped_contexts(rng: np.random.Generator, latent: list[np.ndarray], n_cont: int, stratified: bool) -> list:
    """The latent retained contexts replaced rank for rank by a stratified draw of
    :data:`CONTEXT_KNOTS`, per sibling."""
    flat = np.concatenate(latent) if n_cont else np.zeros(0)
    mapped_flat = np.empty(n_cont)
    if n_cont:          # rank for rank onto a stratified draw of the target distribution
        target = np.sort(QuantileDistribution(CONTEXT_KNOTS).sample(rng, n_cont, stratified=stratified))
        mapped_flat[np.argsort(flat, kind="stable")] = np.round(target)
    mapped, pos = [], 0
    for ctx in latent:
        mapped.append(mapped_flat[pos:pos + len(ctx)])
        pos += len(ctx)
    return mapped


def _group_conversations(gi: int, group_size: int, chains: tuple[list, list, list, list], mapped: list,
                         drawn_prompt: int, context_limit: int) -> list[Conversation]:
    """Group ``gi``'s siblings: one shared prompt (the median of what their first mapped contexts
    leave after their first generation; the drawn prompt when none continues), each sibling's turns."""
    gens, observations, tool_waits, _ = chains
    members = range(gi * group_size, (gi + 1) * group_size)
    firsts = [mapped[i][0] - gens[i][0] for i in members if len(mapped[i])]
    prompt = int(np.round(np.median(firsts))) if firsts else drawn_prompt
    prompt = max(1, min(prompt, context_limit // 2))
    return [Conversation(turns=_sibling_turns(prompt, gens[i], observations[i], mapped[i], tool_waits[i],
                                              context_limit), conv_id=i)
            for i in members]


def _sibling_turns(prompt: int, g: np.ndarray, o: np.ndarray, m: np.ndarray, waits: list[float],
                   context_limit: int) -> list[Turn]:
    """One sibling's turns: each observation takes its chain to the next mapped context; the last
    turn keeps its own observation, within ``context_limit``."""
    ts = [Turn(prompt, int(g[0]), 0.0)]
    ctx = prompt + int(g[0])
    for k in range(1, len(g)):
        gk = int(g[k])
        if k < len(m):             # take the chain to its next mapped context
            ok = int(m[k]) - ctx - gk
        else:                      # the last turn: its own observation, within the limit
            ok = min(int(o[k - 1]), context_limit - ctx - gk)
            if ok < 1:
                gk = max(1, context_limit - ctx - 1)
        ok = max(1, ok)
        if ctx + ok + gk > context_limit:
            break
        ts.append(Turn(ok, gk, waits[k - 1]))
        ctx += ok + gk
    return ts


def grpo_percentile_targets(token_scale: float = 1.0) -> dict[str, tuple[float, float, float]]:
    """What :func:`grpo_agentic_trace` fits at ``token_scale``: the paper's retained context,
    generated tokens and tool waits (its new tokens per turn are its own: fewer, larger observations)."""
    return {k: tuple(x * (token_scale if k != "tool_wait_s" else 1.0) for x in PAPER_PERCENTILES[k])
            for k in ("retained_context", "gen_tokens", "tool_wait_s")}


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
