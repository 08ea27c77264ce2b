"""Greedy drafts from the model's MTP layer (``spec.method: mtp``; the layer:
:mod:`ainfer_pd.engine.model.mtp_layer`).

The MTP layer at position i takes the target's hidden state h_i and the token t_{i+1} and predicts
t_{i+2}; it has its own KV (one more layer of the paged pool). Two kinds of pass run it, as vLLM's
MTP proposer does (one layer, ``num_nextn_predict_layers`` = 1, chained for K > 1):

* **catch-up**, after every target pass on the same stream item (P epochs, D iterations, mixed
  steps: :class:`~ainfer_pd.engine.runtime.mtp_runner.MtpRunner`): the MTP layer over every position
  of the pass whose next token is known then, filling its KV with the target's real hidden states
  (:func:`~.mtp_batch.catch_up_batch`; a pass of decode rows only, in the fixed shape the decode
  graphs capture with it: :func:`~.mtp_batch.decode_catch_up`, :func:`decode_mtp_pass`). A turn's
  last hidden states (whose next token the pass samples) stay behind as its **stash**: the hidden
  states of the pass's rows of that turn (a verify keeps all K + 1: which one is real is known only
  once the verify is read).
* **draft chain** (:meth:`MtpDrafter.prepare`, its own D stream item before a verify is built): a
  row of sequence length n runs the layer at position n - 2 on its stash row h_{n-2} and its last
  token t_{n-1} (a real entry of the MTP KV), argmax -> draft 1; then step j at n - 2 + j on the
  layer's own output and draft j -> draft j + 1 (speculative entries, overwritten by the next
  catch-up), up to the row's cap. Drafts are a point mass: verification
  (:mod:`.verify`) keeps greedy and seeded outputs exactly those of plain decoding.

Draft quality is all that depends on the MTP state: a turn without a matching stash (a prefix served
from the cache, a rollback) drafts nothing until its next pass, and positions never caught up (a
cached prefix) are read as they are. A stash is kept per trajectory (its next turn's first chunk
starts where the last pass stopped) and goes when the trajectory is released.

Threads: built (``catch_up_for``, ``prepare``'s metadata) on the event loop; the catch-up runs on
the stream of its pass (P or D), the chain on D. A turn is in one pass at a time, so the stash of a
trajectory is written by one stream item while nothing else reads it.

Under attention TP a replica leader's catch-ups and chains travel to its TP followers
(:mod:`ainfer_pd.engine.runtime.mtp_wire`), their trajectories named by stash keys (:attr:`MtpDrafter.keys`);
a follower's drafter is the mirror: the same stashes under those keys, written and read by the same
code. A catch-up keeps the new stashes before the MTP layer runs: a follower's stash is then written
before its leader's pass can complete (the layer's collectives need the follower), so the next pass
that reads it, built by the leader after that, finds it on the follower too, whichever stream runs it.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.attention import ForwardBatch
from ..engine.model.model import SegmentState
from ..engine.model.mtp_layer import mtp_attention, mtp_forward, mtp_logits, mtp_rest
from .mtp_batch import (CatchUp, DecodeCatchUp, catch_up_batch, chain_batches, decode_catch_up, decode_catch_up_batch,
                        world_chain_batches)
from .stash_keys import StashKeys

log = logging.getLogger("ainfer_pd.spec")

DRAFT_ITEM = {"phase": "D", "kind": "draft"}


@dataclass(slots=True)
class Stash:
    """A trajectory's last target hidden states: ``h`` [m, D] of positions p0 .. p0 + m - 1."""

    h: Tensor
    p0: int

    def covers(self, p: int) -> bool:
        return self.p0 <= p < self.p0 + self.h.shape[0]

    def row(self, p: int) -> Tensor:
        return self.h[p - self.p0:p - self.p0 + 1]


def decode_mtp_pass(model, fb: ForwardBatch, h: Tensor, first: Tensor, first_write: Tensor, prev: Tensor,
                    kv: Tensor, hooks=None) -> None:
    """The catch-up of a decode pass ``fb`` in its fixed shape (device ops only: the decode graphs
    capture it after the pass): MTP row j on h_{p_j - 1}, the turn's stash row ``prev[j]`` for a
    first row, the pass's own row j - 1 (``h`` [N, D]) otherwise (:func:`~.mtp_batch.decode_catch_up_batch`)."""
    hid = torch.where(first[:, None], prev, h.roll(1, 0))
    mtp_forward(model, decode_catch_up_batch(fb, first, first_write), hid, kv, hooks)


