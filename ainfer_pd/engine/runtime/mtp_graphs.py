"""The decode graphs of ``spec.method: mtp``: each graph replays a D pass and the MTP layer's
catch-up after it (:func:`~ainfer_pd.spec.mtp.decode_mtp_pass`), so a speculating D loop stays on
the graphs, as vLLM and SGLang capture their MTP / EAGLE draft-extend passes.

The catch-up of a decode pass has the pass's shape (one MTP row per pass row:
:func:`~ainfer_pd.spec.mtp_batch.decode_catch_up`) and derives its positions, lengths and non-first
KV slots on the device from the pass's own static inputs. A graph adds three static inputs (per
row: ``first``, its turn's first row; ``fwrite``, a first row's MTP KV slot, scratch elsewhere;
``prev`` [B, D], a first row's stash row h_{s-1}) and one static output, the pass's last hidden
states [B, D], from which the turns' stashes are copied after the replay. Padded rows are first
rows writing the scratch slot. A cost measurement's batch (no catch-up) replays the same graph
with every row padding (its time includes the catch-up, as every MTP iteration's does).

The P graphs (:mod:`.prefill_graphs`) serve MTP too: the catch-up of a P pass (variable shape)
runs eagerly after the replayed pass, on the hidden states the P graphs leave in their static
buffer. The draft chain (:meth:`~ainfer_pd.spec.mtp.MtpDrafter.prepare`, K one-layer steps) stays
eager.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...spec.mtp import decode_mtp_pass
from ...spec.mtp_batch import DecodeCatchUp
from ..attention import ForwardBatch
from .cuda_graphs import DecodeGraphs
from .tensor_parallel import LOCAL


class MtpDecodeGraphs(DecodeGraphs):
    """Decode graphs of an :class:`~.mtp_runner.MtpRunner`: pass + catch-up (module docstring)."""

    def _static(self, B: int, L: int, dev) -> dict[str, Tensor]:
        s = super()._static(B, L, dev)
        m = self.runner.model
        s["first"] = torch.ones(B, dtype=torch.bool, device=dev)
        s["fwrite"] = torch.full((B,), self.scratch, dtype=torch.int64, device=dev)
        s["prev"] = torch.zeros(B, m.cfg.hidden_size, dtype=m.embed.dtype, device=dev)
        return s

    def _run(self, fb: ForwardBatch, s: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The pass (its phase's hooks, as ``forward_fb``), then its catch-up -> (logits [B, V],
        last hidden states [B, D])."""
        r = self.runner
        h, hidden = self.ctx.comm.hooks or LOCAL, []
        logits = r.model.forward_batch(fb, r.kv_cache, h.experts, h.attn_reduce, h.gather, on_hidden=hidden.append)
        decode_mtp_pass(r.model, fb, hidden[0], s["first"], s["fwrite"], s["prev"], r.drafter.mtp_kv(),
                        self.ctx.comm.hooks)
        return logits, hidden[0]

    def _fill(self, s: dict[str, Tensor], fb: ForwardBatch, cu: DecodeCatchUp | None = None) -> None:
        super()._fill(s, fb)
        n = int(fb.input_ids.shape[0])
        if cu is None:                     # a cost measurement: every row padding
            n = 0
        else:
            s["first"][:n].copy_(cu.first)
            s["fwrite"][:n].copy_(cu.first_write)
            self.runner.drafter.fill_first_rows(cu, s["prev"])
        s["first"][n:].fill_(True)
        s["fwrite"][n:].fill_(self.scratch)

    def _result(self, out: tuple[Tensor, Tensor], B: int, cu: DecodeCatchUp | None = None) -> Tensor:
        logits, hidden = out
        if cu is not None:
            self.runner.drafter.keep(cu, hidden)
        return logits[:B].clone()
