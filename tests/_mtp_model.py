"""A tiny glm4_moe checkpoint with an MTP layer (``num_nextn_predict_layers: 1``), written here:
transformers' ``Glm4MoeForCausalLM`` has no MTP forward (it skips ``model.layers.L.*`` on load), so
the layer is built from its own pieces, ``Glm4MoeDecoderLayer(config, L)`` plus ``enorm`` /
``hnorm`` / ``eh_proj`` / ``shared_head`` / ``embed_tokens``, saved into an extra shard listed in
the index, and :func:`reference_drafts` is the greedy MTP chain recomputed from them over the
whole sequence (no cache): the oracle of the engine's drafts.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tests import _hf_models

MTP_SHARD = "model-mtp.safetensors"


class MtpReference(nn.Module):
    """The MTP layer in transformers' modules (DeepSeek-V3 / GLM-4.5 shape)."""

    def __init__(self, cfg, own_head: bool = True, own_embed: bool = True) -> None:
        super().__init__()
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm
        D, V, eps = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps
        self.block = Glm4MoeDecoderLayer(cfg, cfg.num_hidden_layers)
        self.enorm, self.hnorm = Glm4MoeRMSNorm(D, eps=eps), Glm4MoeRMSNorm(D, eps=eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.head_norm = Glm4MoeRMSNorm(D, eps=eps)
        self.head = nn.Linear(D, V, bias=False) if own_head else None
        self.embed = nn.Embedding(V, D) if own_embed else None

    def checkpoint_tensors(self, L: int) -> dict[str, torch.Tensor]:
        """The layer under the checkpoint's names ``model.layers.L.*`` (per-expert tensors)."""
        out = {f"model.layers.{L}.{n}": t for n, t in _hf_models.per_expert(self.block.state_dict().items())}
        out.update({f"model.layers.{L}.enorm.weight": self.enorm.weight, f"model.layers.{L}.hnorm.weight":
                    self.hnorm.weight, f"model.layers.{L}.eh_proj.weight": self.eh_proj.weight,
                    f"model.layers.{L}.shared_head.norm.weight": self.head_norm.weight})
        if self.head is not None:
            out[f"model.layers.{L}.shared_head.head.weight"] = self.head.weight
        if self.embed is not None:
            out[f"model.layers.{L}.embed_tokens.weight"] = self.embed.weight
        return {n: t.detach().contiguous().clone() for n, t in out.items()}


def make(seed: int = 0, own_head: bool = True, own_embed: bool = True):
    """(the transformers glm4_moe model with ``num_nextn_predict_layers=1``, its MTP layer)."""
    import transformers
    _, _, kw = _hf_models.SPECS["glm4_moe"]
    cfg = transformers.Glm4MoeConfig(vocab_size=_hf_models.VOCAB, eos_token_id=1, num_nextn_predict_layers=1, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(cfg).float().eval()
    _hf_models.randomize(model, seed)
    mtp = MtpReference(cfg, own_head, own_embed).float().eval()
    _hf_models.randomize(mtp, seed + 1000)
    return model, mtp


def save(model, mtp: MtpReference | None, path: Path) -> Path:
    """The model's checkpoint (sharded, with its index) plus the MTP layer's shard (None: the
    config says one MTP layer, the checkpoint has none)."""
    from safetensors.torch import save_file
    _hf_models.save(model, path)
    if mtp is None:
        return path
    tensors = mtp.checkpoint_tensors(model.config.num_hidden_layers)
    save_file(tensors, str(path / MTP_SHARD), metadata={"format": "pt"})
    idx = path / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"].update({n: MTP_SHARD for n in tensors})
    idx.write_text(json.dumps(data))
    return path


@torch.no_grad()
def target_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The last decoder layer's outputs (before the final norm) over ``tokens``: [S, D]."""
    got = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: got.append(out))
    try:
        model(torch.tensor([tokens]), use_cache=False)
    finally:
        hook.remove()
    return got[0][0]


@torch.no_grad()
def reference_drafts(model, mtp: MtpReference, tokens: list[int], k: int) -> list[int]:
    """The greedy MTP chain after ``tokens`` (t_0 .. t_{n-1}): position p < n - 1 takes (h_p,
    t_{p+1}); the draft j + 1 comes from position n - 2 + j, fed the chain's own output and draft j."""
    n = len(tokens)
    h = target_hidden(model, tokens[:n - 1])                                         # [n - 1, D]
    embed = mtp.embed if mtp.embed is not None else model.model.embed_tokens
    head = mtp.head if mtp.head is not None else model.lm_head
    xs = [mtp.eh_proj(torch.cat([mtp.enorm(embed(torch.tensor(tokens[1:]))), mtp.hnorm(h)], -1))]
    drafts: list[int] = []
    for _ in range(k):
        x = torch.cat(xs)[None]                                                      # [1, S, D]
        S = x.shape[1]
        pos = torch.arange(S)[None]
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        y = mtp.block(x, attention_mask=mask, position_ids=pos,
                      position_embeddings=model.model.rotary_emb(x, position_ids=pos))[0]
        last = y[-1:]
        d = int(head(mtp.head_norm(last)).argmax(-1))
        drafts.append(d)
        xs.append(mtp.eh_proj(torch.cat([mtp.enorm(embed(torch.tensor([d]))), mtp.hnorm(last)], -1)))
    return drafts


def fit(model, mtp: MtpReference, sequences: list[list[int]], steps: int = 40, lr: float = 2e-2) -> float:
    """Train the MTP layer (only) to predict t_{p+2} from (h_p, t_{p+1}) on ``sequences`` (the
    target's own greedy rollouts: its drafts are then accepted often on them). Returns the last loss."""
    embed = mtp.embed if mtp.embed is not None else model.model.embed_tokens
    head = mtp.head if mtp.head is not None else model.lm_head
    model.requires_grad_(False)
    data = [(torch.tensor(s), target_hidden(model, s)) for s in sequences]
    params = [p for n, p in mtp.named_parameters() if "e_score_correction_bias" not in n]
    opt = torch.optim.Adam(params, lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for toks, h in data:
            S = toks.shape[0] - 2
            x = mtp.eh_proj(torch.cat([mtp.enorm(embed(toks[1:S + 1])), mtp.hnorm(h[:S])], -1))[None]
            pos = torch.arange(S)[None]
            mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
            y = mtp.block(x, attention_mask=mask, position_ids=pos,
                          position_embeddings=model.model.rotary_emb(x, position_ids=pos))[0]
            loss = loss + torch.nn.functional.cross_entropy(head(mtp.head_norm(y)), toks[2:S + 2])
        loss.backward()
        opt.step()
    mtp.eval()
    return float(loss.detach()) / len(data)
