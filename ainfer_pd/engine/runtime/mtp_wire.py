"""The MTP drafter's passes in a replica's broadcast (``spec.method: mtp`` under attention TP).

A TP follower runs every pass of its leader (:mod:`.replica`); under ``mtp`` each pass carries the MTP
layer's catch-up, and a verify round the draft chain, whose rows, positions and MTP KV slots the
leader computes from its turns and KV. They travel here as int64 host tensors, so the follower runs
the same catch-ups and chains (the TP collectives inside the MTP layer pair up) and keeps the same
stashes in its mirror. A trajectory is named by its stash key (:class:`~ainfer_pd.spec.stash_keys.StashKeys`:
``key(tid)``), the follower's :class:`~ainfer_pd.spec.mtp.MtpDrafter` holds its stashes under it.
Pure: tensors in, the :mod:`~ainfer_pd.spec.mtp_batch` structures out.

* D (:func:`pack_decode_catch_up`): a fixed size for the agreed rows (:func:`decode_catch_up_numel`),
  appended to the D batch's one broadcast.
* P (:func:`pack_prefill_catch_up`): variable, in the P batch's broadcast (:func:`join` / :func:`split`).
* The chain of a verify round (:func:`pack_chain`): its steps as D batches of the agreed rows
  (:func:`~.replica.pack_decode`) and the stash rows its first step reads; a fixed size
  (:func:`chain_numel`).

Shape legend: B = the agreed (padded) D rows, N = the leader's own pass rows, W = the broadcast's
block-table width.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...spec.mtp_batch import CatchUp, DecodeCatchUp
from ..attention import ForwardBatch
from .replica import decode_numel, pack_decode, pack_seqs, unpack_decode, unpack_seqs

Key = Callable[[str], int]
"""A trajectory id -> its stash key on the followers."""
I64 = torch.int64


def join(parts: list[Tensor]) -> Tensor:
    """[k, len_1 .. len_k, part_1 .. part_k] int64 (host): ``parts`` flattened, in one tensor."""
    flat = [p.reshape(-1).to("cpu", I64) for p in parts]
    return torch.cat([torch.tensor([len(flat), *(p.numel() for p in flat)], dtype=I64), *flat])


def split(buf: Tensor) -> list[Tensor]:
    """The parts of :func:`join` (views of ``buf``)."""
    k = int(buf[0])
    o, out = 1 + k, []
    for n in buf[1:1 + k].tolist():
        out.append(buf[o:o + n])
        o += n
    return out


def _rows(items: list[tuple], width: int) -> Tensor:
    return torch.tensor(items, dtype=I64).reshape(-1, width)


# ====================================================================== D: a decode pass's catch-up
def decode_catch_up_numel(rows: int) -> int:
    """[N, refs, keeps, first B, first_write B, (row, key, p) x B, (key, a, b, p0) x B]."""
    return 3 + 9 * rows


def pack_decode_catch_up(cu: DecodeCatchUp, key: Key, rows: int) -> Tensor:
    """The catch-up of a D batch of ``rows`` agreed rows (the leader's N rows first, the padding
    past them is the follower's own: :meth:`~ainfer_pd.spec.mtp_batch.DecodeCatchUp.padded`)."""
    n = int(cu.first.shape[0])
    if n > rows:
        raise ValueError(f"a catch-up of {n} rows over a D batch of {rows}")
    out = torch.full((decode_catch_up_numel(rows),), -1, dtype=I64)
    out[:3] = torch.tensor([n, len(cu.refs), len(cu.keeps)])
    out[3:3 + n] = cu.first.to("cpu", I64)
    out[3 + rows:3 + rows + n] = cu.first_write.cpu()
    refs = _rows([(q, key(tid), p) for q, tid, p in cu.refs], 3).reshape(-1)
    keeps = _rows([(key(tid), a, b, p0) for tid, a, b, p0 in cu.keeps], 4).reshape(-1)
    o = 3 + 2 * rows
    out[o:o + refs.numel()] = refs
    o += 3 * rows
    out[o:o + keeps.numel()] = keeps
    return out


def unpack_decode_catch_up(buf: Tensor, rows: int, device: torch.device) -> DecodeCatchUp:
    """The catch-up of :func:`pack_decode_catch_up`, its trajectories named by their stash keys."""
    n, nr, nk = buf[:3].tolist()
    o = 3 + 2 * rows
    refs = [tuple(r) for r in buf[o:o + 3 * nr].view(nr, 3).tolist()]
    o += 3 * rows
    keeps = [tuple(k) for k in buf[o:o + 4 * nk].view(nk, 4).tolist()]
    return DecodeCatchUp(buf[3:3 + n].to(device=device, dtype=torch.bool), buf[3 + rows:3 + rows + n].to(device),
                         refs, torch.tensor([q for q, _, _ in refs], dtype=I64, device=device), keeps)


# ====================================================================== P: a P epoch's catch-up
EMPTY_PASS, CATCH_UP = 0, 1
"""The kinds of a P pass's catch-up: a pass of no rows (on a replica with nothing to prefill; the
layer runs over none: :class:`DecodeCatchUp` of no rows, as the leader builds it), or rows."""


def pack_prefill_catch_up(cu: CatchUp | DecodeCatchUp, key: Key) -> Tensor:
    """The catch-up of a P batch (prompt chunks only: several ranks run no mixed batch)."""
    if type(cu) is DecodeCatchUp:
        if cu.first.numel():
            raise ValueError("a P pass's catch-up has decode rows")
        return join([torch.tensor([EMPTY_PASS])])
    fb = cu.fb
    if fb is not None and fb.decode is not None:
        raise ValueError("a P pass's catch-up has decode rows (several ranks run no mixed batch)")
    none = torch.zeros(0, dtype=I64)
    head = torch.tensor([CATCH_UP, int(fb is not None), len(fb.prefill) if fb is not None else 0])
    return join([head, fb.positions if fb is not None else none, fb.write_slots if fb is not None else none,
                 pack_seqs(fb.prefill) if fb is not None else none, cu.tok_idx, cu.extra, cu.hid_idx,
                 _rows([(key(tid), p) for tid, p in cu.refs], 2), cu.keep_idx,
                 _rows([(key(tid), a, b, p0) for tid, a, b, p0 in cu.keeps], 4),
                 torch.tensor([key(tid) for tid in cu.drops], dtype=I64)])


def unpack_prefill_catch_up(buf: Tensor, device: torch.device, block_size: int) -> CatchUp | DecodeCatchUp:
    """The catch-up of :func:`pack_prefill_catch_up`, its trajectories named by their stash keys."""
    parts = split(buf)
    if int(parts[0][0]) == EMPTY_PASS:
        none = torch.zeros(0, dtype=I64, device=device)
        return DecodeCatchUp(none.bool(), none, [], none, [])
    _, has_fb, S = parts[0].tolist()
    pos, slots, seqs, tok, extra, hid, refs, keep, keeps, drops = parts[1:]
    fb = None
    if has_fb:
        fb = ForwardBatch(input_ids=torch.empty(0, dtype=I64, device=device), positions=pos.to(device),
                          write_slots=slots.to(device), prefill=unpack_seqs(seqs, S)[0], block_size=block_size)
    return CatchUp(fb, tok.to(device), extra.to(device), hid.to(device),
                   [tuple(r) for r in refs.view(-1, 2).tolist()], keep.to(device),
                   [tuple(k) for k in keeps.view(-1, 4).tolist()], drops.tolist())


# ====================================================================== the draft chain of a verify round
def chain_numel(rows: int, depth: int, width: int) -> int:
    """[J, keys B, positions B, step 0 .. step depth - 1 (each a D batch of B rows)]."""
    return 1 + 2 * rows + depth * decode_numel(rows, width)


def pack_chain(steps: list[ForwardBatch], refs: list[tuple[str, int]], key: Key, rows: int,
               width: int) -> Tensor:
    """A world chain (:func:`~ainfer_pd.spec.mtp_batch.world_chain_batches`: every step ``rows``
    rows) and its jobs' stash rows ``refs`` (tid, position), the first ``len(refs)`` rows'."""
    if len(refs) > rows:
        raise ValueError(f"{len(refs)} chain rows over a world chain of {rows}")
    ref = torch.full((2, rows), -1, dtype=I64)
    if refs:
        ref[:, :len(refs)] = _rows([(key(tid), p) for tid, p in refs], 2).T
    return torch.cat([torch.tensor([len(refs)], dtype=I64), ref.reshape(-1),
                      *(pack_decode(fb, width) for fb in steps)])


def unpack_chain(buf: Tensor, rows: int, depth: int, width: int, device: torch.device,
                 block_size: int) -> tuple[list[ForwardBatch], list[tuple[int, int]]]:
    """The steps and stash rows (key, position) of :func:`pack_chain`."""
    J = int(buf[0])
    ref = buf[1:1 + 2 * rows].view(2, rows)[:, :J]
    o, n, steps = 1 + 2 * rows, decode_numel(rows, width), []
    for _ in range(depth):
        steps.append(unpack_decode(buf[o:o + n], rows, width, device, block_size))
        o += n
    return steps, [tuple(r) for r in ref.T.tolist()]
