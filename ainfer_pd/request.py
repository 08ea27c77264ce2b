"""Public request/response types: SamplingParams in, TurnOutput out."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ContextLengthError, InvalidRequestError

FinishReason = Literal["stop", "length", "abort"]

MIN_TEMPERATURE = 1e-5
"""The smallest positive temperature (0 means greedy). Below it ``logits / temperature``
overflows float32 for ordinary logits and the distribution becomes NaN (issue 13, case 5);
vLLM treats temperatures under the same 1e-5 as greedy, here they are rejected."""
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
"""Repetition penalties outside it overflow (tiny) or turn 0 * inf into NaN (huge)."""
SEED_RANGE = (0, 2 ** 64)
"""Seeds are 0 <= seed < 2**64 (what a torch.Generator takes)."""


def fit_context(params: "SamplingParams", prompt_len: int, max_model_len: int) -> "SamplingParams":
    """The max model length (``model.max_context_len``), as vLLM applies ``max_model_len``
    (issue 34, item 3): a prompt of ``max_model_len`` tokens or more is refused with
    :class:`~ainfer_pd.errors.ContextLengthError`; otherwise ``max_new_tokens`` is capped so that
    prompt + generated <= ``max_model_len`` (the turn then ends there with finish_reason
    "length"). Returns ``params`` itself when nothing is capped."""
    if prompt_len >= max_model_len:
        raise ContextLengthError(f"prompt of {prompt_len} tokens does not fit the max model length "
                                 f"{max_model_len} (model.max_context_len): it needs room for one generated token")
    room = max_model_len - prompt_len
    if params.max_new_tokens <= room:
        return params
    import dataclasses
    return dataclasses.replace(params, max_new_tokens=room)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 = greedy; otherwise at least ``MIN_TEMPERATURE`` (1e-5)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 = off."""
    repetition_penalty: float = 1.0
    """1 = off; within ``REPETITION_PENALTY_RANGE`` ([0.01, 100])."""
    seed: int | None = None
    """Per-request seed (0 <= seed < 2**64): the same seed gives the same tokens whatever the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the turn (None = none)."""
    ignore_eos: bool = False
    logprobs: bool = True
    """Return the log-probability of each sampled token."""
    return_routed_experts: bool = False
    """Routing replay: fill ``TurnOutput.routed_experts`` (needs a worker started with
    ``cache.routed_experts: true``; refused with InvalidRequestError otherwise)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _token_tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Every field in range, so that a request that passes can be sampled without NaN
        (:mod:`ainfer_pd.engine.model.sampler` still isolates a row that is not)."""
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid SamplingParams: {msg}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise bad(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise bad(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise bad(f"seed must be an integer, got {self.seed!r}")
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise bad(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.stop_token_ids, tuple):
            raise bad(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("ignore_eos", "logprobs", "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _token_tuple(ids: object) -> object:
    """``stop_token_ids`` as a tuple of ints: None is (), numpy / torch integers become ints;
    anything that is not a collection of token ids is left for :meth:`SamplingParams.validate`
    to reject (a str, a dict, a bare int)."""
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes, bytearray, dict)) or not hasattr(ids, "__iter__"):
        return ids
    try:
        items = list(ids)
    except TypeError:
        return ids
    return tuple(int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in items)


@dataclass(slots=True)
class TurnOutput:
    """One finished turn of a trajectory."""

    trajectory_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    num_prompt_tokens: int
    """Tokens of this turn's prompt (the whole context the model saw before generating)."""
    num_cached_tokens: int
    """Prompt tokens served from retained KV (not recomputed)."""
    ttft_s: float
    latency_s: float
    request_id: str = ""
    turn_index: int = 0
    metrics: dict = field(default_factory=dict)
    routed_experts: Any = None
    """With ``SamplingParams(return_routed_experts=True)``: the top-k expert ids of every token a
    forward pass fed, an int16 CPU tensor ``[len(prompt) + len(token_ids) - 1, moe_layers, top_k]``
    (row p = position p of prompt + token_ids; the last generated token was never fed; an aborted
    turn has the rows its completed passes computed). Layers: the MoE layers in order (dense
    layers have no router). None when not asked for. See :mod:`ainfer_pd.engine.model.routed_experts`."""
