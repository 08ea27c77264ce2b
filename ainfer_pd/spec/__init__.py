"""Speculative decoding (issue 38), the parts that need no engine: :mod:`.suffix` (model-free
drafts from a trajectory's context and its GRPO siblings' outputs), :mod:`.verify` (exact
verification of k drafts per row: greedy equality, rejection sampling, the target's logprobs) and
:mod:`.adaptive` (how many drafts per row, from the measured verify cost and the acceptance).
See ``docs/SPECULATIVE.md``. The engine's D iteration does not call them yet.
"""
