"""Tiny random Hugging Face MoE models, built with the installed transformers and saved sharded.

``build(name, root)`` writes ``root/name`` with ``save_pretrained(..., max_shard_size=...)``
(several ``model-0000k-of-0000n.safetensors`` + the index) and returns the directory. Weights are
re-drawn after construction (every parameter and buffer, norms around 1, biases and glm's
``e_score_correction_bias`` non-zero), wide enough that greedy tokens have clear margins.

Reference decoding: :func:`hf_greedy` recomputes transformers' own forward over the whole
context for every token (no cache).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 256
SHARD = "60KB"

# name -> (config class, model class, config kwargs)
SPECS = {
    # QK-norm, softmax top-k with norm_topk_prob, a dense MLP layer in the middle (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1], rope_theta=10000.0)),
    # tied embeddings, decoder_sparse_step 2 (layers 0 and 2 dense), attention_bias (q, k, v and o)
    "qwen3_moe_tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=2, tie_word_embeddings=True, attention_bias=True)),
    # QKV bias, sigmoid-gated shared expert, norm_topk_prob False
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False)),
    # softmax over the top-k logits
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)),
    # sigmoid router + e_score_correction_bias, 4 groups / 2 eligible, routed_scaling_factor, a shared
    # expert, first layer dense, partial RoPE (half of head_dim 16), QK-norm, attention bias
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)),
}
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")


def make(name: str, seed: int = 0):
    """The transformers model of ``name`` (float32, eval mode, random weights of seed ``seed``)."""
    import transformers
    cfg_cls, model_cls, kw = SPECS[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    randomize(model, seed)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Re-draw every floating parameter and persistent buffer: norms 1 + N(0, 0.1), the rest
    N(0, std) with std ~ 1/sqrt(fan_in) (embeddings 1), so logits have clear margins."""
    g = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict())
    items = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, p in items:
        if not p.is_floating_point():
            continue
        r = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1.0 + 0.1 * r)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(r)
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            p.copy_(0.1 * r * scale)
        else:
            fan_in = p.shape[-1]
            p.copy_(r * (scale * 1.5 / fan_in ** 0.5))


def per_expert(named):
    """transformers 5's packed expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, D],
    ``mlp.experts.down_proj`` [E, D, I]) as the checkpoint's per-expert names; others unchanged."""
    for n, t in named:
        if n.endswith("mlp.experts.gate_up_proj"):
            pre, I = n.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{pre}{e}.gate_proj.weight", t[e, :I]
                yield f"{pre}{e}.up_proj.weight", t[e, I:]
        elif n.endswith("mlp.experts.down_proj"):
            pre = n.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{pre}{e}.down_proj.weight", t[e]
        else:
            yield n, t


def save(model, path: Path) -> Path:
    model.save_pretrained(path, max_shard_size=SHARD)
    return path


def build(name: str, root: Path, seed: int = 0) -> Path:
    return save(make(name, seed), root / name)


@torch.no_grad()
def hf_greedy(model, context: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after ``context`` and their logprobs, each from transformers' forward over
    the whole sequence (no KV cache)."""
    seq = list(context)
    toks, lps = [], []
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        seq.append(t)
    return toks, lps
