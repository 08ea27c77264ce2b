"""What one forward pass carries: the flat batch and its attention metadata.

Shape legend: T = new tokens in the batch, B = decode rows, L = padded key length,
NB = blocks per row, S = prefill sequences, NT = prefill query tiles.

A token's KV lives in cache slot ``block * block_size + offset``. Prefill sequences come
first in the flat batch, decode rows (one new token each) after them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(slots=True)
class PrefillSeq:
    """One sequence's new tokens inside a flat batch.

    ``key_slots`` lists the cache slot of every key (the reference path gathers them);
    ``block_ids`` lists the sequence's KV blocks in position order (the paged kernels read
    the cache through them). Either may be derived from the other (see :func:`slots_of_blocks`).
    """

    q_start: int          # first row of this sequence in the flat batch
    q_len: int            # new tokens
    ctx_len: int          # keys after this step (cached + new)
    key_slots: Tensor | None = None    # [ctx_len] cache slot of every key, in position order
    block_ids: Tensor | None = None    # [>= ceil(ctx_len / block_size)] int64 block ids


@dataclass(slots=True)
class DecodeMeta:
    """Decode rows (one new token each) at the end of the flat batch.

    Either ``key_slots`` is given, or ``block_table`` (``[B, NB]`` block ids, padded with any
    valid block) from which :meth:`resolve` derives ``key_slots`` on the device, inside a
    captured graph too. The paged kernels read the block table directly and never resolve.
    """

    key_slots: Tensor | None  # [B, L] cache slot of every key (padded)
    ctx_lens: Tensor          # [B] keys per row (including the new token)
    block_table: Tensor | None = None   # [B, NB] int64
    block_size: int = 0
    lead_off: Tensor | None = None
    """[B] int64, a verify pass's (speculative decoding): each row's offset in its group, the consecutive
    rows of one turn (its last token, then its drafts: one block table, lengths rising by one), 0 on a
    group's first row (:func:`lead_offsets`). The paged decode kernel reads a group's keys once for all its
    rows; None: every row alone (the reference backend reads every row alone either way)."""
    group_width: int = 1
    """The most rows a group of ``lead_off`` holds (the paged kernel's ``WIDTH``: a compiled variant each)."""

    def resolve(self) -> None:
        """key_slots[b, j] = block_table[b, j // bs] * bs + j % bs (L = NB * bs); no host sync."""
        if self.block_table is None or self.key_slots is not None:
            return
        bs = self.block_size
        offs = torch.arange(bs, dtype=self.block_table.dtype, device=self.block_table.device)
        B, nb = self.block_table.shape
        self.key_slots = (self.block_table.unsqueeze(-1) * bs + offs).reshape(B, nb * bs)

    @property
    def max_keys(self) -> int:
        """Padded key length L known on the host (no device sync)."""
        if self.block_table is not None:
            return int(self.block_table.shape[1]) * self.block_size
        assert self.key_slots is not None
        return int(self.key_slots.shape[1])


def lead_offsets(widths: list[int], group_width: int) -> list[int]:
    """:attr:`DecodeMeta.lead_off` of turns of ``widths[i]`` consecutive rows each: a group every
    ``group_width`` rows at most."""
    return [j % group_width for w in widths for j in range(w)]


@dataclass(slots=True)
class PrefillMeta:
    """Device-side varlen metadata of all prefill sequences of a pass (built once per pass).

    Query tiles of ``tile_m`` rows: tile t covers rows ``tile_m[t] .. + BLOCK_M`` of sequence
    ``tile_seq[t]``, so one kernel launch covers every sequence without a host loop.
    """

    q_start: Tensor       # [S] int32 first flat row
    q_len: Tensor         # [S] int32
    ctx_len: Tensor       # [S] int32 keys after this step
    block_table: Tensor   # [S, NB] int32
    tile_seq: Tensor      # [NT] int32
    tile_m: Tensor        # [NT] int32 first query row of the tile, within its sequence
    block_m: int
    max_ctx: int
    heavy_first: bool = False   # tiles ordered by their keys, most first (PrefillPlan.heavy_first)


def heaviest_first(seqs: list[PrefillSeq], tseq: list[int], tm: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The tiles (sequence ``tseq[j]``, first token ``tm[j]``) in descending order of the keys each
    attends (``cached + min(m + block_m, q_len)``), ties in the order given."""
    def keys(j: int) -> int:
        s = seqs[tseq[j]]
        return s.ctx_len - s.q_len + min(tm[j] + block_m, s.q_len)
    order = sorted(range(len(tseq)), key=lambda j: -keys(j))
    return [tseq[j] for j in order], [tm[j] for j in order]


def slots_of_blocks(block_ids: Tensor, block_size: int, n: int) -> Tensor:
    """Cache slots of the first ``n`` positions of a sequence stored in ``block_ids``."""
    offs = torch.arange(block_size, dtype=block_ids.dtype, device=block_ids.device)
    return (block_ids.unsqueeze(-1) * block_size + offs).reshape(-1)[:n]


def blocks_of_slots(key_slots: Tensor, block_size: int) -> Tensor:
    """Block ids of a position-ordered, block-structured slot list (every ``block_size``-th slot)."""
    return torch.div(key_slots[::block_size], block_size, rounding_mode="floor")


@dataclass(slots=True)
class ForwardBatch:
    """A flat batch: prefill sequences first, then decode rows."""

    input_ids: Tensor                 # [T]
    positions: Tensor                 # [T]
    write_slots: Tensor               # [T] where each new token's KV is written
    prefill: list[PrefillSeq] = field(default_factory=list)
    decode: DecodeMeta | None = None
    logits_rows: Tensor | None = None  # [R] rows whose logits are needed
    rope: tuple[Tensor, Tensor] | None = None   # cos/sin of ``positions`` (computed once per pass)
    block_size: int = 0               # KV block size (0: unknown, the paged kernels then refuse)
    prefill_meta: PrefillMeta | None = None     # built by the paged backend on first use
    own_kv: tuple[Tensor, Tensor] | None = None
    """The pass's roped K and V [T, Hk, hd] (views of the QKV projection's output), set by the model's
    attention prologue for the layer being run when the backend's prefill reads them (TMA:
    ``TritonAttention.reads_own_kv``), None otherwise; :func:`~ainfer_pd.engine.attention.attend`
    hands them to the prefill and clears them."""
    padded: bool = False
    """Some rows may be padding (a graph bucket's, a replica's: they write the scratch slot): the
    fused router routes those nowhere (``MoETransformer.route_rows``). False: every row is real,
    and the pass pays nothing for padding."""

    cached_keys: int | None = None
    """The keys cached before the pass's prefill sequences (their ``ctx_len - q_len`` summed), counted once a
    pass by :meth:`prefill_cached_keys` (every layer's prefill plan reads it)."""

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.q_len for s in self.prefill)

    def prefill_cached_keys(self) -> int:
        if self.cached_keys is None:
            self.cached_keys = sum(s.ctx_len - s.q_len for s in self.prefill)
        return self.cached_keys

    def build_prefill_meta(self, block_m: int, heavy_first: bool = False) -> PrefillMeta:
        """Host-built varlen metadata (one host-to-device copy per pass), cached on the batch.
        ``heavy_first``: the tiles in descending order of the keys they attend (a tile of tokens
        ``m .. m + block_m`` of a sequence with ``cached`` keys before its first query attends
        ``cached + min(m + block_m, q_len)``), ties in sequence order."""
        pm = self.prefill_meta
        if pm is not None and pm.block_m == block_m and pm.heavy_first == heavy_first:
            return pm
        bs = self.block_size
        dev = self.input_ids.device
        if bs <= 0:
            raise ValueError("ForwardBatch.block_size is needed by the paged prefill kernel")
        tables, starts, qlens, ctxs, tseq, tm = [], [], [], [], [], []
        nb = max(-(-s.ctx_len // bs) for s in self.prefill)
        for i, s in enumerate(self.prefill):
            ids = s.block_ids
            if ids is None:
                assert s.key_slots is not None
                ids = blocks_of_slots(s.key_slots, bs)
            ids = ids.to("cpu", torch.int32)[:nb]
            tables.append(torch.nn.functional.pad(ids, (0, nb - ids.numel())))
            starts.append(s.q_start)
            qlens.append(s.q_len)
            ctxs.append(s.ctx_len)
            for m in range(0, s.q_len, block_m):
                tseq.append(i)
                tm.append(m)
        if heavy_first:
            tseq, tm = heaviest_first(self.prefill, tseq, tm, block_m)
        # one host-to-device copy; every part starts on a 16-byte boundary (Triton specialises
        # pointer arguments on 16-byte alignment: unaligned parts would compile new kernel variants
        # for new sequence / tile counts, ~1 s stalls inside P epochs)
        parts = [starts, qlens, ctxs, tseq, tm]
        offs, o = [], 0
        for p in parts:
            offs.append(o)
            o += -(-len(p) // 4) * 4
        host = torch.zeros(o + len(tables) * nb, dtype=torch.int32)
        for p, at in zip(parts, offs):
            host[at:at + len(p)] = torch.tensor(p, dtype=torch.int32)
        host[o:] = torch.stack(tables).reshape(-1)
        # pinned + non-blocking: enqueued on the consuming stream, no wait for its earlier work
        dv = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
        S, NT = len(starts), len(tseq)
        v = [dv[at:at + len(p)] for p, at in zip(parts, offs)]
        pm = PrefillMeta(v[0], v[1], v[2], dv[o:].view(S, nb), v[3], v[4], block_m, max(ctxs), heavy_first)
        self.prefill_meta = pm
        return pm
