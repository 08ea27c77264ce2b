"""Speculative decoding (issue 38): :mod:`.suffix` (model-free drafts from a trajectory's context
and its GRPO siblings' outputs), :mod:`.mtp` (greedy drafts from the model's MTP layer, with
:mod:`.mtp_batch` its passes' metadata), :mod:`.verify` (exact verification of k drafts per row:
greedy equality, rejection sampling, the target's logprobs), :mod:`.adaptive` (how many drafts per
row, from the measured verify cost and the acceptance) and :mod:`.speculator` (the engine's side:
which rows of a D iteration verify what). See ``docs/SPECULATIVE.md``.
"""
