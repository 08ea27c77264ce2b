"""Input checks of :class:`~ainfer_pd.worker.RolloutWorker`: token ids and sampling params.

Pure functions: each returns the normalised value or raises
:class:`~ainfer_pd.errors.InvalidRequestError` (nothing is registered or changed).
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Sequence

import torch

from .errors import AInferPDError, InvalidRequestError
from .request import SamplingParams


def token_list(ids: Any, what: str) -> list[int]:
    """Token ids as a list of ints. Accepted: a list, tuple or range of integers (Python or
    numpy integers), a 1-D integer torch tensor, a 1-D integer numpy array. Rejected
    (InvalidRequestError): str, bytes, dict / mappings, sets, iterators and generators,
    bools, floats, tensors / arrays that are not 1-D integer ones. The vocabulary check is
    :func:`check_tokens`'."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise InvalidRequestError(f"{what} must be a 1-D integer tensor, got {ids.dim()}-D {ids.dtype}")
        return [int(t) for t in ids.tolist()]
    if type(ids).__module__ == "numpy" and hasattr(ids, "dtype") and hasattr(ids, "ndim"):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidRequestError(f"{what} must be a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
        return [int(t) for t in ids.tolist()]
    if isinstance(ids, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(ids, Sequence):
        raise InvalidRequestError(f"{what} must be a sequence of token ids (list, tuple, 1-D integer "
                                  f"tensor or array), got {type(ids).__name__}")
    if set(map(type, ids)) <= {int}:         # the common case, without an ABC check a token (bools are not ints here)
        return list(ids)
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or type(t).__module__ == "torch":
            raise InvalidRequestError(f"{what} contains a non-integer token {t!r}")
        out.append(int(t))
    return out

def check_tokens(ids: Any, what: str, vocab_size: int) -> list[int]:
    """:func:`token_list`, and every id inside the vocabulary ``[0, vocab_size)``."""
    ids = token_list(ids, what)
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return ids
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{what} contains token id {t} outside the vocabulary [0, {vocab_size})")
    return ids


def check_params(params: SamplingParams | None, *, vocab_size: int, routed_experts: bool) -> SamplingParams:
    """The request's params (defaults for None), valid for a worker of this vocabulary that
    keeps (``routed_experts``) or does not keep the routed expert ids."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("sampling params must be a SamplingParams")
    try:
        params.validate()      # frozen, but a caller may have bypassed __post_init__
    except AInferPDError:
        raise
    except Exception as exc:   # a field of a type validate() cannot even compare
        raise InvalidRequestError(f"invalid SamplingParams: {exc!r}") from None
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise InvalidRequestError(f"stop token {t} outside the vocabulary")
    if params.return_routed_experts and not routed_experts:
        raise InvalidRequestError("return_routed_experts needs a worker started with cache.routed_experts: true "
                                  "(the per-slot expert ids are kept beside the KV pool)")
    return params
