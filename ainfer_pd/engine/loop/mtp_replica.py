"""A replica's MTP drafter under attention TP (``spec.method: mtp``, ATP > 1): what the replica leader
sends its TP followers over the replica channel beside its batches, so every TP rank of the replica
runs the same MTP catch-ups and draft chains (same rows, positions and MTP KV slots: the TP
collectives inside the MTP layer pair up) and keeps the same stashes.

* Each D batch carries its catch-up (one broadcast with the batch, a fixed size for the agreed rows)
  and each P batch its catch-up (in the P batch's broadcast): :meth:`MtpReplica.pack_decode` /
  :meth:`MtpReplica.decode_plan`, :meth:`MtpReplica.pack_prefill` / :meth:`MtpReplica.split_prefill`
  and :meth:`MtpReplica.prefill_plan`.
* A verify round's draft chain goes before it runs (:meth:`MtpReplica.share_chain`); a follower
  runs it on its mirror (:meth:`MtpReplica.follow_chain`).
* The stashes the leader forgets (a release, a rollback) go at the next step: the leader announces
  how many in its :class:`~ainfer_pd.sched.step.StepInputs` (:meth:`MtpReplica.stash_drops`) and
  sends their keys right after the step's rendezvous (:meth:`MtpReplica.drop_stashes`, every step,
  the last one included), so a follower's mirror holds what its leader's drafter holds.

The follower's drafter (:class:`~ainfer_pd.spec.mtp.MtpDrafter`) is the mirror: its stashes under the
leader's stash keys (:class:`~ainfer_pd.spec.stash_keys.StashKeys`). Every wait is the channel's:
bounded, naming the leader (or, on the leader, its followers).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..runtime.mtp_runner import MtpPlan
from ..runtime.mtp_wire import (chain_numel, decode_catch_up_numel, join, pack_chain, pack_decode_catch_up,
                                pack_prefill_catch_up, split, unpack_chain, unpack_decode_catch_up,
                                unpack_prefill_catch_up)
from ..runtime.replica import ReplicaChannel
from ..runtime.runner import BatchPlan


class MtpReplica:
    """The MTP side of one rank's replica channel (module docstring). ``drafter``: this rank's (the
    leader's drafter, or a follower's mirror); ``width``: the broadcast's block-table width."""

    def __init__(self, channel: ReplicaChannel, drafter, device: torch.device, block_size: int, width: int) -> None:
        self.channel, self.drafter = channel, drafter
        self.device, self.block_size, self.width = device, block_size, width

    # ------------------------------------------------------------------ D: a batch's catch-up
    @staticmethod
    def decode_numel(rows: int) -> int:
        """The entries a D batch of ``rows`` agreed rows adds to its broadcast."""
        return decode_catch_up_numel(rows)

    def pack_decode(self, plan: MtpPlan, rows: int) -> Tensor:
        """The leader's: ``plan``'s catch-up, for a D batch of ``rows`` agreed rows."""
        return pack_decode_catch_up(plan.catch_up, self.drafter.keys.of, rows)

    def decode_plan(self, plan: BatchPlan, buf: Tensor, rows: int) -> MtpPlan:
        """A follower's: its leader's D batch ``plan`` with the catch-up in ``buf``."""
        return MtpPlan.of(plan, unpack_decode_catch_up(buf, rows, self.device))

    # ------------------------------------------------------------------ P: a batch's catch-up
    def pack_prefill(self, plan: MtpPlan, batch: Tensor) -> Tensor:
        """The leader's: the packed P ``batch`` and ``plan``'s catch-up, in one payload."""
        return join([batch, pack_prefill_catch_up(plan.catch_up, self.drafter.keys.of)])

    @staticmethod
    def split_prefill(buf: Tensor) -> tuple[Tensor, Tensor]:
        """A follower's: :meth:`pack_prefill`'s payload as (the packed P batch, its catch-up)."""
        batch, cu = split(buf)
        return batch, cu

    def prefill_plan(self, plan: BatchPlan, buf: Tensor) -> MtpPlan:
        """A follower's: its leader's P batch ``plan`` with the catch-up in ``buf``."""
        return MtpPlan.of(plan, unpack_prefill_catch_up(buf, self.device, self.block_size))

    # ------------------------------------------------------------------ the draft chain of a verify round
    async def share_chain(self, steps: list, refs: list[tuple[str, int]]) -> None:
        """The leader's chain (every step the agreed rows), sent before it runs."""
        rows = int(steps[0].positions.shape[0])
        await self.channel.share(pack_chain(steps, refs, self.drafter.keys.of, rows, self.width),
                                 chain_numel(rows, len(steps), self.width), "MTP draft chain")

    async def follow_chain(self, rows: int, depth: int) -> None:
        """A follower's: its leader's chain of ``depth`` steps over ``rows`` rows, run on its mirror
        (one D stream item, as the leader's)."""
        buf = await self.channel.share(None, chain_numel(rows, depth, self.width), "MTP draft chain")
        await self.drafter.run_chain(*unpack_chain(buf, rows, depth, self.width, self.device, self.block_size))

    # ------------------------------------------------------------------ forgotten stashes
    def stash_drops(self) -> int:
        """What this rank announces at a step: the stashes a leader forgot since it last did (0 on
        a follower)."""
        return len(self.drafter.keys.dropped) if self.channel.is_leader else 0

    async def drop_stashes(self, states: list) -> None:
        """Right after a step's rendezvous (``states``: every rank's inputs, in rank order): the keys
        the leader announced go to its followers, which drop them from their mirrors."""
        n = states[self.channel.leader].stash_drops
        if not n:
            return
        if self.channel.is_leader:
            await self.channel.share(torch.tensor(self.drafter.keys.take(n), dtype=torch.int64), n, "MTP stash drops")
        else:
            self.drafter.drop((await self.channel.share(None, n, "MTP stash drops")).tolist())
