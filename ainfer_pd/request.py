"""Public request/response types: SamplingParams in, TurnOutput out."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .errors import InvalidRequestError

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 = off."""
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    """Return the log-probability of each sampled token."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
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
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