@dataclass(slots=True)
class PendingCatchUp:
    """A P pass's catch-up between its MTP attention and the rest of the layer
    (:meth:`MtpDrafter.begin_catch_up`): the MTP rows' batch, the layer's input, the attention output
    (this rank's heads) and how many MTP rows it has."""

    fb: ForwardBatch
    pre: SegmentState
    o: Tensor
    rows: int


def _no_rows(fb: ForwardBatch) -> ForwardBatch:
    """A pass of no rows (several ranks: the MTP layer's collectives with the other ranks')."""
    z = fb.input_ids[:0]
    return ForwardBatch(z, z, z, [], None, None, block_size=fb.block_size)


class MtpDrafter:
    """The MTP drafts of one rank's engine, over the runner's model and KV (the drafter interface
    of :class:`~.speculator.Speculator`: ``prepare`` / ``draft`` / ``extend`` / ``forget``). On a TP
    follower it is its leader's mirror: stashes keyed by the leader's stash keys, passes as they come."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.ctx = None
        """The D phase context the chain runs on (set by ``spec.make.make_speculator``)."""
        self.stash: dict[str | int, Stash] = {}
        """Trajectory id -> its stash; on a TP follower, stash key -> its leader's stash of that key."""
        self.keys = StashKeys()
        """A replica leader's stash keys (used only when its stashes travel to TP followers)."""
        self.written: dict[str, int] = {}     # tid -> the position a draft chain's first step wrote
        self.ready: dict[str, list[int]] = {}  # the drafts of the last prepare
        self.num_chains = 0
        self.num_catch_up_rows = 0
        self.num_missing = 0
        """Stash rows a pass expected and did not find (a zero row served; only the drafts suffer)."""

    # ------------------------------------------------------------------ catch-up (the runner's passes)
    def catch_up_for(self, num_pass_rows: int, prefill, decode, ahead, drafts) -> CatchUp | DecodeCatchUp:
        """The catch-up of a pass being built (on the event loop, with the pass's metadata): a pass
        of decode rows only takes the fixed shape (:func:`~.mtp_batch.decode_catch_up`)."""
        r = self.runner
        if not prefill:                 # (no rows either: an empty pass, which several ranks still run)
            return decode_catch_up(r.kv, r.device, decode, ahead, drafts, self._covers, r.scratch_slot)
        return catch_up_batch(r.kv, r.device, num_pass_rows, prefill, decode, ahead, drafts, self._has_prev)

    def _covers(self, tid: str, p: int) -> bool:
        st = self.stash.get(tid)
        return st is not None and st.covers(p)

    def _has_prev(self, tid: str, p: int) -> bool:
        return self._covers(tid, p) and self.written.get(tid) != p

    def catch_up(self, cu: CatchUp | DecodeCatchUp, fb: ForwardBatch, h: Tensor, hooks=None) -> None:
        """Run ``cu`` after its target pass ``fb`` (on the pass's stream): ``h`` [T, D] its last
        layer's outputs; then the turns' new stashes. ``hooks``: the pass's phase hooks on several
        ranks (the MTP layer's collectives join every rank's: a pass without MTP rows, an empty P
        pass or a padded D batch, still runs the layer), None on one rank."""
        if type(cu) is DecodeCatchUp and fb.decode is not None:
            model, kv = self.runner.model, self.mtp_kv()
            first, first_write = cu.padded(int(h.shape[0]), self.runner.scratch_slot)
            prev = torch.zeros_like(h)
            self.fill_first_rows(cu, prev)
            self.keep(cu, h)                    # before the layer's collectives (module docstring)
            decode_mtp_pass(model, fb, h, first, first_write, prev, kv, hooks)
            self.num_catch_up_rows += int(h.shape[0])
            return
        pend = self.begin_catch_up(cu, fb, h, hooks)
        if pend is not None:
            reduce = hooks.attn_reduce if hooks is not None else None
            self.end_catch_up(pend, pend.o if reduce is None else reduce(pend.o), hooks)

    def begin_catch_up(self, cu: CatchUp | DecodeCatchUp, fb: ForwardBatch, h: Tensor, hooks=None) -> "PendingCatchUp | None":
        """A P pass's catch-up up to the MTP layer's attention (the turns' new stashes kept first,
        the stashes it forgets dropped): its attention output, a partial sum under attention TP,
        reduced by the caller before :meth:`end_catch_up` (a P walk routes that all-reduce by the
        ordering). None where no MTP layer runs: one rank and no MTP row."""
        if type(cu) is DecodeCatchUp:           # an empty pass (no rows at all)
            return None if hooks is None else PendingCatchUp(fb, *mtp_attention(self.runner.model, fb, h, self.mtp_kv()), 0)
        ids = fb.input_ids
        src = None
        if cu.fb is not None:
            stashed = [self._stash_row(tid, p) for tid, p in cu.refs]
            src = (torch.cat([h, *stashed]) if stashed else h).index_select(0, cu.hid_idx)
        for tid in cu.drops:
            self.stash.pop(tid, None)
        if cu.keeps:                                         # before the layer's collectives (module docstring)
            kept = h.index_select(0, cu.keep_idx)            # a copy: the pass's [T, D] is not held
            for tid, a, b, p0 in cu.keeps:
                self.stash[tid] = Stash(kept[a:b], p0)
                self.written.pop(tid, None)                  # the chain's first row was this pass's s - 1
        if src is not None:
            toks = torch.cat([ids, cu.extra]) if cu.extra.numel() else ids
            cu.fb.input_ids = toks.index_select(0, cu.tok_idx)
            mfb, rows = cu.fb, int(cu.hid_idx.shape[0])
        elif hooks is not None:                  # no MTP row here; the other ranks' may have some
            mfb, src, rows = _no_rows(fb), h[:0], 0
        else:
            return None
        pre, o = mtp_attention(self.runner.model, mfb, src, self.mtp_kv())
        return PendingCatchUp(mfb, pre, o, rows)

    def end_catch_up(self, pend: "PendingCatchUp", o: Tensor, hooks=None) -> None:
        """The rest of :meth:`begin_catch_up`'s MTP layer, on its attention output ``o`` reduced."""
        mtp_rest(self.runner.model, pend.fb, pend.pre, o, hooks)
        self.num_catch_up_rows += pend.rows

    def fill_first_rows(self, cu: DecodeCatchUp, prev: Tensor) -> None:
        """Rows of ``prev`` [>= N, D]: each real first row's stash row h_{s-1} (on the pass's stream)."""
        if cu.refs:
            prev.index_copy_(0, cu.ref_rows, torch.cat([self._stash_row(tid, p) for _, tid, p in cu.refs]))

    def keep(self, cu: DecodeCatchUp, h: Tensor) -> None:
        """The turns' new stashes after a decode pass: their rows of ``h`` (copied: ``h`` may be a
        graph's static output, overwritten by the next replay)."""
        n = cu.keeps[-1][2] if cu.keeps else 0
        kept = h[:n].clone()
        for tid, a, b, p0 in cu.keeps:
            self.stash[tid] = Stash(kept[a:b], p0)
            self.written.pop(tid, None)

    # ------------------------------------------------------------------ drafts (the speculator's)
    async def prepare(self, rows: list, caps: list[int], world: tuple[int, int] | None = None,
                      share: Callable[[list[ForwardBatch], list[tuple[str, int]]], Awaitable[None]] | None = None
                      ) -> None:
        """Draft every row of ``rows`` with a stash row for position n - 2 up to its cap (``caps``),
        as one D stream item; :meth:`draft` then gives them. ``world`` = (R, depth), several ranks:
        the chain's collectives join every rank's, so every rank runs ``depth`` steps over R rows
        (its jobs, then padding: :func:`~.mtp_batch.world_chain_batches`), drafting or not.
        ``share`` (a replica leader under attention TP): sends the chain's steps and stash rows to
        the TP followers first, which run it too (:meth:`run_chain`)."""
        self.ready = {}
        jobs = []
        for t, c in zip(rows, caps):
            st = self.stash.get(t.tid)
            if c > 0 and t.seq_len >= 2 and st is not None and st.covers(t.seq_len - 2):
                jobs.append((t.tid, t.seq_len, t.out_tokens[-1], c))
        if not jobs and world is None:
            return
        jobs.sort(key=lambda j: -j[3])
        r = self.runner
        if world is None:
            steps = chain_batches(r.kv, r.device, jobs)
        else:
            steps = world_chain_batches(r.kv, r.device, jobs, *world, r.scratch_slot, r.scratch_block)
        refs = [(tid, n - 2) for tid, n, _, _ in jobs]
        if share is not None:
            await share(steps, refs)
        host = await self.run_chain(steps, refs)
        for (tid, n, _, c), row in zip(jobs, host.tolist()):
            self.ready[tid] = row[:c]
            self.written[tid] = n - 2

    async def run_chain(self, steps: list[ForwardBatch], refs: list[tuple[str | int, int]]) -> Tensor:
        """The draft chain ``steps`` as one D stream item, its first step on the stash rows
        ``refs``: [len(refs), K] drafts on the host (a TP follower runs its leader's this way)."""
        w = self.ctx.stream.submit(self._chain, steps, refs, label="D.mtp_draft", attrs=DRAFT_ITEM)
        host = await w.done()
        self.num_chains += 1
        return host

    def _chain(self, steps, refs: list[tuple[str, int]]) -> Tensor:
        """The draft chain on the D stream: [R, K] drafts (-1 past a row's cap) copied to the host
        (the refs' rows; a world chain's padding rows start from zeros)."""
        model, kv, hooks = self.runner.model, self.mtp_kv(), self.ctx.comm.hooks
        rows = [self._stash_row(tid, p) for tid, p in refs]
        R = int(steps[0].positions.shape[0]) if steps else len(refs)
        if R > len(rows):
            D = model.cfg.hidden_size
            rows.append(torch.zeros(R - len(rows), D, dtype=model.embed.dtype, device=self.runner.device))
        h = torch.cat(rows)
        out = []
        for j, fb in enumerate(steps):
            m = fb.positions.shape[0]
            if j:
                fb.input_ids, h = out[-1][:m], h[:m]
            h = mtp_forward(model, fb, h, kv, hooks)
            out.append(mtp_logits(model, h).argmax(dim=-1))
        toks = torch.full((len(refs), len(steps)), -1, dtype=torch.int64, device=h.device)
        for j, d in enumerate(out):
            n = min(int(d.shape[0]), len(refs))
            toks[:n, j] = d[:n]
        if toks.is_cuda:                                     # read after the item completed
            host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            return host.copy_(toks, non_blocking=True)
        return toks

    def draft(self, tid: str, k: int) -> list[int]:
        """The drafts :meth:`prepare` computed for ``tid`` (at most ``k``; none if it had none)."""
        return self.ready.get(tid, [])[:k]

    def extend(self, tid: str, tokens, group: str = "") -> None:
        """The MTP layer reads the target's hidden states, not the token history: nothing to keep."""

    def forget(self, tid: str) -> None:
        """The trajectory was released (or rolled back): its stash and drafts go (on TP followers
        too: its stash key is dropped at the next step)."""
        self.stash.pop(tid, None)
        self.written.pop(tid, None)
        self.ready.pop(tid, None)
        self.keys.forget(tid)

    def release(self, tid: str) -> None:
        """The trajectory was released: as :meth:`forget` (a stash serves its own row only)."""
        self.forget(tid)

    def drop(self, keys: list[int]) -> None:
        """A TP follower: its leader forgot the stashes of these keys."""
        for key in keys:
            self.stash.pop(key, None)

    def clear(self) -> None:
        """Every stash goes (the KV pool was released: the MTP layer's KV with it)."""
        self.stash.clear()
        self.written.clear()
        self.ready.clear()
        self.keys.forget_all()

    # ------------------------------------------------------------------ internals
    def mtp_kv(self) -> Tensor:
        return self.runner.kv_cache[self.runner.model.cfg.num_layers]

    def _stash_row(self, tid: str, p: int) -> Tensor:
        """Row p of ``tid``'s stash [1, D]; a zero row (counted) if it is not there."""
        st = self.stash.get(tid)
        if st is None or not st.covers(p):
            self.num_missing += 1
            log.warning("MTP: no stashed hidden state of %r at position %d (its drafts only suffer)", tid, p)
            D = self.runner.model.cfg.hidden_size
            return torch.zeros(1, D, dtype=self.runner.model.embed.dtype, device=self.runner.device)
        row = st.row(p)
        if row.is_cuda:                 # made on another stream (a P epoch): keep its memory until this one used it
            st.h.record_stream(torch.cuda.current_stream())
        return row
