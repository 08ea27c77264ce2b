"""An attention-DP replica's step inputs: the leader builds them, its TP followers receive them.

The replica leader (``tp_rank`` 0) owns the replica's requests, KV accounting and sampling; its
TP followers hold the other head shards of the same KV blocks and run the same segments on the
same batch. :class:`ReplicaChannel` is the leader -> followers broadcast over the replica's own
gloo group (host data: token ids, positions, KV slots, block tables), on one thread per rank so
the broadcasts keep the order of the agreed step decisions that trigger them: one per D
iteration (its size follows from the agreed padded batch), two per P epoch (size, then batch).

A D batch is padded to the agreed row count: D's collectives gather every replica's rows, so
every replica brings the same number (padding rows decode one key of the scratch block).

Shape legend: T = prefill tokens, S = sequences, B = padded decode rows, W = block-table width.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
from typing import Any

import torch
from torch import Tensor

from ...errors import DistributedError, RendezvousTimeout
from ..attention import DecodeMeta, ForwardBatch, PrefillSeq

__all__ = ["ReplicaChannel", "pack_prefill", "unpack_prefill", "pack_seqs", "unpack_seqs", "pad_decode", "pack_decode",
           "unpack_decode"]


# ====================================================================== P batches
def pack_seqs(seqs: list[PrefillSeq]) -> Tensor:
    """[(q0, n, ctx, nb) x S, blocks ...] int64 (host): prefill sequences and their block ids."""
    table, blocks = [], []
    for s in seqs:
        ids = s.block_ids.to("cpu", torch.int64)
        table += [s.q_start, s.q_len, s.ctx_len, ids.numel()]
        blocks.append(ids)
    return torch.cat([torch.tensor(table, dtype=torch.int64), *blocks])


def unpack_seqs(buf: Tensor, S: int) -> tuple[list[PrefillSeq], int]:
    """The ``S`` sequences of :func:`pack_seqs` at the start of ``buf``, and the entries they took."""
    table = buf[:4 * S].view(S, 4).tolist()
    o, seqs = 4 * S, []
    for q0, n, ctx, nb in table:
        seqs.append(PrefillSeq(q0, n, ctx, block_ids=buf[o:o + nb].clone()))
        o += nb
    return seqs, o


def pack_prefill(fb: ForwardBatch) -> Tensor:
    """[T, S, ids T, positions T, slots T, (q0, n, ctx, nb) x S, blocks ...] int64 (host)."""
    head = torch.tensor([int(fb.input_ids.shape[0]), len(fb.prefill)], dtype=torch.int64)
    return torch.cat([head, fb.input_ids.cpu(), fb.positions.cpu(), fb.write_slots.cpu(), pack_seqs(fb.prefill)])


def unpack_prefill(buf: Tensor, device: torch.device, block_size: int) -> ForwardBatch:
    """The P batch of :func:`pack_prefill`, without logits rows (a follower samples nothing)."""
    T, S = int(buf[0]), int(buf[1])
    o = 2
    ids, pos, slots = buf[o:o + T], buf[o + T:o + 2 * T], buf[o + 2 * T:o + 3 * T]
    seqs, _ = unpack_seqs(buf[o + 3 * T:], S)
    return ForwardBatch(input_ids=ids.to(device), positions=pos.to(device), write_slots=slots.to(device),
                        prefill=seqs, logits_rows=torch.zeros(0, dtype=torch.int64, device=device),
                        block_size=block_size)


# ====================================================================== D batches
def pad_decode(fb: ForwardBatch, rows: int, scratch_slot: int, scratch_block: int) -> ForwardBatch:
    """``fb`` (decode rows only) padded to ``rows`` rows; padding rows feed token 0 at position 0,
    write the scratch slot and read one key of the scratch block. Logits rows stay the real ones."""
    meta = fb.decode
    n = int(fb.input_ids.shape[0])
    if n > rows:
        raise ValueError(f"decode batch of {n} rows exceeds the agreed {rows}")
    if meta is None:                                  # no rows here: an all-padding batch
        dev = fb.input_ids.device
        table = torch.zeros(0, 1, dtype=torch.int64, device=dev)
        lens = torch.zeros(0, dtype=torch.int64, device=dev)
        bs = fb.block_size
    else:
        table, lens, bs = meta.block_table, meta.ctx_lens, meta.block_size
    k = rows - n
    dev = fb.input_ids.device

    def ext(t: Tensor, v: int) -> Tensor:
        return torch.cat([t, torch.full((k,), v, dtype=t.dtype, device=dev)])

    w = max(1, int(table.shape[1]))
    table = torch.nn.functional.pad(table, (0, w - table.shape[1]), value=scratch_block)
    table = torch.cat([table, torch.full((k, w), scratch_block, dtype=torch.int64, device=dev)])
    lead = meta.lead_off if meta is not None else None
    return ForwardBatch(input_ids=ext(fb.input_ids, 0), positions=ext(fb.positions, 0),
                        write_slots=ext(fb.write_slots, scratch_slot),
                        decode=DecodeMeta(None, ext(lens, 1), block_table=table, block_size=bs,
                                          lead_off=None if lead is None else ext(lead, 0),
                                          group_width=meta.group_width if lead is not None else 1),
                        logits_rows=fb.logits_rows, block_size=bs, padded=k > 0)


def pack_decode(fb: ForwardBatch, width: int) -> Tensor:
    """[W, G, ids B, positions B, slots B, lens B, lead offsets B, table B x ``width``] int64 (host); W =
    the table's own width (the broadcast pads it to ``width``, the widest any row can need), G = the
    verify group width (0: no ``lead_off``)."""
    m = fb.decode
    W = int(m.block_table.shape[1])
    if W > width:
        raise ValueError(f"block table of width {W} exceeds the broadcast width {width}")
    table = torch.nn.functional.pad(m.block_table.cpu(), (0, width - W))
    lead = torch.zeros_like(m.ctx_lens, device="cpu") if m.lead_off is None else m.lead_off.cpu()
    return torch.cat([torch.tensor([W, 0 if m.lead_off is None else m.group_width], dtype=torch.int64),
                      fb.input_ids.cpu(), fb.positions.cpu(), fb.write_slots.cpu(), m.ctx_lens.cpu(), lead,
                      table.reshape(-1)])


def decode_numel(rows: int, width: int) -> int:
    return 2 + rows * (5 + width)


def unpack_decode(buf: Tensor, rows: int, width: int, device: torch.device, block_size: int) -> ForwardBatch:
    """The D batch of :func:`pack_decode`, without logits rows (a follower samples nothing)."""
    W, G, B = int(buf[0]), int(buf[1]), rows
    v = buf[2:2 + 5 * B].view(5, B)
    table = buf[2 + 5 * B:].view(B, width)[:, :W]
    return ForwardBatch(input_ids=v[0].to(device), positions=v[1].to(device), write_slots=v[2].to(device),
                        decode=DecodeMeta(None, v[3].to(device), block_table=table.to(device), block_size=block_size,
                                          lead_off=v[4].to(device) if G else None, group_width=max(G, 1)),
                        logits_rows=torch.zeros(0, dtype=torch.int64, device=device), block_size=block_size,
                        padded=True)          # the leader's rows, padded to the agreed count


# ====================================================================== the channel
class ReplicaChannel:
    """Leader -> followers broadcast of one replica's step inputs (see module docstring).

    ``group``: the replica's gloo group (``build_process_groups(...)["replica"]``, its gloo
    timeout = ``timeout_s``); ``leader``: its global rank. Every wait is bounded: a follower that
    does not hear from its leader raises :class:`RendezvousTimeout` naming the leader; a leader
    whose broadcast fails raises :class:`DistributedError` naming its followers.
    """

    def __init__(self, group: Any, *, rank: int, leader: int, members: tuple[int, ...], timeout_s: float) -> None:
        self.group, self.rank, self.leader, self.members = group, rank, leader, tuple(members)
        self.timeout_s = float(timeout_s)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ainfer-pd-replica-r{rank}")
        self.num_broadcasts = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def _bcast(self, t: Tensor) -> Tensor:
        import torch.distributed as dist
        dist.broadcast(t, src=self.leader, group=self.group)
        return t

    async def _run(self, t: Tensor, what: str) -> Tensor:
        loop = asyncio.get_running_loop()
        self.num_broadcasts += 1
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._pool.submit(self._bcast, t), loop=loop),
                                          self.timeout_s + 5.0)
        except (TimeoutError, RuntimeError) as exc:
            followers = [r for r in self.members if r != self.leader]
            if self.is_leader:
                raise DistributedError(f"rank {self.rank}: broadcast of the {what} to TP followers {followers} "
                                       f"failed: {exc!r}") from exc
            raise RendezvousTimeout(f"rank {self.rank}: no {what} from replica leader rank {self.leader} "
                                    f"within {self.timeout_s:g} s ({exc!r})", missing_ranks=(self.leader,)) from exc

    async def share(self, payload: Tensor | None, numel: int | None, what: str) -> Tensor:
        """The leader's ``payload`` (int64, host) on every member. ``numel``: its size when every
        member knows it (one broadcast), else None (the size goes first)."""
        if numel is None:
            n = torch.tensor([payload.numel() if self.is_leader else 0], dtype=torch.int64)
            numel = int((await self._run(n, what + " size"))[0])
        buf = payload.contiguous() if self.is_leader else torch.empty(numel, dtype=torch.int64)
        if buf.numel() != numel:
            raise DistributedError(f"rank {self.rank}: {what} has {buf.numel()} entries, agreed {numel}")
        return await self._run(buf, what)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
