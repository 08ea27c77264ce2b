"""The host-side metadata of the MTP layer's passes (:mod:`.mtp`): built on the event loop from the
turns and the KV manager, like :meth:`~ainfer_pd.engine.runtime.runner.ModelRunner.build`, and
run later on a stream.

* :func:`catch_up_batch` - after a target pass, the MTP layer over the positions whose next token
  the pass fed (or a prompt chunk knows): position p takes the target's hidden state h_p and the
  token t_{p+1}. A row group of the pass covering positions [s, e) of a turn gives MTP rows
  s - 1 .. e - 2 (s - 1 from the turn's stash, when the caller says it holds it and that row is
  not written yet), plus e - 1 when a prompt chunk that is not the last knows t_e. Tokens are
  gathered on the device from the pass's own input ids (a row the overlapped D loop feeds gets
  its token there), so nothing waits for the host.
* :func:`decode_catch_up` - the same for a pass of decode rows only (D iterations, verifies), in a
  fixed shape: one MTP row per pass row, row j at position p_j - 1 on h_{p_j - 1} (the pass's row
  j - 1 of the same turn, or the turn's stash for its first row) and the pass's own input id t_{p_j}.
  Every tensor but the first rows' stash rows and KV slots derives on the device from the pass's
  own (positions, write slots, lengths, block table), so the decode graphs capture it with the pass
  (:mod:`~ainfer_pd.engine.runtime.mtp_graphs`); a first row without a stash writes the scratch slot.
* :func:`world_chain_batches` - the same on several ranks: a fixed depth over a fixed row count,
  the rows past a job's cap and past the jobs padding (the scratch slot and block), so every rank
  runs the same collectives.
* :func:`chain_batches` - the draft chain: step j of row r at position n_r - 2 + j (n_r its
  sequence length), the rows longest-cap first so each step's rows are a prefix of the last's.

Every position written lies inside the turn's KV reservation (a verify's own positions, or below
them: the speculator's cap keeps K + 1 positions inside it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..engine.attention import DecodeMeta, ForwardBatch, PrefillSeq


@dataclass(slots=True)
class CatchUp:
    """The MTP layer's pass after one target pass (M rows, prompt chunks first, then decode rows)."""

    fb: ForwardBatch | None           # the MTP rows (None: none); ``input_ids`` is set at run time
    tok_idx: Tensor                   # [M] rows of cat(pass input ids, extra) giving each row's t_{p+1}
    extra: Tensor                     # [X] tokens the pass did not feed (a chunk's next prompt token)
    hid_idx: Tensor                   # [M] rows of cat(pass hidden states, stash rows) giving h_p
    refs: list[tuple[str, int]]       # the stash rows: (trajectory, position), read at run time
    keep_idx: Tensor                  # [K] pass rows whose hidden states are the turns' next stashes
    keeps: list[tuple[str, int, int, int]]   # (tid, a, b, p0): stash = kept[a:b], positions p0 ..
    drops: list[str]                  # trajectories whose stash goes (their next chunk needs none)


class _Rows:
    """The rows of a catch-up under construction."""

    def __init__(self, num_pass_rows: int) -> None:
        self.T = num_pass_rows
        self.tok: list[int] = []
        self.hid: list[int] = []
        self.pos: list[int] = []
        self.extra: list[int] = []
        self.refs: list[tuple[str, int]] = []

    def add(self, tid: str, p: int, s: int, q: int, e: int, next_token: int | None) -> None:
        """MTP row at position p of a group whose pass rows q.. hold positions s .. e - 1."""
        if p == s - 1:
            self.refs.append((tid, p))
            self.hid.append(self.T + len(self.refs) - 1)
        else:
            self.hid.append(q + p - s)
        if p + 1 < e:
            self.tok.append(q + p + 1 - s)
        else:
            self.extra.append(next_token)
            self.tok.append(self.T + len(self.extra) - 1)
        self.pos.append(p)


