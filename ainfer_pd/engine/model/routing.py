"""Router variants of the supported architectures, each producing the same :class:`Routing`.

Shape legend: T = tokens, D = hidden, E = routed experts, k = top-k, G = expert groups.

* ``softmax`` (qwen3_moe, qwen2_moe, mixtral): logits in the model dtype, softmax in float32
  over all experts, top-k; ``norm_topk_prob`` renormalises the k weights (mixtral always does:
  softmax over the chosen logits).
* ``sigmoid`` (glm4_moe): logits and sigmoid scores in float32; the *choice* adds
  ``e_score_correction_bias`` and is group-limited (each of G groups scored by the sum of its
  top-2 choice scores, only the best ``topk_groups`` groups eligible); the combine weights are
  the chosen experts' plain sigmoid scores, renormalised (``+ 1e-20``) when ``norm_topk_prob``,
  times ``routed_scaling_factor``.

``Routing.topk_weights`` is always the final combine weight (renormalisation and scaling
included), in the model dtype. Nothing here synchronises the host: no ``.item()``, no boolean
indexing, group masks by ``scatter_`` + ``masked_fill`` (CUDA-graph capturable).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...config import ModelConfig
from .moe import Routing, routing_of


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How one MoE layer turns router logits into a top-k choice and combine weights."""

    kind: str                     # "softmax" | "sigmoid"
    top_k: int
    norm_topk_prob: bool = True
    num_groups: int = 1           # sigmoid: expert groups (n_group)
    topk_groups: int = 1          # sigmoid: eligible groups per token (topk_group)
    scaling: float = 1.0          # routed_scaling_factor

    @classmethod
    def of(cls, c: ModelConfig) -> "RouterSpec":
        return cls(kind=c.router, top_k=c.top_k, norm_topk_prob=c.norm_topk_prob, num_groups=c.num_expert_groups,
                   topk_groups=c.topk_groups, scaling=c.routed_scaling_factor)


def route(x: Tensor, router_w: Tensor, spec: RouterSpec, bias: Tensor | None = None) -> Routing:
    """x [T, D], router_w [E, D], bias [E] float32 (sigmoid only) -> Routing over E experts."""
    if spec.kind == "softmax":
        topk_w, topk_idx = _softmax_topk(x, router_w, spec)
    elif spec.kind == "sigmoid":
        if bias is None:
            raise ValueError("the sigmoid router needs e_score_correction_bias")
        topk_w, topk_idx = _sigmoid_topk(x, router_w, bias, spec)
    else:  # pragma: no cover - ModelConfig.validate refuses other kinds
        raise ValueError(f"unknown router kind {spec.kind!r}")
    if spec.scaling != 1.0:
        topk_w = topk_w * spec.scaling
    return routing_of(topk_idx, topk_w.to(x.dtype), router_w.shape[0])


def _softmax_topk(x: Tensor, router_w: Tensor, spec: RouterSpec) -> tuple[Tensor, Tensor]:
    logits = F.linear(x, router_w)                                   # [T, E] in the model dtype
    probs = torch.softmax(logits.float(), dim=-1)
    topk_w, topk_idx = torch.topk(probs, spec.top_k, dim=-1)         # [T, k]
    if spec.norm_topk_prob:
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    return topk_w, topk_idx


def _sigmoid_topk(x: Tensor, router_w: Tensor, bias: Tensor, spec: RouterSpec) -> tuple[Tensor, Tensor]:
    T = x.shape[0]
    E = router_w.shape[0]
    scores = F.linear(x.float(), router_w.float()).sigmoid()        # [T, E] float32
    choice = scores + bias.float()                                   # [T, E]
    G = spec.num_groups
    if G > 1 and spec.topk_groups < G:
        grouped = choice.view(T, G, E // G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)     # [T, G]
        group_idx = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)   # [T, G]
        expert_mask = group_mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    topk_idx = torch.topk(choice, spec.top_k, dim=-1, sorted=False).indices   # [T, k]
    topk_w = scores.gather(1, topk_idx)                              # [T, k] plain sigmoid scores
    if spec.norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_w, topk_idx
