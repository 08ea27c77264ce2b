"""verl ``sampling_params`` dict -> :class:`ainfer_pd.SamplingParams` (pure, no verl import).

verl's agent loops build ``sampling_params`` as a plain dict (``AgentLoopWorker``:
``temperature, top_p, top_k, repetition_penalty, logprobs``; tool loops add
``stop_token_ids``; clients may add ``max_tokens`` or sglang-style ``max_new_tokens``).
The mapping mirrors verl's vLLM server (``vLLMHttpServer.generate``):

==========================  ===========================================================
verl key                    ainfer-pd
==========================  ===========================================================
``temperature``             ``temperature`` (0 = greedy)
``top_p``                   ``top_p``
``top_k``                   ``top_k`` (``-1``/``0``/``None`` = off)
``repetition_penalty``      ``repetition_penalty`` (default: ``rollout.repetition_penalty``)
``logprobs``                ``logprobs`` (truthy -> return the sampled tokens' logprobs,
                            as verl's vLLM server; top-k alternatives are not returned)
``max_tokens``              ``max_new_tokens`` (wins over ``max_new_tokens``)
``max_new_tokens``          ``max_new_tokens``
(neither)                   ``min(response_length, prompt_length + response_length -
                            len(prompt))`` like verl's vLLM server
``stop_token_ids``          ``stop_token_ids``
``ignore_eos``              ``ignore_eos`` (default: ``rollout.ignore_eos``)
``seed``                    ``seed`` (per-request seed)
==========================  ===========================================================

Then ``max_new_tokens`` is clamped to ``[1, max_context_len - len(prompt)]``.

Keys the engine does not compute (:data:`UNSUPPORTED_KEYS`) are accepted at their neutral value
(``min_p`` 0, ``min_tokens`` 0, ``presence_penalty`` 0, ``frequency_penalty`` 0, ``stop`` empty,
``prompt_logprobs`` None, ``n`` 1: what vLLM does with them is then nothing) and otherwise refused
with :class:`~ainfer_pd.errors.UnsupportedOptionError` naming the key: ``stop`` strings (this
backend is token-in/token-out: use ``stop_token_ids``), ``prompt_logprobs`` (no prompt logprobs
are computed: verl's teacher distillation gets this typed error, not a ``KeyError`` on
``extra_fields["prompt_logprobs"]``), ``n`` > 1 (verl samples ``n`` by repeating the prompt).

Keys with no effect on the tokens of a token-in/token-out backend (:data:`IGNORED_KEYS`:
``do_sample`` (verl already folds it into temperature/top_p/top_k), ``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``, ``detokenize``,
``logprobs_mode``, ``extra_args``, ``priority``) and any unknown key are reported back by
:func:`to_sampling_params`; the server logs one warning per key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import ContextLengthError, InvalidRequestError, UnsupportedOptionError
from ...request import SamplingParams

__all__ = ["IGNORED_KEYS", "MAPPED_KEYS", "UNSUPPORTED_KEYS", "MappedSampling", "to_sampling_params"]

MAPPED_KEYS = frozenset({
    "temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens",
    "max_new_tokens", "stop_token_ids", "ignore_eos", "seed",
})
IGNORED_KEYS = frozenset({
    "do_sample", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "detokenize", "logprobs_mode", "extra_args", "priority",
})


def _zero(v: Any) -> bool:
    try:
        return v is None or float(v) == 0.0
    except (TypeError, ValueError):
        return False


#: key -> (is the value neutral, why another value is refused)
UNSUPPORTED_KEYS = {
    "min_p": (_zero, "min-p sampling is not built (top_p / top_k are)"),
    "min_tokens": (_zero, "a minimum length is not built (ignore_eos generates to max_tokens)"),
    "presence_penalty": (_zero, "presence penalties are not built (repetition_penalty is)"),
    "frequency_penalty": (_zero, "frequency penalties are not built (repetition_penalty is)"),
    "stop": (lambda v: not v, "stop strings need text; this backend is token-in/token-out: use stop_token_ids"),
    "prompt_logprobs": (lambda v: v is None, "prompt logprobs are not computed (a teacher for distillation "
                                             "needs an engine that returns them)"),
    "n": (lambda v: v is None or v == 1, "one sample per request: repeat the prompt (verl's rollout.n does)"),
}


@dataclass(frozen=True, slots=True)
class MappedSampling:
    params: SamplingParams
    ignored: tuple[str, ...]
    """Known verl keys this backend ignores (see module docstring)."""
    unknown: tuple[str, ...]
    """Keys neither mapped nor known: ignored as well."""


def _num(d: Mapping[str, Any], key: str, default: Any) -> Any:
    v = d.get(key, default)
    return default if v is None else v


def _refuse_unsupported(sp: Mapping[str, Any]) -> None:
    for key, (neutral, why) in UNSUPPORTED_KEYS.items():
        if key in sp and not neutral(sp[key]):
            raise UnsupportedOptionError(f"sampling_params {key}={sp[key]!r}: {why}", key=key)


def _max_new_tokens(sp: Mapping[str, Any], prompt_len: int, room: int, response_length: int | None,
                    prompt_length: int | None) -> int:
    """``max_tokens``, else ``max_new_tokens``, else verl's response length rule, else the room
    left; an integer clamped to ``[1, room]``."""
    if sp.get("max_tokens") is not None:
        max_new = sp["max_tokens"]
    elif sp.get("max_new_tokens") is not None:
        max_new = sp["max_new_tokens"]
    elif response_length is not None:
        max_new = response_length
        if prompt_length is not None:
            max_new = min(response_length, prompt_length + response_length - prompt_len)
    else:
        max_new = room
    if isinstance(max_new, bool) or not isinstance(max_new, int):
        try:
            if float(max_new) != int(max_new):
                raise ValueError
            max_new = int(max_new)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"sampling_params max_tokens must be an integer, got {max_new!r}") from None
    return max(1, min(max_new, room))


def _top_k(sp: Mapping[str, Any]) -> Any:
    top_k = _num(sp, "top_k", -1)
    if isinstance(top_k, float) and top_k.is_integer():
        top_k = int(top_k)
    if top_k == 0:
        top_k = -1
    return top_k


def _stop_token_ids(sp: Mapping[str, Any]) -> tuple[int, ...]:
    stop = sp.get("stop_token_ids") or ()
    try:
        return tuple(int(t) for t in stop)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"sampling_params stop_token_ids must be integers, got {stop!r}") from None


def to_sampling_params(
    sampling_params: Mapping[str, Any] | None,
    *,
    prompt_len: int,
    max_context_len: int,
    response_length: int | None = None,
    prompt_length: int | None = None,
    default_repetition_penalty: float = 1.0,
    default_ignore_eos: bool = False,
) -> MappedSampling:
    """Map a verl ``sampling_params`` dict; never mutates the caller's dict.

    ``prompt_len`` is the length of the whole context the model sees this turn
    (retained prefix + new tokens). Raises :class:`InvalidRequestError` for bad values
    and :class:`ContextLengthError` when no token fits in the context.
    """
    sp = dict(sampling_params or {})
    _refuse_unsupported(sp)
    room = max_context_len - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens leaves no room to generate within max_context_len={max_context_len}")
    max_new = _max_new_tokens(sp, prompt_len, room, response_length, prompt_length)
    top_k = _top_k(sp)
    logprobs = bool(sp.get("logprobs", False))  # as verl's vLLM server: truthy = on
    stop = _stop_token_ids(sp)
    seed = sp.get("seed")
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=float(_num(sp, "temperature", 1.0)),
        top_p=float(_num(sp, "top_p", 1.0)),
        top_k=top_k,
        repetition_penalty=float(_num(sp, "repetition_penalty", default_repetition_penalty)),
        seed=None if seed is None else int(seed),
        stop_token_ids=stop,
        ignore_eos=bool(_num(sp, "ignore_eos", default_ignore_eos)),
        logprobs=logprobs,
    )
    ignored = tuple(sorted(k for k in sp if k in IGNORED_KEYS))
    unknown = tuple(sorted(k for k in sp if k not in IGNORED_KEYS and k not in MAPPED_KEYS
                           and k not in UNSUPPORTED_KEYS))
    return MappedSampling(params=params, ignored=ignored, unknown=unknown)
