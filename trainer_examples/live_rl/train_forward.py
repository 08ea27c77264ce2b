"""The training side of the live-RL example: the policy as a Hugging Face transformers model.

The worker serves a ``qwen3_moe``-architecture model (``configs/tiny-cpu.yaml``, or a Hugging
Face directory). The trainer is the installed transformers' ``AutoModelForCausalLM`` of the same
config (``Qwen3MoeForCausalLM``), initialised with the worker's weights (the engine model exported
in transformers' own layout, loaded with ``strict=True``), trained with transformers' forward and
synced back with ``worker.update_weights(trainer.named_parameters())``: transformers' names and
packed expert layout, exactly what a verl trainer streams.

- right-padded batches, no attention mask: causal attention never lets a padded position reach an
  earlier row, and padded rows are masked out of the loss;
- an optional ``compute_dtype``: the float32 master weights cast (differentiably, through
  ``torch.func.functional_call``) to e.g. bfloat16, so the trainer computes with exactly the
  weights a bf16 worker holds.

Shape legend: B = sequences, L = padded length, V = vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ainfer_pd.engine.model.model import MoETransformer
from ainfer_pd.hf.export import state_dict, transformers_config


def make_trainable(model: MoETransformer, *, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The policy as a trainable transformers model holding the worker model's weights: float32
    master weights by default, on ``device`` (default: the worker model's)."""
    from transformers import AutoModelForCausalLM
    dev = device or model.embed.device
    hf = AutoModelForCausalLM.from_config(transformers_config(model.cfg), dtype=dtype)
    hf.load_state_dict(state_dict(model, "transformers"), strict=not model.cfg.tie_word_embeddings)
    hf.to(device=dev, dtype=dtype)
    hf.train()                     # no dropout in these architectures: train() changes nothing numerically
    hf.requires_grad_(True)
    return hf


def forward_logits(model: torch.nn.Module, tokens: Tensor, compute_dtype: torch.dtype | None = None) -> Tensor:
    """tokens [B, L] int64 (right padded) -> logits [B, L, V] float32; row t predicts token t+1.

    ``compute_dtype`` (default: the parameters' dtype) is the dtype the weights are cast to and
    the activations run in; gradients flow back to the parameters through the cast."""
    dt = compute_dtype or next(model.parameters()).dtype
    if dt == next(model.parameters()).dtype:
        out = model(input_ids=tokens, use_cache=False)
    else:
        from torch.func import functional_call
        params = {n: p.to(dt) for n, p in model.named_parameters()}
        out = functional_call(model, params, args=(), kwargs={"input_ids": tokens, "use_cache": False}, strict=False)
    return out.logits.float()


def token_logprobs(model: torch.nn.Module, tokens: Tensor, compute_dtype: torch.dtype | None = None) -> Tensor:
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1: [B, L-1] float32 (differentiable)."""
    logits = forward_logits(model, tokens, compute_dtype)[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def inference_logits(model: MoETransformer, ids: list[int]) -> Tensor:
    """Reference: the rollout engine's ``forward_batch`` over a fresh paged KV cache, one
    prefill sequence of ``ids`` -> logits [T, V] (used by the test to check ``forward_logits``)."""
    from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
    c, d = model.cfg, model.embed.device
    T = len(ids)
    slots = torch.arange(T, device=d)
    fb = ForwardBatch(input_ids=torch.tensor(ids, device=d), positions=slots, write_slots=slots,
                      prefill=[PrefillSeq(q_start=0, q_len=T, ctx_len=T, key_slots=slots)],
                      logits_rows=slots)
    kv = torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim, dtype=model.embed.dtype, device=d)
    return model.forward_batch(fb, kv)
