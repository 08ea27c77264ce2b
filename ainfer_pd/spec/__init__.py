"""Speculative decoding (issue 38), the parts that need no engine: :mod:`.suffix` (model-free
drafts from a trajectory's context and its GRPO siblings' outputs), :mod:`.verify` (exact
verification of k drafts per row: greedy equality, rejection sampling, the target's logprobs) and
:mod:`.adaptive` (how many drafts per row, from the measured verify cost and the acceptance).
See ``docs/SPECULATIVE.md``. The engine's D iteration does not call them yet.

The package imports none of its modules here, so they may import :class:`SpecInputError`."""
from __future__ import annotations

from ..errors import AInferPDError


class SpecInputError(AInferPDError, ValueError):
    """A speculative-decoding function got malformed input: a token that is not a token id, a
    draft longer than the verification's width, logits and rows that disagree, a cost table
    without its one-token time."""
