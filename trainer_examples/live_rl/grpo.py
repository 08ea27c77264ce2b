"""GRPO update: group-normalised advantages, token-level clipped policy-gradient loss on the
generated tokens (ratio against the rollout logprobs of TurnOutput), Adam step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .env import Episode
from .train_forward import token_logprobs


@dataclass(frozen=True, slots=True)
class GRPOConfig:
    lr: float = 3e-3
    clip_eps: float = 0.2
    updates_per_step: int = 2
    """Full-batch gradient steps per rollout batch (the first has ratio 1 up to numerics)."""
    adv_eps: float = 1e-6
    max_grad_norm: float = 1.0


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean_group) / (std_group + eps), groups are consecutive runs of ``group_size``."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
    return a.view(-1).tolist()


def pack(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, L], action mask [B, L-1] and rollout logprobs [B, L-1], aligned
    with ``token_logprobs`` (position t scores token t+1)."""
    L = max(len(e.tokens) for e in episodes)
    B = len(episodes)
    tok = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    old = torch.zeros(B, L - 1, dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        tok[i, :n] = torch.tensor(e.tokens)
        mask[i, :n - 1] = torch.tensor(e.action_mask[1:])
        old[i, :n - 1] = torch.tensor(e.old_logprobs[1:], dtype=torch.float32)
    return tok, mask, old


def grpo_update(model, opt: torch.optim.Optimizer, episodes: list[Episode], group_size: int,
                cfg: GRPOConfig, compute_dtype: torch.dtype | None = None) -> dict:
    """``updates_per_step`` full-batch steps on the model's device (forward in ``compute_dtype``)."""
    dev = next(model.parameters()).device
    adv_list = group_advantages([e.reward for e in episodes], group_size, cfg.adv_eps)
    tok, mask, old = (t.to(dev) for t in pack(episodes))
    adv = torch.tensor(adv_list, dtype=torch.float32, device=dev).unsqueeze(1).expand_as(old)
    n_tok = mask.sum().clamp_min(1)
    stats: dict = {"losses": [], "clip_frac": [], "grad_norm": []}
    for u in range(cfg.updates_per_step):
        lp = token_logprobs(model, tok, compute_dtype)
        if u == 0:   # the trainer's weights are the worker's: rollout logprobs must match
            d = (lp.detach() - old).abs()[mask]
            stats["logprob_mismatch_max"] = float(d.max()) if d.numel() else 0.0
            stats["logprob_mismatch_mean"] = float(d.mean()) if d.numel() else 0.0
        ratio = torch.exp(lp - old)
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
        obj = torch.minimum(ratio * adv, clipped * adv)
        loss = -(obj * mask).sum() / n_tok                       # token-level mean over generated tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        stats["losses"].append(loss.item())
        stats["grad_norm"].append(float(gn))
        stats["clip_frac"].append(float(((ratio.detach() - clipped.detach()).abs() > 0)[mask].float().mean()))
    stats["loss"] = stats["losses"][0]
    stats["num_action_tokens"] = int(n_tok)
    stats["adv_abs_mean"] = float(adv[:, 0].abs().mean())
    return stats


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adam over the float32 master weights (the fused kernel on CUDA)."""
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.Adam(model.parameters(), lr=lr, fused=True if on_cuda else None)
