"""One run of the NCCL-layer harness on one rank: real processes, real collectives, the real turnstile.

One process per rank (spawned by :func:`ainfer_pd.launch.spawn`, or started by ``torchrun``:
``python -m benchmarks.nccl_harness``, see :mod:`.launcher` and :mod:`.ranks`) runs an asyncio
loop with a device, the library's phase-owned attention collectives over separate communicators per phase
(:class:`~ainfer_pd.comm.collectives.RankCollectives`; ``backend``: gloo or NCCL), the real
:class:`~ainfer_pd.turnstile.Turnstile` over the real distributed rendezvous (gloo / shared
memory), and a synthetic per-replica schedule. Devices:

* ``backend="gloo"``: the library's CPU stand-in (:class:`~ainfer_pd.engine.runtime.device.CpuDevice`:
  P stream, D stream, a collective stream ``C`` for ``global-implicit``, ``residency_slots``
  shared by all streams, cross-stream dependencies waited for outside the slots);
* ``backend="nccl"``: ``cuda:LOCAL_RANK`` with real CUDA streams and NCCL communicators
  (:class:`~.cuda_device.DepCudaDevice`; ``residency_slots`` is the residency gate of the
  collectives, 0 = none).

Schedule:

* D iterations: compute (a torch matmul) + the D DP-attention all-gather;
* P epochs of S segments: compute (a torch matmul, depending on the previous segment's
  all-reduce) + the registered P attention-TP all-reduce.

Attention-DP replicas schedule independently: replica 0 starts D first and P
``phase_offset_ms`` later, replica 1 the other way round; every launch may be preceded by
launch jitter and an injected rank skew (fixed or random). Ordering modes:

* ``none``: no turnstile; every collective on its phase's stream (communicator isolation
  only). With crossed groups and one residency slot the device-progress cycle of SPEC 2
  forms and the watchdog raises :class:`StallError` with the frontier.
* ``selective``: turnstile rounds (two rendezvous per D round); the registered P collective
  goes on the D stream after the round's D launch (``R- < G < R+``); P compute stays on the
  P stream and overlaps D.
* ``global-implicit``: turnstile rounds; every collective of both phases on one collective
  stream ("C"), in turnstile order.

Fault knobs: ``skew_ms`` / ``skew_mode`` (rank skew before launches), ``p_delay_ms`` (each P
compute item completes that much later: counts "delayed-ACK" rounds, where rendezvous 2
completed while P work was still running), ``kill_rank`` / ``kill_after_d`` (SIGKILL one
rank after that many D iterations).

Every rank writes ``rank{r}.jsonl`` (control trace) into ``run_dir``; rank 0 writes
``meta.json``. ``ainfer-pd trace-check RUN_DIR`` verifies the ordering contract.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch

from ainfer_pd.comm.backend import group_backend
from ainfer_pd.comm.ordering import D_ADP_ALL_GATHER, P_ATP_ALL_REDUCE, CollectiveKind
from ainfer_pd.comm.topology import ATTN_DP_D, ATTN_TP_D, ATTN_TP_P
from ainfer_pd.errors import PeerLostError, RendezvousTimeout, StallError, TopologyError

from .spec import HarnessSpec, collective_stream, expected_rounds, overlap_stats, registry_for

__all__ = ["RankRun", "data_backend", "make_device"]


def data_backend(groups: dict[str, Any], device: Any) -> str:
    """The one data backend of this rank's attention groups, checked against the device:
    :class:`TopologyError` for mixed groups or for gloo groups on a CUDA device (and back)."""
    names = (ATTN_TP_P, ATTN_TP_D, ATTN_DP_D)
    backends = {n: group_backend(groups[n]) for n in names if n in groups}
    if len(set(backends.values())) != 1:
        raise TopologyError(f"attention groups with different data backends {backends} (one per rank)")
    backend = next(iter(backends.values()))
    if (device.kind == "cuda") != (backend == "nccl"):
        raise TopologyError(f"{backend} groups on a {device.kind} device "
                            f"(nccl needs the CUDA device, gloo the CPU stand-in)")
    return backend


def _mm(a: torch.Tensor, b: torch.Tensor, reps: int, delay_s: float) -> torch.Tensor:
    c = a
    for _ in range(reps):
        c = torch.mm(c, b)
        c = c / (c.norm() + 1.0)
    if delay_s > 0:
        if c.is_cuda:
            from .cuda_device import device_sleep
            device_sleep(delay_s, c.device.index)       # the stream stays busy (no host sleep)
        else:
            time.sleep(delay_s)
    return c


def make_device(spec: HarnessSpec, recorder: Any) -> Any:
    """The harness device of this rank: the library's CPU stand-in (gloo: every item holds one of
    ``residency_slots``, cross-stream dependencies wait outside them) or ``cuda:LOCAL_RANK`` with
    the harness's residency gate (nccl)."""
    if spec.backend == "nccl":
        from ainfer_pd.comm.backend import local_cuda_index

        from .cuda_device import DepCudaDevice
        return DepCudaDevice(recorder, local_cuda_index(), residency_slots=spec.residency_slots)
    from ainfer_pd.engine.runtime.device import CpuDevice
    return CpuDevice(recorder, residency_slots=spec.residency_slots)


