"""Phase-identified attention collectives of one rank (SPEC 2, 3.1, 3.3).

* P (eager): the full attention-TP **all-reduce** of every layer over its own communicator
  (``attn_tp.P``), launched as its own stream item (:meth:`PhaseCollectives.launch`) so the
  ordering can route it (:func:`~ainfer_pd.comm.ordering.collective_stream`).
* D (inside its iteration): its own attention-TP **reduce-scatter / all-gather** around the
  experts (``attn_tp.D``: :class:`~ainfer_pd.engine.runtime.tensor_parallel.DecodeHooks`) and, with
  ADP > 1 and expert parallelism, the DP-attention **all-gather / reduce-scatter** across the
  replicas around each MoE layer's routed experts (``attn_dp.D``:
  :meth:`~ainfer_pd.engine.runtime.tensor_parallel.DecodeHooks.experts_dp`; with P's all-reduce the
  crossed pair of SPEC 2).

The state is phase-owned (SPEC 3.4): one :class:`PhaseCollectives` per phase holds only that
phase's communicators, counters, in-flight table and lock, and registers them to its phase in the
ownership audit (:meth:`PhaseCollectives.register_owned`); :class:`RankCollectives` is the rank's
pair, read together only by the watchdog (progress, frontier).

Each collective has two halves. :meth:`enqueue` is the *host* half: it numbers the collective
on its communicator, writes ``coll_enqueue`` (host order: the trace-check's device-order
evidence) and puts it in the in-flight table the watchdog reads. :meth:`run` is the *device*
half, on the stream thread: ``coll_launch`` when it joins its communicator's current call (on
the CPU stand-in it holds a residency slot until every peer joined, as a spinning NCCL kernel
holds SMs), the blocking call, ``coll_done`` and a ``work`` interval. A D iteration enqueues
every collective of its schedule at its launch (:meth:`enqueue_schedule`) and runs them in that
order. Groups of one rank issue nothing (:meth:`PhaseCollectives.active`), except the
communicators named in ``AINFER_PD_ONE_RANK_COLLECTIVES`` (:data:`ONE_RANK_ENV`, read when a
:class:`PhaseCollectives` is built): there a one-rank group issues its collectives too, identity
operations on a real communicator, so one GPU runs D's attention-TP and DP-attention path on NCCL
(the GPU gate's ``nccl`` section). :attr:`PhaseCollectives.issued` counts the operations handed to
``torch.distributed`` per communicator (warm-up and graph-capture passes included). The phase is
always explicit: a kind of the other phase is refused by name.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import DistributedError, TopologyError
from ..phase import Phase
from .ordering import (D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_ATP_ALL_GATHER, D_ATP_REDUCE_SCATTER, P_ATP_ALL_REDUCE, CollectiveKind,
                       ConflictRegistry)
from .topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P, Topology

__all__ = ["PhaseCollectives", "RankCollectives", "KINDS", "PHASE_COMMS", "ONE_RANK_ENV", "one_rank_comms"]

KINDS = (P_ATP_ALL_REDUCE, D_ATP_REDUCE_SCATTER, D_ATP_ALL_GATHER, D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER)
PHASE_COMMS: dict[Phase, tuple[str, ...]] = {Phase.PREFILL: (ATTN_TP_P,), Phase.DECODE: (ATTN_TP_D, ATTN_DP_D)}
"""The communicators each phase owns."""
ONE_RANK_ENV = "AINFER_PD_ONE_RANK_COLLECTIVES"
"""Comma-separated communicator names (``attn_tp.D,attn_dp.D``; ``all``: every one) whose groups
issue their collectives even with one rank (identity operations): the NCCL path at world size 1."""


def one_rank_comms() -> frozenset[str]:
    """The communicators :data:`ONE_RANK_ENV` names (:class:`TopologyError` for an unknown name)."""
    raw = os.environ.get(ONE_RANK_ENV, "").strip()
    known = {c for cs in PHASE_COMMS.values() for c in cs}
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if "all" in names:
        return frozenset(known)
    bad = sorted(names - known)
    if bad:
        raise TopologyError(f"{ONE_RANK_ENV}={raw!r}: unknown communicator(s) {bad}; expected names of "
                            f"{sorted(known)} or 'all'")
    return frozenset(names)


class PhaseCollectives:
    """The attention collectives of one phase of one rank (its own communicators and counters).

    ``phase``: the owner; ``groups``: :func:`~ainfer_pd.comm.topology.build_process_groups` (this
    keeps only its phase's: ``attn_tp.P``, or ``attn_tp.D`` and ``attn_dp.D``); ``backend``: their
    data backend (nccl: the tensor-native ops); ``registry``: the conflicting pairs (default: from
    the topology; immutable configuration, read by both phases); ``recorder``: trace and clock.
    """

    def __init__(self, topology: Topology, groups: dict[str, Any], *, phase: Phase, backend: str, recorder: Any,
                 registry: ConflictRegistry | None = None) -> None:
        if not isinstance(phase, Phase):
            raise TopologyError(f"PhaseCollectives needs an explicit Phase, got {phase!r}")
        comms = PHASE_COMMS[phase]
        missing = [n for n in comms if n not in groups]
        if missing:
            raise TopologyError(f"PhaseCollectives: process groups {missing} missing (build_process_groups)")
        self.phase = phase
        self.topology = topology
        self.groups = {n: groups[n] for n in comms}
        self.native = backend == "nccl"
        self.recorder = recorder
        self.registry = registry if registry is not None else ConflictRegistry.for_topology(topology)
        self._sizes = {ATTN_TP_P: len(topology.tp_group), ATTN_TP_D: len(topology.tp_group),
                       ATTN_DP_D: len(topology.dp_group)}
        everyone = {ATTN_TP_P: topology.tp_group, ATTN_TP_D: topology.tp_group, ATTN_DP_D: topology.dp_group}
        self.members = {c: everyone[c] for c in comms}
        self._lock = threading.Lock()
        self.enqueued = {c: 0 for c in self.members}
        self.joined = {c: 0 for c in self.members}
        self.completed = {c: 0 for c in self.members}
        self.issued = {c: 0 for c in self.members}
        """Operations handed to ``torch.distributed`` per communicator (:meth:`apply`; booked or not)."""
        self.one_rank = one_rank_comms() & set(comms)
        """This phase's communicators that issue even over one rank (:data:`ONE_RANK_ENV`)."""
        self.inflight: dict[tuple[str, int], dict] = {}
        self._pending: dict[str, collections.deque] = {c: collections.deque() for c in self.members}
        """Per communicator: collectives enqueued by the host, not started yet (FIFO)."""
        self.booking = True
        """Trace and track every collective (off while warm-up passes / graph captures run them)."""
        self.skew_s: dict[str, float] = {}
        """Fault injection (``faults.phase_skew_ms``): seconds the first collective of one of these
        communicators in each enqueued schedule (a D iteration) waits on its stream before it asks
        the device for residency."""
        self._skew_due = False
        self.gate: Callable[[str], Any] = lambda comm: contextlib.nullcontext()
        """The device's collective residency (``Device.collective_slot(comm)``): held while resident."""

    # ------------------------------------------------------------------ identity
    def size(self, comm: str) -> int:
        return self._sizes[comm]

    def active(self, kind: CollectiveKind) -> bool:
        """The collective exists on this topology (its group has more than one rank, or its
        communicator is named in :data:`ONE_RANK_ENV`)."""
        return self.size(kind.comm) > 1 or kind.comm in self.one_rank

    def crossed_comms(self) -> list[str]:
        """This phase's communicators whose groups cross the other phase's (ATP > 1 and ADP > 1:
        D's ``attn_dp.D`` against P's ``attn_tp.P``)."""
        if not self.topology.crossed:
            return []
        return [ATTN_DP_D] if self.phase is Phase.DECODE else [ATTN_TP_P]

    def _own(self, kind: CollectiveKind) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown attention collective {kind.name}")
        if kind.phase is not self.phase:
            raise DistributedError(f"rank {self.topology.rank}: {kind.name} is a {kind.phase.value} collective; "
                                   f"this is {self.phase.value}'s phase-owned collective state")

    def register_owned(self, reg: Any) -> None:
        """This phase's communicators, counters, in-flight table and lock, owned by its phase."""
        ph, tag = self.phase, f"{self.phase.value}.attn_colls"
        for name, pg in self.groups.items():
            reg.register("process_group", f"{name}.group", ph, pg)
        for name in ("enqueued", "joined", "completed", "issued"):
            reg.register("counters", f"{tag}.{name}", ph, getattr(self, name))
        reg.register("workspace", f"{tag}.inflight", ph, self.inflight)
        reg.register("workspace", f"{tag}.pending", ph, self._pending)
        reg.register("lock", f"{tag}.lock", ph, self._lock)

    # ------------------------------------------------------------------ host half
    def enqueue(self, kind: CollectiveKind, *, stream: str, epoch: int | None = None, boundary: int | None = None,
                extra: dict | None = None) -> dict:
        """Number ``kind`` on its communicator in host order and trace ``coll_enqueue``."""
        self._own(kind)
        comm = kind.comm
        with self._lock:
            self.enqueued[comm] += 1
            info = {"name": kind.name, "phase": kind.phase.value, "op": kind.op, "comm": comm,
                    "group": list(self.members[comm]), "seq": self.enqueued[comm], "stream": stream,
                    "epoch": epoch, "boundary": boundary, "registered": self.registry.is_registered(kind),
                    "state": "queued", "kind": kind, **(extra or {})}
            self.inflight[(comm, info["seq"])] = info
            self._pending[comm].append(info)
        self._event("coll_enqueue", info)
        return info

    def enqueue_schedule(self, kinds: Iterable[CollectiveKind], *, stream: str, epoch: int | None,
                         boundary: int | None, extra: dict | None = None) -> list[dict]:
        """A D iteration's collectives, in the order its item will run them."""
        self._skew_due = bool(self.skew_s)
        return [self.enqueue(k, stream=stream, epoch=epoch, boundary=boundary, extra=extra) for k in kinds]

    # ------------------------------------------------------------------ device half
    def run(self, kind: CollectiveKind, t: torch.Tensor) -> torch.Tensor:
        """Run the next enqueued collective of ``kind``'s communicator on ``t`` (stream thread).
        With :attr:`booking` off (warm-up passes, graph capture) only the operation runs."""
        self._own(kind)
        if not self.booking:
            return self.apply(kind, t)
        info = self.take(kind)
        if self._skew_due and self.skew_s.get(kind.comm):
            self._skew_due = False
            time.sleep(self.skew_s[kind.comm])
        info["state"] = "admitting"                 # its stream reached it: waiting for device residency
        with self.gate(kind.comm):                  # resident until every peer joined
            t0 = self.mark_started(info)
            try:
                out = self.apply(kind, t)
            except Exception as exc:  # transport failure: name the collective and the group
                raise self.failure(info, exc) from exc
        self.mark_completed(info, t0, self._now())
        return out

    def take(self, kind: CollectiveKind) -> dict:
        """The device half begins: the next enqueued collective of ``kind``'s communicator (its
        in-flight record); :class:`DistributedError` when it was not enqueued first. :meth:`run`
        is ``take``, :meth:`mark_started`, :meth:`apply`, :meth:`mark_completed`; a device whose
        completion comes later (CUDA events) calls them itself."""
        self._own(kind)
        with self._lock:
            q = self._pending[kind.comm]
            info = q.popleft() if q else None
        if info is None or info["kind"] != kind:
            raise DistributedError(f"rank {self.topology.rank}: {kind.name} ran without its host enqueue "
                                   f"(next enqueued: {info and info['name']})")
        return info

    def failure(self, info: dict, exc: BaseException) -> DistributedError:
        """Mark ``info`` failed; the error naming the collective, its group, epoch and boundary."""
        info["state"] = "failed"
        return DistributedError(
            f"rank {self.topology.rank}: {info['name']} #{info['seq']} over group {tuple(info['group'])} "
            f"failed (epoch {info['epoch']}, boundary {info['boundary']}): {exc}")

    def launch(self, kind: CollectiveKind, tensor: Callable[[], torch.Tensor], *, device: Any, stream: str,
               epoch: int | None, boundary: int | None, deps: tuple = (), delay_s: float = 0.0,
               extra: dict | None = None):
        """Enqueue ``kind`` as its own item on ``stream`` of ``device`` (P's all-reduce: routed by
        the ordering); ``tensor()`` is read on the stream. Returns the stream item."""
        self.enqueue(kind, stream=stream, epoch=epoch, boundary=boundary, extra=extra)
        return device.stream(stream).submit(lambda: self.run(kind, tensor()), label=f"{kind.name}",
                                            deps=deps, delay_s=delay_s)

    def complete_pending(self, comm: str | None = None) -> None:
        """A graph replay ran its collectives without host callbacks: mark them done."""
        now = self._now()
        with self._lock:
            comms = [comm] if comm else list(self._pending)
            infos = [i for c in comms for i in self._pending[c]]
            for c in comms:
                self._pending[c].clear()
        for info in infos:
            self.mark_started(info)
            self.mark_completed(info, now, now)

    def apply(self, kind: CollectiveKind, t: torch.Tensor) -> torch.Tensor:
        """The collective operation itself on ``t`` (no bookkeeping)."""
        import torch.distributed as dist
        pg, members = self.groups[kind.comm], self.members[kind.comm]
        n = len(members)
        with self._lock:
            self.issued[kind.comm] += 1
        if kind.op == "all_reduce":
            t = t.contiguous()
            dist.all_reduce(t, group=pg)
            return t
        if kind.op == "all_gather":                     # dim 0, member order
            t = t.contiguous()
            if self.native:
                out = t.new_empty((n * t.shape[0], *t.shape[1:]))
                _native(dist, "all_gather_single", "all_gather_into_tensor")(out, t, group=pg)
                return out
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t, group=pg)
            return torch.cat(parts, 0)
        if t.shape[0] % n:                              # reduce_scatter: sum, then this member's chunk
            raise ValueError(f"reduce_scatter: dim 0 ({t.shape[0]}) not divisible by the group size {n}")
        if self.native:
            out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
            _native(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, t.contiguous(), group=pg)
            return out
        t = t.clone()                                   # gloo has no reduce-scatter: all-reduce + chunk
        dist.all_reduce(t, group=pg)
        return t.chunk(n, 0)[members.index(self.topology.rank)].clone()

    # ------------------------------------------------------------------ bookkeeping
    def _now(self) -> float:
        return self.recorder.now() if self.recorder is not None else 0.0

    def _event(self, name: str, info: dict, **more: Any) -> None:
        if self.recorder is None:
            return
        ev = {k: info[k] for k in ("phase", "op", "comm", "group", "stream", "epoch", "boundary", "registered",
                                   "gated") if k in info}
        self.recorder.event(name, coll=info["name"], cseq=info["seq"], **ev, **more)

    def mark_started(self, info: dict) -> float:
        """``info`` joined its communicator's current call (``coll_launch``); returns its start."""
        with self._lock:
            self.joined[info["comm"]] += 1
            info["state"] = "running"
        t0 = self._now()
        self._event("coll_launch", info)
        return t0

    def mark_completed(self, info: dict, t0: float, t1: float) -> None:
        """``info`` completed over ``[t0, t1]`` (recorder seconds; kept in the record): ``coll_done``
        and its ``work`` interval."""
        info["t0"], info["t1"] = t0, t1
        with self._lock:
            self.completed[info["comm"]] += 1
            self.inflight.pop((info["comm"], info["seq"]), None)
            info["state"] = "done"
        self._event("coll_done", info)
        if self.recorder is not None:
            self.recorder.event("work", what=info["name"], phase=info["phase"], kind="coll", stream=info["stream"],
                                registered=info["registered"], epoch=info["epoch"], boundary=info["boundary"],
                                t0=t0, t1=t1)
            self.recorder.interval(info["name"], info["stream"], t0, t1, phase=info["phase"], kind="coll")

    def frontier(self) -> dict:
        """What this rank has in flight (for the watchdog), JSON-ready."""
        with self._lock:
            return {"joined": dict(self.joined), "completed": dict(self.completed), "enqueued": dict(self.enqueued),
                    "inflight": [{k: v for k, v in i.items() if k != "kind"} for i in self.inflight.values()]}

    def progress(self) -> int:
        with self._lock:
            return sum(self.completed.values())