def catch_up_batch(kv, device, num_pass_rows: int, prefill, decode, ahead: list[int] | None,
                   drafts: list[list[int]] | None, has_prev: Callable[[str, int], bool]) -> CatchUp:
    """The catch-up of a pass built from ``prefill`` (turn, start, n) chunks and ``decode`` rows
    (``ahead`` / ``drafts`` as the runner's build took them); ``has_prev(tid, p)``: the turn's
    stash will hold position p when the pass runs and its MTP row is not written yet."""
    rows, bs = _Rows(num_pass_rows), kv.block_size
    seqs, writes, keep, keeps, drops = [], [], [], [], []
    q = 0
    for t, start, n in prefill:
        tid, end = t.tid, start + n
        complete = end == len(t.prompt)
        lo = start - 1 if start >= 1 and has_prev(tid, start - 1) else start
        hi = end - 1 if complete else end
        if hi > lo:
            m0 = len(rows.pos)
            for p in range(lo, hi):
                rows.add(tid, p, start, q, end, None if complete else t.prompt[end])
            writes.append(kv.slots(tid, lo, hi))
            seqs.append(PrefillSeq(m0, hi - lo, hi, block_ids=kv.block_ids(tid, hi)))
        if complete:
            keeps.append((tid, len(keep), len(keep) + 1, end - 1))
            keep.append(q + n - 1)
        else:
            drops.append(tid)
        q += n
    dec_tids, lens, slots = [], [], []
    for i, t in enumerate(decode):
        a = ahead[i] if ahead else 0
        r = 1 + (len(drafts[i]) if drafts else 0)
        tid, s = t.tid, t.seq_len + a - 1                   # the position of the pass's first row of t
        lo = s - 1 if s >= 1 and (a or has_prev(tid, s - 1)) else s
        for p in range(lo, s + r - 1):
            rows.add(tid, p, s, q, s + r, None)
            dec_tids.append(tid)
            lens.append(p + 1)
            slots.append(kv.slot_of(tid, p))
        keeps.append((tid, len(keep), len(keep) + r, s))
        keep.extend(range(q, q + r))
        q += r
    fb = None
    if rows.pos:
        meta = None
        if dec_tids:
            meta = DecodeMeta(None, torch.tensor(lens, dtype=torch.int64, device=device),
                              block_table=kv.block_table(dec_tids, -(-max(lens) // bs)).to(device), block_size=bs)
            writes.append(torch.tensor(slots, dtype=torch.int64))
        fb = ForwardBatch(input_ids=torch.empty(0, dtype=torch.int64, device=device),
                          positions=torch.tensor(rows.pos, dtype=torch.int64, device=device),
                          write_slots=torch.cat(writes).to(device), prefill=seqs, decode=meta, block_size=bs)
    return CatchUp(fb, _ids(rows.tok, device), _ids(rows.extra, device), _ids(rows.hid, device), rows.refs,
                   _ids(keep, device), keeps, drops)


@dataclass(slots=True)
class DecodeCatchUp:
    """The MTP layer's pass after a pass of decode rows only, one MTP row per pass row
    (:func:`decode_catch_up`; run by :func:`run_decode_catch_up`)."""

    first: Tensor                     # [N] bool: the row is its turn's first (its h from the stash)
    first_write: Tensor               # [N] the MTP KV slot of a first row (scratch: no stash, or not first)
    refs: list[tuple[int, str, int]]  # (row, trajectory, position): a first row's stash row, read at run time
    ref_rows: Tensor                  # [len(refs)] their rows, on the device (built here: an H2D copy on the
                                      # D stream at run time would wait for the stream to drain)
    keeps: list[tuple[str, int, int, int]]   # (tid, a, b, p0): stash = h[a:b] (pass rows), positions p0 ..

    def padded(self, n: int, scratch: int) -> tuple[Tensor, Tensor]:
        """(``first``, ``first_write``) over ``n`` pass rows: the rows past the batch's (a padded
        D batch of several ranks) are first rows writing ``scratch``."""
        m = int(self.first.shape[0])
        if m == n:
            return self.first, self.first_write
        return (torch.cat([self.first, self.first.new_ones(n - m)]),
                torch.cat([self.first_write, self.first_write.new_full((n - m,), scratch)]))


def decode_catch_up(kv, device, decode, ahead: list[int] | None, drafts: list[list[int]] | None,
                    covers: Callable[[str, int], bool], scratch: int) -> DecodeCatchUp:
    """The catch-up of a pass of ``decode`` rows only (``ahead`` / ``drafts`` as the runner's build
    took them): turn i's rows are its 1 + len(drafts[i]) pass rows from position s = seq_len + ahead
    - 1; its first MTP row (position s - 1) is real when the turn's stash will hold h_{s-1} at run
    time (``ahead``: the iteration in flight stashes it; else ``covers(tid, s - 1)``), else it
    writes ``scratch``. The turn's stash becomes its pass rows' hidden states."""
    first, fwrite, refs, keeps = [], [], [], []
    q = 0
    for i, t in enumerate(decode):
        a = ahead[i] if ahead else 0
        r = 1 + (len(drafts[i]) if drafts else 0)
        tid, s = t.tid, t.seq_len + a - 1
        real = s >= 1 and (a or covers(tid, s - 1))
        first += [True] + [False] * (r - 1)
        fwrite += [kv.slot_of(tid, s - 1) if real else scratch] + [scratch] * (r - 1)
        if real:
            refs.append((q, tid, s - 1))
        keeps.append((tid, q, q + r, s))
        q += r
    return DecodeCatchUp(torch.tensor(first, dtype=torch.bool, device=device), _ids(fwrite, device), refs,
                         _ids([j for j, _, _ in refs], device), keeps)


def decode_catch_up_batch(fb: ForwardBatch, first: Tensor, first_write: Tensor) -> ForwardBatch:
    """The MTP rows of a decode pass ``fb`` (device ops only: captured in the decode graphs): row j
    at position p_j - 1 with the pass's input id t_{p_j}, its key at ``first_write`` for a first row
    and at the pass's row j - 1's slot otherwise, its context the p_j keys before, read through the
    pass's block table (a padded row: position 0, one key, the scratch slot)."""
    d = fb.decode
    return ForwardBatch(
        input_ids=fb.input_ids, positions=(fb.positions - 1).clamp_(min=0),
        write_slots=torch.where(first, first_write, fb.write_slots.roll(1, 0)),
        decode=DecodeMeta(None, (d.ctx_lens - 1).clamp_(min=1), block_table=d.block_table, block_size=d.block_size),
        block_size=fb.block_size)


def _ids(v: list[int], device) -> Tensor:
    return torch.tensor(v, dtype=torch.int64, device=device)


def chain_batches(kv, device, jobs: list[tuple[str, int, int, int]]) -> list[ForwardBatch]:
    """The draft chain's steps for ``jobs`` = (tid, sequence length n, last token, cap), caps
    descending: step j holds the jobs whose cap exceeds j, job r at position n_r - 2 + j. Step 0's
    input ids are the last tokens; a later step's are set at run time (the step before's drafts)."""
    bs, out = kv.block_size, []
    for j in range(jobs[0][3] if jobs else 0):
        rows = [job for job in jobs if job[3] > j]
        pos = [n - 2 + j for _, n, _, _ in rows]
        lens = [p + 1 for p in pos]
        ids = [tok for _, _, tok, _ in rows] if j == 0 else [0] * len(rows)
        table = kv.block_table([tid for tid, _, _, _ in rows], -(-max(lens) // bs))
        out.append(ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            write_slots=torch.tensor([kv.slot_of(tid, p) for (tid, _, _, _), p in zip(rows, pos)],
                                     dtype=torch.int64, device=device),
            decode=DecodeMeta(None, torch.tensor(lens, dtype=torch.int64, device=device),
                              block_table=table.to(device), block_size=bs),
            block_size=bs))
    return out


def world_chain_batches(kv, device, jobs: list[tuple[str, int, int, int]], R: int, depth: int,
                        scratch_slot: int, scratch_block: int) -> list[ForwardBatch]:
    """The draft chain of several ranks: ``depth`` steps of ``R`` rows each (every rank the same:
    the MTP layer's collectives gather every replica's rows). Row r < len(jobs) is job r while
    its cap exceeds the step (at position n_r - 2 + j, as :func:`chain_batches`), every other row
    padding (position 0, one key in the scratch block, its key into the scratch slot)."""
    if len(jobs) > R:
        raise ValueError(f"{len(jobs)} chain rows over a world chain of {R}")
    bs, out = kv.block_size, []
    for j in range(depth):
        live = [r for r, job in enumerate(jobs) if job[3] > j]
        pos, slots, ids = [0] * R, [scratch_slot] * R, [0] * R
        for r in live:
            tid, n, tok, _ = jobs[r]
            pos[r] = n - 2 + j
            slots[r] = kv.slot_of(tid, pos[r])
            ids[r] = tok
        lens = [p + 1 for p in pos]
        nb = -(-max(lens) // bs) if R else 1
        table = torch.full((R, nb), scratch_block, dtype=torch.int64)
        if live:
            table[live] = kv.block_table([jobs[r][0] for r in live], nb)
        out.append(ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            write_slots=torch.tensor(slots, dtype=torch.int64, device=device),
            decode=DecodeMeta(None, torch.tensor(lens, dtype=torch.int64, device=device),
                              block_table=table.to(device), block_size=bs),
            block_size=bs))
    return out
