"""What one rank of a multi-rank worker adds to the engine (any g, ATP, ADP; EP = g).

Ranks are grouped into attention-DP replicas of ATP ranks (:mod:`ainfer_pd.comm.topology`). A
replica's leader owns its requests; its TP followers hold the other head shards
(:mod:`~ainfer_pd.engine.runtime.tensor_parallel`) and run the same segments on the leader's batches
(:mod:`~ainfer_pd.engine.runtime.replica`: one broadcast per D iteration, two per P epoch). Experts are
spread over every rank, so every expert exchange and every D collective needs every rank, in the
same order: the engine's step (:mod:`ainfer_pd.sched.step`) is agreed over the control rendezvous,
a replica with nothing to prefill runs the epoch with an empty batch, and every replica's D batch
is padded to the agreed row count (D's collectives gather every replica's rows); a drafting
iteration's K and positions (rows plus drafts) are agreed at the iteration (:meth:`DistRanks.agree_verify`),
and the verify cost table every rank measured at start is agreed once (:meth:`DistRanks.agree_costs`).
Under ``spec.method: mtp`` with attention TP each batch's MTP catch-up, a verify round's draft chain
and the stashes a leader forgot travel to its TP followers too (:class:`~.mtp_replica.MtpReplica`).

``parallel.ordering`` routes P's attention all-reduce (:func:`~ainfer_pd.comm.ordering.collective_stream`):
under ``selective`` a registered one goes onto the D stream behind the D launch of the round that
granted it. A :class:`~ainfer_pd.comm.watchdog.Watchdog` turns a device-progress stall into a
:class:`~ainfer_pd.errors.StallError` naming the cross-rank frontier; a failure after a peer died
is raised as :class:`~ainfer_pd.errors.PeerLostError` naming it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging

import torch

from ...comm.collectives import RankCollectives
from ...comm.ordering import P_ATP_ALL_REDUCE, collective_stream
from ...comm.topology import ATTN_DP_D, ATTN_TP_D, CONTROL, REPLICA, Topology
from ...comm.watchdog import Watchdog
from ...errors import PeerLostError, StallError
from ...spec.verify_shape import DraftOffer, positions_at, verify_counts, world_k
from ...spec.world_costs import world_times
from ..runtime.replica import ReplicaChannel, decode_numel, pack_decode, pack_prefill, pad_decode, unpack_decode, unpack_prefill
from ..runtime.runner import BatchPlan
from ..runtime.tensor_parallel import DecodeHooks, PrefillHooks
from .device_watch import frontier
from .mtp_replica import MtpReplica

log = logging.getLogger("ainfer_pd.lockstep")
_instances = itertools.count()


class DistRanks:
    """The multi-rank parts of one rank's engine: its phase-owned collectives, the replica
    channel to its TP followers, the watchdog, D's padded batch and collectives, P's attention
    all-reduce, the ownership audit. Built before the engine; :meth:`install` runs inside the
    engine's construction (before decode graphs are captured: they bind the phase hooks)."""

    def __init__(self, cfg, recorder, *, topology: Topology, groups: dict, backend: str, rendezvous,
                 dispatchers=None, store=None) -> None:
        topo = self.topology = topology
        self.rec = recorder
        self.rank, self.world_size, self.is_leader = topo.rank, topo.world_size, topo.is_replica_leader
        self.ordering = cfg.parallel.ordering
        self.colls = RankCollectives(topo, groups, backend=backend, recorder=recorder)   # one per phase
        self.colls.set_booking(False)                # warm-up passes and graph captures are not traced
        self.dispatchers = dispatchers
        self.rdv = rendezvous
        self.control = groups.get(CONTROL)       # gloo, every rank: the start-up agreements (agree_costs)
        self.store = store
        self.replica = None
        if topo.atp > 1:
            self.replica = ReplicaChannel(groups[REPLICA], rank=topo.rank, leader=topo.replica_leader,
                                          members=topo.tp_group, timeout_s=cfg.parallel.rendezvous_timeout_s)
        self.group_backends: dict[str, str] = {}
        """Process group name -> backend (set by :func:`~ainfer_pd.engine.make.make_engine`)."""
        self.owned_rendezvous = None  # the control rendezvous make_engine created (closed by aclose)
        self.rows_agreed = 0          # the padded rows of every replica's D batch at this step
        self.world_rows = 0           # the most decode rows any rank announced at the last step
        self.spec_cfg = None          # the spec section and the world's verify cost table (use_spec)
        self.spec_costs = None
        # the block-table width of every D broadcast (the widest a row can need, plus the scratch)
        self.table_width = -(-cfg.model.max_context_len // cfg.cache.block_size) + 1
        self.stall_s = cfg.parallel.stall_timeout_s
        self.engine = None
        self.watchdog: Watchdog | None = None
        self.decode_hooks: DecodeHooks | None = None
        self.mtp: MtpReplica | None = None
        """The MTP drafter's catch-ups, chains and stash drops in the replica broadcast
        (``spec.method: mtp`` under attention TP: :mod:`.mtp_replica`); None otherwise."""

    @property
    def tp_shard(self) -> tuple[int, int] | None:
        """(tp_rank, ATP): the shard of the attention heads this rank keeps."""
        t = self.topology
        return (t.tp_rank, t.atp) if t.atp > 1 else None

    def install(self, eng) -> None:
        """Inside the engine's construction, before graph capture: the phase hooks the graphs bind."""
        from ..runtime.expert_parallel import ExpertParallel
        r = eng.runner
        if self.dispatchers is not None:
            r.ep = ExpertParallel(r.model, self.dispatchers, eng.device)
        self.decode_hooks = DecodeHooks(self.colls.D, r.model, r.ep, eng.decode_ctx)
        if self.replica is not None and eng.cfg.spec.mtp:
            self.mtp = MtpReplica(self.replica, r.drafter, eng.device.torch_device, eng.kv.block_size, self.table_width)
        for ctx, colls, hooks in ((eng.prefill_ctx, self.colls.P, PrefillHooks(self.colls.P, r.ep, eng.prefill_ctx)),
                                  (eng.decode_ctx, self.colls.D, self.decode_hooks)):
            ctx.comm.install(colls, None if self.dispatchers is None else self.dispatchers.get(ctx), hooks.hooks())

    def attach(self, eng) -> None:
        """After the engine's construction: trace the collectives, gate them, watch the engine."""
        self.engine = eng
        self.rdv = eng.rendezvous                    # (wrapped by fault injection when configured)
        self.colls.set_booking(True)
        self.colls.set_device(eng.device)        # its collective residency (and what it makes conflict)
        t = self.topology
        self.watchdog = Watchdog(rank=t.rank, world_size=t.world_size, stall_s=self.stall_s,
                                 progress=self._progress_key, probe=self._frontier, store=self.store,
                                 prefix=f"ainfer_pd/engine/{next(_instances)}", busy=self._device_busy)

    # ------------------------------------------------------------------ watchdog
    def _progress_key(self) -> tuple:
        e = self.engine
        return (sum(s.num_done for s in e.device.streams.values()), self.colls.progress(), e.book.num_finished)

    def _device_busy(self) -> bool:
        return any(s.num_pending for s in self.engine.device.streams.values())

    def _frontier(self) -> dict:
        return {**frontier(self.engine), "colls": self.colls.frontier()}

    async def explain(self, exc: BaseException) -> BaseException:
        """A failure of this rank's loops: a stall stays a stall; after a peer died, name it."""
        if isinstance(exc, StallError) or not isinstance(exc, Exception):
            return exc
        await asyncio.sleep(1.2)                      # let a dead peer's heartbeat go stale
        lost = self.watchdog.unresponsive(stale_s=1.0)
        if not lost:
            return exc
        names = ", ".join(f"rank {r}" for r in lost)
        return PeerLostError(f"rank {self.rank}: peer {names} died or stopped responding (no heartbeat for > 1 s); "
                             f"this rank failed with {type(exc).__name__}: {exc}", ranks=tuple(lost))

    async def aclose(self) -> None:
        """Close the control rendezvous this engine created (its thread would otherwise outlive
        the worker; one given by the caller stays theirs) and the replica channel."""
        if self.replica is not None:
            self.replica.close()
        rdv, self.owned_rendezvous = self.owned_rendezvous, None
        close = getattr(rdv, "close", None)
        if close is not None:
            await close()

    # ------------------------------------------------------------------ D
    def padded_rows(self, rows: int, graphs) -> int:
        """Every replica's D batch size: the largest announced, up to the graph bucket (on CUDA
        the replay and the eager path then gather the same shapes everywhere), a multiple of ATP
        (D's attention reduce-scatter gives each TP rank an equal share; D's DP-attention
        all-gather, equal shares of every replica)."""
        atp = self.topology.atp
        if graphs is not None:
            fit = [b for b in graphs.batch_sizes if b >= rows and b % atp == 0]
            if fit:
                return fit[0]
        return -(-rows // atp) * atp

    def agree_rows(self, d_rows: int, graphs) -> None:
        """A step's decision: every replica's D batch is ``d_rows`` (the most any rank announced),
        padded (:meth:`padded_rows`); the unpadded count is what a verify iteration's K is chosen
        at (:attr:`world_rows`: the size the world runs, not this replica's)."""
        self.world_rows = d_rows
        self.rows_agreed = self.padded_rows(d_rows, graphs)

    def agree_costs(self, times: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
        """At start, inside the engine's construction (no rendezvous round runs yet): every rank's
        measured verify cost table gathered over the control group, the world's returned
        (:func:`~ainfer_pd.spec.world_costs.world_times`: each entry the most any rank measured), so
        every replica leader chooses K from one table. Blocking; every rank calls it once."""
        import torch.distributed as tdist
        tables: list = [None] * self.world_size
        tdist.all_gather_object(tables, times, group=self.control)
        return world_times(tables)

    def use_spec(self, spec_cfg, costs) -> None:
        """Speculation is on: its config section and the world's verify cost table (the same on
        every rank: the config's, or agreed by :meth:`agree_costs`), which :meth:`agree_verify` reads."""
        self.spec_cfg, self.spec_costs = spec_cfg, costs

    def plain_offer(self, rows: int) -> DraftOffer:
        """The offer of ``rows`` without drafts (a TP follower: 0)."""
        return DraftOffer.plain(rows, self.spec_cfg.num_draft_tokens)

    async def agree_verify(self, mine: DraftOffer, epoch: int) -> int:
        """A drafting iteration's K and shape (:mod:`~ainfer_pd.spec.verify_shape`): this rank
        announces its offer, every rank computes the world's K from every offer and pads its D
        batch to the most positions any rank has at K (:attr:`rows_agreed`); a leader counts what
        the agreement cost it (``verify_sync_s``: the rendezvous' wait, on every rank). Returns K."""
        sc = self.spec_cfg
        t0 = self.rec.now()
        states = await self.rdv.arrive("verify", mine.to_payload(), epoch=epoch)
        self.rec.sample("verify_sync_s", self.rec.now() - t0)
        offers = [DraftOffer.from_payload(s, sc.num_draft_tokens) for s in states]
        k = world_k(self.spec_costs, offers, adaptive=sc.adaptive)
        self.rows_agreed = self.padded_rows(positions_at(offers, k), self.engine.runner.graphs)
        if self.is_leader:
            for name, n in verify_counts(mine, offers, k, self.rows_agreed).items():
                self.rec.count(name, n)
        return k

    async def decode_plan(self, rows: list, drafts: list[list[int]] | None = None) -> BatchPlan:
        """This replica's D batch (a verify batch with ``drafts``: row i feeds 1 + len(drafts[i])
        positions); under DP attention or ATP > 1 padded to the agreed rows (the followers'
        broadcast has that size: drafts and padding included, a follower runs it as it comes) and
        shared with the TP followers."""
        e = self.engine
        B, r, width = self.rows_agreed, e.runner, self.table_width
        n = decode_numel(B, width)
        mtp = self.mtp                                  # the D batch's catch-up travels with it
        numel = n + (mtp.decode_numel(B) if mtp is not None else 0)
        if not self.is_leader:
            buf = await self.replica.share(None, numel, "D batch")
            plan = BatchPlan(unpack_decode(buf[:n], B, width, e.device.torch_device, e.kv.block_size), [], [], [])
            return mtp.decode_plan(plan, buf[n:], B) if mtp is not None else plan
        plan = r.build([], rows, drafts=drafts)
        if self.replica is None and not self.decode_hooks.dp:
            return plan                  # ATP = 1 and no DP-attention gather: D's dispatcher takes any row count
        # the DP-attention all-gather / reduce-scatter (attn_dp.D) need every replica at the agreed rows
        fb = pad_decode(plan.fb, B, r.scratch_slot, r.scratch_block)
        if self.replica is not None:
            payload = pack_decode(fb, width)
            if mtp is not None:
                payload = torch.cat([payload, mtp.pack_decode(plan, B)])
            await self.replica.share(payload, numel, "D batch")
        return dataclasses.replace(plan, fb=fb)        # (an MTP plan keeps its catch-up, padded when it runs)

    def book_chain(self, depth: int, rnd) -> None:
        """The MTP draft chain's collectives in host order (``depth`` passes of the MTP layer), before
        its D stream item is submitted at a verify round (``rnd``: the turnstile round it runs in)."""
        h = self.decode_hooks
        self.colls.D.enqueue_schedule(h.layer_schedule(len(h.model.layers) - 1) * depth, stream="D",
                                      epoch=rnd.epoch if rnd is not None else None,
                                      boundary=rnd.boundary if rnd is not None else None)

    def before_d_launch(self, rnd) -> None:
        """D's collectives in host order, with the round that orders them (trace-check's G)."""
        self.colls.D.enqueue_schedule(self.decode_hooks.schedule(), stream="D",
                                      epoch=rnd.epoch if rnd is not None else None,
                                      boundary=rnd.boundary if rnd is not None else None)

    def d_iteration_done(self) -> None:
        self.colls.D.complete_pending(ATTN_TP_D)     # a graph replay ran them without host callbacks
        self.colls.D.complete_pending(ATTN_DP_D)

    # ------------------------------------------------------------------ P
    async def share_prefill(self, plan: BatchPlan | None) -> BatchPlan:
        """A replica's P batch: the leader sends ``plan`` (and its MTP catch-up, under ``mtp``); a
        follower receives its leader's."""
        mtp = self.mtp
        if plan is not None:
            payload = pack_prefill(plan.fb)
            await self.replica.share(payload if mtp is None else mtp.pack_prefill(plan, payload), None, "P batch")
            return plan
        buf = await self.replica.share(None, None, "P batch")
        batch, cu = mtp.split_prefill(buf) if mtp is not None else (buf, None)
        e = self.engine
        plan = BatchPlan(unpack_prefill(batch, e.device.torch_device, e.kv.block_size), [], [], [])
        return mtp.prefill_plan(plan, cu) if mtp is not None else plan

    def p_all_reduce_hook(self, device, delay_s: float):
        """P's attention all-reduce of one layer (attention TP; None without), on the stream the
        ordering gives it (selective: a registered one on the D stream, behind the D launch of the
        round that granted it)."""
        if self.topology.atp <= 1:
            return None

        def all_reduce(tensor, *, after, epoch: int, boundary: int, gated: bool):
            stream = collective_stream(self.ordering, P_ATP_ALL_REDUCE, self.colls.registry)
            return self.colls.P.launch(P_ATP_ALL_REDUCE, tensor, device=device, stream=stream, epoch=epoch,
                                       boundary=boundary, deps=(after,) if stream != "P" else (),
                                       delay_s=delay_s, extra={"gated": gated})
        return all_reduce

    # ------------------------------------------------------------------ ownership audit
    def audit(self, *, strict: bool = False):
        """The phase-ownership audit of this rank (:func:`~ainfer_pd.comm.experts.ownership.audit_rank`)."""
        from ...comm.experts.ownership import audit_rank
        return audit_rank(self.engine, strict=strict)