class RankCollectives:
    """The rank's two phase-owned :class:`PhaseCollectives` (``P``, ``D``); the engine hands each
    phase its own (:meth:`get`); only the watchdog reads both (progress, frontier)."""

    def __init__(self, topology: Topology, groups: dict[str, Any], *, backend: str, recorder: Any,
                 registry: ConflictRegistry | None = None) -> None:
        self.registry = registry if registry is not None else ConflictRegistry.for_topology(topology)
        self.P = PhaseCollectives(topology, groups, phase=Phase.PREFILL, backend=backend, recorder=recorder,
                                  registry=self.registry)
        self.D = PhaseCollectives(topology, groups, phase=Phase.DECODE, backend=backend, recorder=recorder,
                                  registry=self.registry)

    def get(self, phase: Phase) -> PhaseCollectives:
        return self.P if phase is Phase.PREFILL else self.D

    def set_booking(self, on: bool) -> None:
        self.P.booking = self.D.booking = on

    def set_gate(self, gate: Callable[[str], Any]) -> None:
        self.P.gate = self.D.gate = gate

    def set_device(self, device: Any) -> None:
        """Gate the collectives by ``device``'s collective residency; where P's and D's attention-TP
        collectives cannot both be resident on it, register the same-group pair too (a two-rank
        cycle would close: :mod:`~ainfer_pd.comm.ordering`). Before any collective is booked."""
        self.set_gate(device.collective_slot)
        if self.P.topology.atp > 1 and not device.coresident(ATTN_TP_P, ATTN_TP_D):
            self.registry.register_same_group()

    def register_owned(self, reg: Any) -> None:
        self.P.register_owned(reg)
        self.D.register_owned(reg)

    def progress(self) -> int:
        return self.P.progress() + self.D.progress()

    def frontier(self) -> dict:
        """Both phases' frontiers merged by communicator (their names are distinct)."""
        p, d = self.P.frontier(), self.D.frontier()
        return {k: {**p[k], **d[k]} for k in ("joined", "completed", "enqueued")} | {
            "inflight": p["inflight"] + d["inflight"]}


def _native(dist: Any, name: str, older: str) -> Callable:
    """The tensor-native collective under its current name (torch >= 2.13) or its older one."""
    return getattr(dist, name, None) or getattr(dist, older)
