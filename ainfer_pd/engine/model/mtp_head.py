"""The MTP draft layer's own parameters (:class:`MtpHead`, ``model.mtp``) and its optional tensors:
what :class:`~.model.MoETransformer` builds beside ``layers[num_layers]`` under ``spec.method: mtp``.
The layer's forward is :mod:`.mtp_layer`'s (which imports the model; this module does not, so the
model can build the head)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

OWN_TENSORS = {"head": "shared_head.head.weight", "embed": "embed_tokens.weight"}
"""The MTP layer's optional tensors (its own copy of the output head and of the embedding), by the
checkpoint's name under ``model.layers.L.``."""


class MtpHead(nn.Module):
    """The MTP layer's parameters beside its decoder layer (see the module docstring)."""

    def __init__(self, c) -> None:
        super().__init__()
        D = c.hidden_size
        self.enorm = nn.Parameter(torch.ones(D))
        self.hnorm = nn.Parameter(torch.ones(D))
        self.eh_proj = nn.Parameter(torch.empty(D, 2 * D))     # (out, in): in = [enorm(embed), hnorm(h)]
        self.head_norm = nn.Parameter(torch.ones(D))
        self.head: nn.Parameter | None = None                   # own [V, D], else the main lm_head
        self.embed: nn.Parameter | None = None                  # own [V, D], else the main embedding

    def own(self, which: str, like: Tensor) -> None:
        """Give the layer its own ``head`` or ``embed`` (the checkpoint holds one): a new
        parameter of ``like``'s shape, dtype and device, filled by the loader."""
        if which not in OWN_TENSORS:
            raise ValueError(f"the MTP layer has no optional tensor {which!r}")
        setattr(self, which, nn.Parameter(torch.empty_like(like), requires_grad=False))


def adopt_own_tensors(model: nn.Module, names) -> list[str]:
    """Before a checkpoint of ``names`` is loaded into ``model`` (which holds an MTP layer): give
    the layer its own head / embedding for each one the checkpoint stores. Returns those."""
    prefix = f"model.layers.{model.cfg.num_layers}."
    out = []
    for which, leaf in OWN_TENSORS.items():
        if prefix + leaf in names and getattr(model.mtp, which) is None:
            model.mtp.own(which, model.lm_head if which == "head" else model.embed)
            out.append(which)
    if out:
        object.__setattr__(model, "_name_table", None)      # a table built before knows no such parameter
    return out