# ====================================================================== one rank
class RankRun:
    """One run of ``spec`` on this rank over its process groups (``store``: the launch's store)."""

    def __init__(self, rank: int, topo: Any, groups: dict, spec: HarnessSpec, store: Any, index: int = 0) -> None:
        from ainfer_pd.config import ParallelConfig
        from ainfer_pd.metrics.recorder import Recorder
        from ainfer_pd.sched.span import fixed_span
        from ainfer_pd.turnstile.dist_rendezvous import GlooRendezvous, make_rendezvous
        from ainfer_pd.comm.collectives import RankCollectives
        from ainfer_pd.comm.watchdog import Watchdog
        from ainfer_pd.turnstile.turnstile import Turnstile

        self.rank, self.topo, self.spec, self.store = rank, topo, spec, store
        self.run_dir = Path(spec.run_dir) if spec.run_dir else None
        trace = self.run_dir / f"rank{rank}.jsonl" if self.run_dir else None
        self.rec = Recorder(rank=rank, trace_path=trace)
        self.dev = make_device(spec, self.rec)
        self.cuda = self.dev.kind == "cuda"
        # the library's phase-owned collectives (one per phase, their own communicators)
        self.colls = RankCollectives(topo, groups, backend=data_backend(groups, self.dev), recorder=self.rec,
                                     registry=registry_for(topo, spec))
        self.registry = self.colls.registry
        self.turnstile = None
        self.rdv = None
        if spec.ordering != "none":
            pcfg = ParallelConfig(world_size=topo.world_size, attn_dp=topo.attn_dp, ordering=spec.ordering,
                                  rendezvous_timeout_s=spec.rendezvous_timeout_s,
                                  fast_rendezvous=spec.fast_rendezvous)
            name = f"mr-{spec.tag}-{index}"
            if spec.rendezvous == "gloo":
                self.rdv = GlooRendezvous(groups["control"], spec.rendezvous_timeout_s, store=store, name=name)
            else:
                self.rdv = make_rendezvous(pcfg, topo, same_host=True, group=groups.get("control"), store=store,
                                           name=name)
            self.turnstile = Turnstile(rendezvous=self.rdv, span=fixed_span(spec.span), recorder=self.rec,
                                       rank=rank, timeout_s=spec.rendezvous_timeout_s)
        self.d_done = 0
        self.p_done = 0
        self.ack_rounds = 0
        self.delayed_ack_rounds = 0
        self.p_outstanding: list = []
        self.intervals: list[tuple[str, str, bool, float, float]] = []   # (kind, phase, registered, t0, t1)
        rep = topo.dp_rank
        self.replica = rep
        off = spec.phase_offset_ms / 1e3
        self.p_offset, self.d_offset = (off, 0.0) if rep % 2 == 0 else (0.0, off)
        self._rng = {s: random.Random(f"{spec.seed}/{rank}/{s}") for s in ("P", "D")}
        # skew_mode "crossed": the phase this rank launches second (once)
        self._second_phase = "D" if (topo.dp_rank + topo.tp_rank) % 2 == 0 else "P"
        self._skewed: set[str] = set()
        g = torch.Generator().manual_seed(spec.seed * 1000 + rank)
        m = spec.matmul
        tdev = self.dev.torch_device
        self.a = torch.randn(m, m, generator=g).to(tdev)
        self.b = (torch.randn(m, m, generator=g) / m ** 0.5).to(tdev)
        self.x = torch.randn(spec.rows, m, generator=g).to(tdev)
        if self.cuda:
            torch.cuda.synchronize(tdev)          # inputs ready before any stream reads them
        prefix = f"ainfer_pd/mr/{spec.tag}-{index}"
        self.wd = Watchdog(rank=rank, world_size=topo.world_size, stall_s=spec.stall_s, progress=self._progress,
                           probe=self._probe, store=store, prefix=prefix)
        self.tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ bookkeeping
    def _coll_done(self, info: dict) -> None:
        if info["phase"] == "P":
            self.p_done += 1
        self.intervals.append(("coll", info["phase"], bool(info["registered"]), info["t0"], info["t1"]))

    def _progress(self) -> tuple:
        c = self.colls.frontier()["completed"]
        return (self.d_done, self.p_done, tuple(sorted(c.items())))

    def _probe(self) -> dict:
        return {"d_done": self.d_done, "p_done": self.p_done, "colls": self.colls.frontier(),
                "turnstile": self.turnstile.snapshot() if self.turnstile else None,
                "ordering": self.spec.ordering}

    async def _skew(self, stream: str) -> None:
        s, rng = self.spec, self._rng[stream]
        d = rng.uniform(0.0, s.jitter_ms) / 1e3 if s.jitter_ms > 0 else 0.0
        if s.skew_ms > 0:
            if s.skew_mode == "random":
                d += rng.uniform(0.0, s.skew_ms) / 1e3
            elif s.skew_mode == "crossed":
                if stream == self._second_phase and stream not in self._skewed:
                    self._skewed.add(stream)
                    d += s.skew_ms / 1e3
            elif self.rank % 2 == 1:
                d += s.skew_ms / 1e3
        if d > 0:
            await asyncio.sleep(d)

    def _compute(self, phase: str, label: str, deps: list, reps: int, delay_s: float):
        """Compute on the phase's stream; its interval goes to the trace (CPU: timed by the
        item itself; CUDA: from its CUDA events, once it completed)."""
        rec, ivs, cuda = self.rec, self.intervals, self.cuda
        a, b = self.a, self.b

        def interval(t0: float, t1: float) -> None:
            ivs.append(("compute", phase, False, t0, t1))
            rec.event("work", what=label, phase=phase, kind="compute", stream=phase, registered=False, t0=t0, t1=t1)

        def compute() -> torch.Tensor:
            t0 = rec.now()
            out = _mm(a, b, reps, delay_s)
            if not cuda:
                interval(t0, rec.now())
            return out

        work = self.dev.stream(phase).submit(compute, label=label, deps=tuple(deps))
        if cuda:
            self.dev.on_done(work, interval)
        return work

    async def _p_segment(self, e: int, j: int, prev: Any, ep: Any = None) -> Any:
        """One P segment: compute (P stream, after the previous all-reduce), wait for it on the
        host (P's host is paced by P progress, like receive counts), then - with the turnstile -
        the permit for boundary ``j``, then the registered all-reduce; then publish ``j + 1``."""
        s = self.spec
        await self._skew("P")
        comp = self._compute("P", f"Pcomp e{e} s{j}", [prev], s.p_reps, s.p_delay_ms / 1e3)
        self.p_outstanding.append(comp)
        await comp.done()
        if ep is not None:
            await ep.permit(j)
            await self._skew("P")
        ar = self._collective(P_ATP_ALL_REDUCE, [comp], epoch=e, boundary=j)
        self.p_outstanding.append(ar)
        if ep is not None:
            ep.publish(j + 1, final=(j + 1 == s.segments))
        return ar

    def _d_launch(self, i: int, rnd: Any) -> Any:
        dcomp = self._compute("D", f"Dcomp i{i}", [], self.spec.d_reps, 0.0)
        epoch = rnd.epoch if rnd is not None else None
        boundary = rnd.boundary if rnd is not None else None
        dag = self._collective(D_ADP_ALL_GATHER, [dcomp], epoch=epoch, boundary=boundary, extra={"iter": i})
        self.rec.event("d_launch", iter=i, epoch=epoch, boundary=boundary, stream=dag.stream.name)
        return dag

    def _collective(self, kind: CollectiveKind, deps: list, *, epoch: int | None, boundary: int | None,
                    extra: dict | None = None) -> Any:
        """``kind`` on its stream (:func:`collective_stream`) after ``deps``: the host half now
        (``coll_enqueue``: the library's :meth:`~ainfer_pd.comm.collectives.PhaseCollectives.enqueue`),
        the device half as a stream item. CPU: :meth:`~ainfer_pd.comm.collectives.PhaseCollectives.run`
        (the blocking call holds the item's residency slot until every peer joined). CUDA:
        :func:`~.cuda_device.cuda_collective_item` (completion from its end event)."""
        pc = self.colls.get(kind.phase)
        stream = collective_stream(self.spec.ordering, kind, self.registry)
        info = pc.enqueue(kind, stream=stream, epoch=epoch, boundary=boundary, extra=extra)
        if self.cuda:
            from .cuda_device import cuda_collective_item
            item = cuda_collective_item(pc, info, self.x.clone, self.dev, self._coll_done)
        else:
            def item() -> torch.Tensor:
                out = pc.run(kind, self.x.clone())
                self._coll_done(info)
                return out
        return self.dev.stream(stream).submit(item, label=f"{kind.name}#{info['seq']}", deps=tuple(deps))

    def _maybe_kill(self) -> None:
        s = self.spec
        if s.kill_rank == self.rank and self.d_done >= s.kill_after_d:
            self.rec.event("killed", d_done=self.d_done)
            self.rec.close()
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ mode none
    async def _none_p(self) -> None:
        await asyncio.sleep(self.p_offset)
        prev = None
        for e in range(self.spec.epochs):
            for j in range(self.spec.segments):
                prev = await self._p_segment(e, j, prev)
            await prev.done()
            await asyncio.sleep(self.spec.epoch_gap_ms / 1e3)

    async def _none_d(self) -> None:
        await asyncio.sleep(self.d_offset)
        for i in range(self.spec.d_iters):
            await self._skew("D")
            dag = self._d_launch(i, None)
            await dag.done()
            self.d_done += 1
            self._maybe_kill()

    # ------------------------------------------------------------------ turnstile modes
    async def _p_epoch(self, e: int, entered: asyncio.Event) -> None:
        ts = self.turnstile
        prev = None
        async with ts.epoch(e, gated=True, d_enqueued=False) as ep:
            entered.set()
            if e == 0 and self.p_offset:
                await asyncio.sleep(self.p_offset)
            for j in range(self.spec.segments):
                prev = await self._p_segment(e, j, prev, ep)
        if prev is not None:
            await prev.done()

    async def _turnstile_d(self) -> None:
        ts, s = self.turnstile, self.spec
        sched = random.Random(f"schedule/{s.seed}")          # rank-agreed epoch starts
        next_start = sched.randint(0, 2)
        e, i = 0, 0
        p_task: asyncio.Task | None = None
        if self.d_offset:
            await asyncio.sleep(self.d_offset)
        while True:
            if e < s.epochs and i >= next_start and not ts.gated_epoch_active:
                if p_task is not None:
                    await p_task
                entered = asyncio.Event()
                p_task = asyncio.create_task(self._p_epoch(e, entered), name=f"P epoch {e}")
                self.tasks.add(p_task)
                ent = asyncio.create_task(entered.wait())
                await asyncio.wait({ent, p_task}, return_when=asyncio.FIRST_COMPLETED)
                ent.cancel()
                if not entered.is_set():
                    await p_task                      # raises why the epoch did not begin
                e += 1
                next_start = i + sched.randint(1, 3)
            if i >= s.d_iters and e >= s.epochs and not ts.gated_epoch_active:
                break
            rnd = await ts.before_decode() if ts.gated_epoch_active else None
            await self._skew("D")
            dag = self._d_launch(i, rnd)
            if rnd is not None:
                await ts.after_decode(rnd)
                self.ack_rounds += 1
                running = [w.label for w in self.p_outstanding if not w.is_done()]
                self.p_outstanding = [w for w in self.p_outstanding if not w.is_done()]
                if running:
                    self.delayed_ack_rounds += 1
                self.rec.event("ack", epoch=rnd.epoch, boundary=rnd.boundary, p_running=len(running),
                               running=running[:4])
            await dag.done()
            self.d_done += 1
            i += 1
            self._maybe_kill()
        if p_task is not None:
            await p_task

    # ------------------------------------------------------------------ driver
    async def body(self) -> None:
        if self.spec.ordering == "none":
            tp = asyncio.create_task(self._none_p(), name="P")
            td = asyncio.create_task(self._none_d(), name="D")
            self.tasks |= {tp, td}
            await asyncio.gather(tp, td)
        else:
            await self._turnstile_d()

    async def run(self) -> dict:
        s = self.spec
        t0 = time.perf_counter()
        self.rec.event("run_begin", tag=s.tag, t0_mono=self.rec.t0, ordering=s.ordering, topology=self.topo.describe(),
                       residency=s.residency_slots, registered=self.registry.describe())
        self.wd.start()
        main = asyncio.create_task(self.body(), name="harness body")
        wdt = asyncio.create_task(self.wd.watch(), name="watchdog")
        finished = False
        try:
            await asyncio.wait({main, wdt}, return_when=asyncio.FIRST_COMPLETED)
            if main.done() and not main.cancelled() and main.exception() is None:
                wdt.cancel()
                out = await self._finish(time.perf_counter() - t0)
                finished = True
                return out
            if wdt.done():
                exc = wdt.exception()
                self._cancel_all(main)
                self._dump_frontier(self.wd.report)
                raise exc
            if self.wd.stalling:
                # the watchdog is already reporting a stall: its report is the answer
                try:
                    await asyncio.wait_for(asyncio.shield(wdt), self.wd.peer_wait_s + 2.0)
                except BaseException:
                    pass
                if wdt.done() and not wdt.cancelled() and wdt.exception() is not None:
                    self._dump_frontier(self.wd.report)
                    raise wdt.exception()
            wdt.cancel()
            raise await self._explain(main.exception())
        finally:
            self.wd.stop()
            self._cancel_all(main)
            if not finished and self.cuda:
                self.dev.close()          # CUDA: stream threads blocked in the gate give up
                # (CPU: a blocking gloo call cannot be interrupted; the process exits)
            self.rec.event("run_end", d_done=self.d_done, p_done=self.p_done)
            self.rec.close()

    def _cancel_all(self, main: asyncio.Task) -> None:
        for t in (main, *self.tasks):
            if not t.done():
                t.cancel()

    def _dump_frontier(self, report: dict | None) -> None:
        if self.run_dir is not None and report is not None:
            (self.run_dir / f"frontier{self.rank}.json").write_text(json.dumps(report, indent=1, default=str))

    async def _explain(self, exc: BaseException) -> BaseException:
        """A failure of this rank's loops: name the lost peers (heartbeats) or a peer's stall."""
        if not isinstance(exc, Exception):
            return exc
        await asyncio.sleep(1.2)                      # let a dead peer's heartbeat go stale
        lost = self.wd.unresponsive(stale_s=1.0)
        stall_by = self.wd.peer_declared_stall()
        where = (f"completed D iterations {self.d_done}, P segments {self.p_done}; in flight: "
                 + "; ".join(f"{c['phase']} {c['op']} {c['comm']}#{c['seq']} group {tuple(c['group'])} "
                             f"({c['state']})" for c in self.colls.frontier()["inflight"]))
        if stall_by is not None:
            err = StallError(f"rank {self.rank}: failed after rank {stall_by} declared a device-progress stall "
                             f"(peers that exited since: {lost}; {type(exc).__name__}: {exc}); {where}")
            err.__cause__ = exc
            return err
        if not lost:
            return exc
        names = ", ".join(f"rank {r}" for r in lost)
        msg = (f"rank {self.rank}: peer {names} died or stopped responding (no heartbeat for > 1 s); "
               f"this rank failed with {type(exc).__name__}: {exc}; {where}")
        if isinstance(exc, RendezvousTimeout):
            err: Exception = RendezvousTimeout(msg, missing_ranks=tuple(exc.missing_ranks) or tuple(lost),
                                               epoch=exc.epoch, boundary=exc.boundary)
        else:
            err = PeerLostError(msg, ranks=tuple(lost))
        err.__cause__ = exc
        return err

    async def _finish(self, wall: float) -> dict:
        s = self.spec
        rdv = self.rec.samples.get("rendezvous_s", [])
        out = {"rank": self.rank, "tag": s.tag, "ordering": s.ordering, "completed": True, "wall_s": wall,
               "d_done": self.d_done, "p_done": self.p_done,
               "rounds": self.turnstile.rounds if self.turnstile else 0,
               "expected_rounds": expected_rounds(s), "rendezvous": len(rdv),
               "rendezvous_mean_ms": 1e3 * sum(rdv) / len(rdv) if rdv else 0.0,
               "rendezvous_kind": getattr(self.rdv, "kind", None),
               "ack_rounds": self.ack_rounds, "delayed_ack_rounds": self.delayed_ack_rounds,
               "backend": s.backend, "device": str(self.dev.torch_device), "device_kind": self.dev.kind,
               "overlap": None}
        # every completion callback (CUDA: poller thread) has run before the overlap is computed
        if self.cuda and not await asyncio.to_thread(self.dev.quiesce, 10.0):
            out["quiesce_timeout"] = True
        out["overlap"] = overlap_stats(self.intervals)
        if self.rdv is not None:
            try:
                await asyncio.wait_for(self.rdv.close(), 5.0)
            except Exception:
                pass
        self.dev.shutdown()
        return out
