"""A multi-turn tool environment with simulated tool latency and a verifiable reward.

Token-level, so the tiny random-init MoE can learn it on CPU in a few dozen GRPO steps.

Vocabulary use (vocab 512): ``ALPHABET`` = ``alphabet_size`` argument/answer tokens starting at
``alphabet_start``; a few marker tokens; every other id may appear as "document" filler.

One episode (``num_turns`` = 2..4 actions):

    prompt = [BOS, TASK, key, <filler doc>]            -> action 1   (generate)
    tool call (asyncio.sleep(latency)), obs = [OBS, tool, arg, RESULT, result, <filler>, END]
                                                       -> action 2   (continue_ with obs only)
    ... until the last action; then the reward.

The tool is ``lookup`` (a fixed random permutation of the alphabet) or ``add`` (arg + key mod
alphabet), alternating. Its argument is the last alphabet token of the action, or the key when
the action has none, so the observation depends on what the policy did.

Reward (verifiable, in [0, 1]) = 0.5 * format + 0.5 * hit:
- format: mean over actions of the fraction of action tokens that are alphabet tokens;
- hit: mean over actions 2..n of [the result token of the previous observation appears in it].
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

BOS, TASK, OBS, RESULT, END = 2, 3, 4, 5, 6
TOOL_IDS = {"lookup": 7, "add": 8}
FILLER_START = 16          # filler "document" tokens are drawn outside the alphabet and markers


@dataclass(frozen=True, slots=True)
class EnvConfig:
    vocab_size: int = 512
    alphabet_start: int = 64
    alphabet_size: int = 32
    min_turns: int = 2
    max_turns: int = 4
    prompt_filler: tuple[int, int] = (8, 48)
    """Filler tokens of the prompt (uniform, inclusive): the initial prefill work."""
    obs_filler: tuple[int, int] = (2, 16)
    """Filler tokens of an observation: the continuation-prefill work."""
    tool_latency_ms: tuple[float, float] = (10.0, 60.0)
    """Simulated tool latency (uniform), slept with asyncio.sleep."""
    table_seed: int = 1234

    @property
    def alphabet(self) -> range:
        return range(self.alphabet_start, self.alphabet_start + self.alphabet_size)


@dataclass(slots=True)
class Task:
    """One prompt of a GRPO group (every episode of the group starts from it)."""

    prompt_id: int
    key: int
    num_turns: int
    prompt_ids: list[int]


@dataclass(slots=True)
class Episode:
    """What the trainer needs from one rollout episode."""

    task: Task
    tokens: list[int] = field(default_factory=list)           # whole trajectory context
    action_mask: list[bool] = field(default_factory=list)     # True at generated tokens
    old_logprobs: list[float] = field(default_factory=list)   # rollout logprob at each token (0 elsewhere)
    actions: list[list[int]] = field(default_factory=list)
    results: list[int] = field(default_factory=list)          # tool result after action i
    format_score: float = 0.0
    hit_score: float = 0.0
    reward: float = 0.0
    tool_wait_s: float = 0.0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)         # per turn, from TurnOutput


class ToolEnv:
    def __init__(self, cfg: EnvConfig = EnvConfig()) -> None:
        self.cfg = cfg
        a = list(cfg.alphabet)
        perm = a[:]
        random.Random(cfg.table_seed).shuffle(perm)
        self.table = dict(zip(a, perm))
        self._alpha = set(a)

    # ------------------------------------------------------------------ tasks
    def sample_task(self, rng: random.Random, prompt_id: int) -> Task:
        c = self.cfg
        key = rng.choice(list(c.alphabet))
        n = rng.randint(c.min_turns, c.max_turns)
        filler = [self._filler(rng) for _ in range(rng.randint(*c.prompt_filler))]
        return Task(prompt_id, key, n, [BOS, TASK, key] + filler)

    def _filler(self, rng: random.Random) -> int:
        while True:
            t = rng.randrange(FILLER_START, self.cfg.vocab_size)
            if t not in self._alpha:
                return t

    # ------------------------------------------------------------------ tools
    def tool_name(self, turn: int) -> str:
        return "lookup" if turn % 2 == 0 else "add"

    def call_tool(self, task: Task, turn: int, action: list[int]) -> int:
        """Result token of the tool call after action ``turn`` (0-based)."""
        c = self.cfg
        args = [t for t in action if t in self._alpha]
        arg = args[-1] if args else task.key
        if self.tool_name(turn) == "lookup":
            return self.table[arg]
        return c.alphabet_start + (arg - c.alphabet_start + task.key - c.alphabet_start) % c.alphabet_size

    def observation(self, rng: random.Random, turn: int, arg_action: list[int], result: int) -> list[int]:
        args = [t for t in arg_action if t in self._alpha]
        arg = args[-1] if args else TASK
        filler = [self._filler(rng) for _ in range(rng.randint(*self.cfg.obs_filler))]
        return [OBS, TOOL_IDS[self.tool_name(turn)], arg, RESULT, result] + filler + [END]

    async def tool_wait(self, rng: random.Random) -> float:
        lo, hi = self.cfg.tool_latency_ms
        s = rng.uniform(lo, hi) / 1000.0
        if s > 0:
            await asyncio.sleep(s)
        return s

    # ------------------------------------------------------------------ reward
    def score(self, ep: Episode) -> None:
        fmt = [sum(t in self._alpha for t in a) / max(1, len(a)) for a in ep.actions]
        hits = [float(ep.results[i - 1] in ep.actions[i]) for i in range(1, len(ep.actions))]
        ep.format_score = sum(fmt) / max(1, len(fmt))
        ep.hit_score = sum(hits) / max(1, len(hits))
        ep.reward = 0.5 * ep.format_score + 0.5 * ep.hit_score


async def run_episode(worker, env: ToolEnv, task: Task, params_for_turn, rng: random.Random) -> Episode:
    """One multi-turn episode against a running RolloutWorker: generate -> tool wait ->
    continue_ with the observation tokens only -> ... -> reward. ``params_for_turn(turn)``
    gives the turn's SamplingParams (per-episode, per-turn seeds)."""
    ep = Episode(task=task)
    ep.tokens = list(task.prompt_ids)
    ep.action_mask = [False] * len(ep.tokens)
    ep.old_logprobs = [0.0] * len(ep.tokens)
    out = await worker.generate(task.prompt_ids, params_for_turn(0))
    tid = out.trajectory_id
    try:
        for turn in range(task.num_turns):
            if turn > 0:
                ep.tool_wait_s += await env.tool_wait(rng)
                obs = env.observation(rng, turn - 1, ep.actions[-1], ep.results[-1])
                ep.tokens += obs
                ep.action_mask += [False] * len(obs)
                ep.old_logprobs += [0.0] * len(obs)
                out = await worker.continue_(tid, obs, params_for_turn(turn))
            ep.prompt_tokens += out.num_prompt_tokens
            ep.cached_tokens += out.num_cached_tokens
            ep.ttft_s.append(out.ttft_s)
            ep.actions.append(list(out.token_ids))
            ep.tokens += out.token_ids
            ep.action_mask += [True] * len(out.token_ids)
            ep.old_logprobs += list(out.logprobs)
            ep.results.append(env.call_tool(task, turn, out.token_ids))
    finally:
        await worker.release(tid)
    env.score(ep)
    return ep
