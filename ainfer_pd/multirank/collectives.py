"""Phase-identified attention collectives (SPEC 2, 3.1) and the TP-sharded attention reduce.

* P (eager) uses the full attention-TP **all-reduce** over its own ATP group (``attn_tp.P``).
* D (graph replay on CUDA) uses the DP-attention **all-gather / reduce-scatter** over its own
  DP-attention group (``attn_dp.D``).

Each phase has its own communicator (``build_process_groups``); the phase is an explicit
argument, never guessed. :meth:`PhaseCollectives.launch` puts a collective on a device
stream: on the CPU stand-in it runs on that stream's thread and, while the blocking gloo call
waits for its peers, it HOLDS one residency slot of the device (as spinning NCCL / DeepEP
kernels hold SMs). On CUDA (:mod:`.cuda_device`) the NCCL kernel is enqueued on that CUDA
stream and its completion comes from CUDA events. Launch and completion go into the rank's
control trace (``coll_enqueue`` / ``coll_launch`` / ``coll_done``) and an in-flight table the
watchdog reads. With NCCL groups the collectives are always NCCL calls (also for a group of
one rank) and use the native ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.

:class:`DepCpuDevice` adds stream-waits-event semantics to the CPU stand-in: an item with
dependencies waits for them on its stream thread **before** taking a residency slot (like
``cudaStreamWaitEvent``: a waiting stream occupies no SMs).

:func:`shard_attention` / :func:`tp_attn_reduce`: attention tensor parallelism for the real
model without touching ``engine/model.py``: each TP rank keeps its contiguous shard of query
and KV heads (rows of ``wqkv``) and the matching columns of ``wo``, and the partial attention
outputs are all-reduced through the model's ``attn_reduce`` hook.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..comm.topology import ATTN_DP_D, ATTN_TP_P, Topology
from ..engine.device import CpuDevice, Device, Stream, Work
from ..errors import DistributedError, TopologyError
from ..phase import Phase
from ..comm.backend import group_backend
from ..comm.ordering import (
    D_ADP_ALL_GATHER,
    D_ADP_REDUCE_SCATTER,
    P_ATP_ALL_REDUCE,
    CollectiveKind,
    ConflictRegistry,
)

__all__ = ["DepCpuDevice", "PhaseCollectives", "shard_attention", "tp_attn_reduce", "with_deps"]

_OPS = {("P", "all_reduce"): P_ATP_ALL_REDUCE,
        ("D", "all_gather"): D_ADP_ALL_GATHER,
        ("D", "reduce_scatter"): D_ADP_REDUCE_SCATTER}


class _WithDeps:
    """A stream item that waits for other stream items before it takes a residency slot."""

    def __init__(self, fn: Callable, deps: Sequence[Work]) -> None:
        self.fn = fn
        self.deps = tuple(d for d in deps if d is not None)
        self.__name__ = getattr(fn, "__name__", "work")

    def wait_deps(self) -> None:
        for d in self.deps:
            d.enqueued().result()          # re-raises a failed dependency

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def with_deps(fn: Callable, deps: Iterable[Work | None] = ()) -> Callable:
    """Wrap ``fn`` so that (on :class:`DepCpuDevice`) it starts only after ``deps`` completed."""
    return _WithDeps(fn, list(deps))


class DepCpuDevice(CpuDevice):
    """CPU stand-in with cross-stream dependencies that wait outside the residency slots."""

    def _execute(self, stream: Stream, work: Work, fn: Callable, args: tuple) -> Any:
        if isinstance(fn, _WithDeps) and fn.deps:
            fn.wait_deps()
        return super()._execute(stream, work, fn, args)

    def on_done(self, work: Work, cb: Callable[[float, float], None]) -> None:
        """(CUDA only; the CPU items time themselves.)"""

    def quiesce(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self) -> None:
        """Nothing to release: a blocking gloo call cannot be interrupted (the process exits)."""


class PhaseCollectives:
    """Attention collectives of one rank with explicit phase identity.

    ``groups``: ``build_process_groups(topology)`` (needs ``attn_tp.P`` and ``attn_dp.D``).
    ``device`` / ``recorder``: where :meth:`launch` enqueues and records (optional for the
    direct blocking calls). ``registry``: conflicting pairs (default: from the topology).
    """

    def __init__(self, topology: Topology, groups: dict[str, Any], *, device: Device | None = None,
                 recorder: Any = None, registry: ConflictRegistry | None = None,
                 delay_s: dict[Phase, float] | None = None) -> None:
        missing = [n for n in (ATTN_TP_P, ATTN_DP_D) if n not in groups]
        if missing:
            raise TopologyError(f"PhaseCollectives: process groups {missing} missing (build_process_groups)")
        self.topology = topology
        self.groups = groups
        self.backend = group_backend(groups[ATTN_TP_P])
        if group_backend(groups[ATTN_DP_D]) != self.backend:
            raise TopologyError(f"PhaseCollectives: {ATTN_TP_P} is {self.backend} but {ATTN_DP_D} is "
                                f"{group_backend(groups[ATTN_DP_D])} (one data backend per rank)")
        self.native = self.backend == "nccl"
        """NCCL: always call the collective (also in a group of one) with the tensor-native ops."""
        if device is not None and (device.kind == "cuda") != self.native:
            raise TopologyError(f"PhaseCollectives: {self.backend} groups on a {device.kind} device "
                                f"(nccl needs the CUDA device, gloo the CPU stand-in)")
        self.device = device
        self.recorder = recorder if recorder is not None else (device.recorder if device is not None else None)
        self.registry = registry if registry is not None else ConflictRegistry.for_topology(topology)
        self.delay_s = dict(delay_s or {})
        """Fault knob: extra seconds a collective of that phase keeps running (and its slot)."""
        self._members = {ATTN_TP_P: topology.tp_group, ATTN_DP_D: topology.dp_group}
        self._lock = threading.Lock()
        self._seq: dict[str, int] = {ATTN_TP_P: 0, ATTN_DP_D: 0}        # enqueued per communicator
        self.joined: dict[str, int] = {ATTN_TP_P: 0, ATTN_DP_D: 0}      # launched (entered) per communicator
        self.completed: dict[str, int] = {ATTN_TP_P: 0, ATTN_DP_D: 0}
        self.inflight: dict[tuple[str, int], dict] = {}
        self.last_progress = time.monotonic()
        self.on_complete: list[Callable[[dict], None]] = []

    # ------------------------------------------------------------------ identity
    def kind(self, phase: Phase, op: str) -> CollectiveKind:
        k = _OPS.get((phase.value, op))
        if k is None:
            allowed = "all_reduce" if phase is Phase.PREFILL else "all_gather / reduce_scatter"
            raise ValueError(f"phase {phase.name} has no attention {op!r} (it uses {allowed})")
        return k

    def group_of(self, phase: Phase) -> tuple[str, tuple[int, ...], Any]:
        comm = ATTN_TP_P if phase is Phase.PREFILL else ATTN_DP_D
        return comm, self._members[comm], self.groups[comm]

    # ------------------------------------------------------------------ blocking calls
    def all_reduce(self, phase: Phase, t: torch.Tensor) -> torch.Tensor:
        """P: sum over this rank's attention-TP group (in place; returns ``t``)."""
        import torch.distributed as dist
        self.kind(phase, "all_reduce")
        _, members, pg = self.group_of(phase)
        if len(members) > 1 or self.native:
            dist.all_reduce(t, group=pg)
        return t

    def all_gather(self, phase: Phase, t: torch.Tensor) -> torch.Tensor:
        """D: concatenate (dim 0) the rows of every rank of this rank's DP-attention group."""
        import torch.distributed as dist
        self.kind(phase, "all_gather")
        _, members, pg = self.group_of(phase)
        if self.native:
            out = t.new_empty((len(members) * t.shape[0], *t.shape[1:]))
            _native_op(dist, "all_gather_single", "all_gather_into_tensor")(out, t.contiguous(), group=pg)
            return out
        if len(members) == 1:
            return t.clone()
        out = [torch.empty_like(t) for _ in members]
        dist.all_gather(out, t.contiguous(), group=pg)
        return torch.cat(out, 0)

    def reduce_scatter(self, phase: Phase, t: torch.Tensor) -> torch.Tensor:
        """D: sum over the DP-attention group, then this rank's chunk of dim 0 (gloo has no
        native reduce-scatter: all-reduce + chunk, same result)."""
        import torch.distributed as dist
        self.kind(phase, "reduce_scatter")
        _, members, pg = self.group_of(phase)
        n = len(members)
        if t.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim 0 ({t.shape[0]}) not divisible by the group size {n}")
        if self.native:
            out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
            _native_op(dist, "reduce_scatter_single", "reduce_scatter_tensor")(out, t.contiguous(), group=pg)
            return out
        if n > 1:
            t = t.clone()
            dist.all_reduce(t, group=pg)
        return t.chunk(n, 0)[members.index(self.topology.rank)].clone()

    # ------------------------------------------------------------------ launched on a stream
    def launch(self, phase: Phase, op: str, tensor: torch.Tensor | Callable[[], torch.Tensor], *, stream: str,
               epoch: int | None = None, boundary: int | None = None, deps: Iterable[Work | None] = (),
               extra: dict | None = None) -> Work:
        """Enqueue the collective on ``stream`` of the device; returns the stream item.

        ``tensor`` may be a zero-argument callable: it is then called on the stream (on CUDA the
        input is produced on the collective's own stream). Trace: ``coll_enqueue`` now (host
        order), ``coll_launch`` when it starts on the device (holding a residency slot until
        every peer joined), ``coll_done`` at completion (CUDA: when its end event fired).
        """
        if self.device is None:
            raise DistributedError("PhaseCollectives.launch needs a device")
        kind = self.kind(phase, op)
        comm, members, _ = self.group_of(phase)
        registered = self.registry.is_registered(kind)
        with self._lock:
            self._seq[comm] += 1
            seq = self._seq[comm]
        info = {"name": kind.name, "phase": phase.value, "op": op, "comm": comm, "group": list(members),
                "seq": seq, "stream": stream, "epoch": epoch, "boundary": boundary,
                "registered": registered, "state": "queued", **(extra or {})}
        fn = {"all_reduce": self.all_reduce, "all_gather": self.all_gather,
              "reduce_scatter": self.reduce_scatter}[op]
        make = tensor if callable(tensor) else (lambda: tensor)
        delay = self.delay_s.get(phase, 0.0)
        if self.device.kind == "cuda":
            from .cuda_device import cuda_collective_item
            item = cuda_collective_item(self, info, phase, fn, make, delay)
        else:
            item = self._cpu_item(info, phase, fn, make, delay)
        with self._lock:
            self.inflight[(comm, seq)] = info
        if self.recorder is not None:
            self.recorder.event("coll_enqueue", **_ev(info))
        return self.device.stream(stream).submit(with_deps(item, deps), label=f"{kind.name}#{seq}")

    def _cpu_item(self, info: dict, phase: Phase, fn: Callable, make: Callable, delay: float) -> Callable:
        def run() -> torch.Tensor:
            t0 = self._started(info)
            try:
                out = fn(phase, make())
            except Exception as exc:  # transport failure: name the collective and the group
                raise self._failure(info, exc) from exc
            if delay > 0:
                time.sleep(delay)           # delayed completion (fault knob): keeps the slot
            self._completed(info, t0, self._now())
            return out
        return run

    # ------------------------------------------------------------------ bookkeeping (any device)
    def _now(self) -> float:
        return self.recorder.now() if self.recorder is not None else 0.0

    def _started(self, info: dict) -> float:
        """The collective now occupies the device (it joined its communicator's current call)."""
        with self._lock:
            self.joined[info["comm"]] += 1
            info["state"] = "running"
        t0 = self._now()
        info["t_launch"] = t0
        if self.recorder is not None:
            self.recorder.event("coll_launch", **_ev(info))
        return t0

    def _completed(self, info: dict, t0: float, t1: float) -> None:
        """The collective completed; ``t0`` / ``t1`` its device interval (recorder seconds)."""
        info["t0"], info["t1"] = t0, t1
        with self._lock:
            self.completed[info["comm"]] += 1
            self.inflight.pop((info["comm"], info["seq"]), None)
            info["state"] = "done"
            self.last_progress = time.monotonic()
        rec = self.recorder
        if rec is not None:
            rec.event("coll_done", **_ev(info))
            rec.event("work", what=info["name"], phase=info["phase"], kind="coll", stream=info["stream"],
                      registered=info["registered"], epoch=info["epoch"], boundary=info["boundary"], t0=t0, t1=t1)
        for cb in self.on_complete:
            cb(info)

    def _failure(self, info: dict, exc: BaseException) -> DistributedError:
        info["state"] = "failed"
        return DistributedError(
            f"rank {self.topology.rank}: {info['name']} #{info['seq']} over group {tuple(info['group'])} failed "
            f"(epoch {info['epoch']}, boundary {info['boundary']}): {exc}")

    def frontier(self) -> dict:
        """What this rank has in flight (for the watchdog)."""
        with self._lock:
            return {"joined": dict(self.joined), "completed": dict(self.completed),
                    "enqueued": dict(self._seq),
                    "inflight": [{k: v for k, v in i.items()} for i in self.inflight.values()]}


def _native_op(dist: Any, name: str, older: str) -> Callable:
    """The tensor-native collective under its current name (torch >= 2.13) or its older one."""
    return getattr(dist, name, None) or getattr(dist, older)


def _ev(info: dict) -> dict:
    out = {k: info[k] for k in ("phase", "op", "comm", "group", "stream", "epoch", "boundary",
                                "registered", "iter") if k in info}
    out["coll"] = info["name"]
    out["cseq"] = info["seq"]          # per-communicator sequence ("seq" is the trace's own counter)
    return out


# ====================================================================== TP-sharded attention
def shard_attention(model: Any, tp_rank: int, atp: int) -> Any:
    """A copy of ``model`` whose attention keeps only TP shard ``tp_rank`` of ``atp``.

    Query heads and KV heads are split into ``atp`` contiguous blocks (GQA groups stay
    together: local query head h uses local KV head h // (H / Hk), as globally); ``wqkv`` (and
    its bias ``bqkv``) keeps the matching rows and ``wo`` the matching columns; the output bias
    ``bo`` stays on TP rank 0 only (the shards' outputs are summed). Everything else (norms,
    QK-norms, router, experts, embeddings, head) is replicated. The shard's KV cache has ``Hk / atp`` heads.
    Summing the shards' attention outputs (``attn_reduce``) gives the full output.
    """
    from ..engine.model import MoETransformer

    c = model.cfg
    H, Hk, hd = c.num_heads, c.num_kv_heads, c.head_dim
    if atp < 1 or Hk % atp or H % atp:
        raise TopologyError(f"attention TP {atp} must divide num_heads={H} and num_kv_heads={Hk}")
    if not 0 <= tp_rank < atp:
        raise TopologyError(f"tp_rank {tp_rank} outside [0, {atp})")
    if atp == 1:
        return model
    hq, hk = H // atp, Hk // atp
    cs = dataclasses.replace(c, num_heads=hq, num_kv_heads=hk)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(c.torch_dtype)
    try:
        with torch.device(model.embed.device):
            shard = MoETransformer(cs, model.expert_range)
    finally:
        torch.set_default_dtype(prev)
    shard.requires_grad_(False)
    q_rows = torch.arange(tp_rank * hq * hd, (tp_rank + 1) * hq * hd)
    k_rows = H * hd + torch.arange(tp_rank * hk * hd, (tp_rank + 1) * hk * hd)
    v_rows = (H + Hk) * hd + torch.arange(tp_rank * hk * hd, (tp_rank + 1) * hk * hd)
    rows = torch.cat([q_rows, k_rows, v_rows])
    src = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in shard.named_parameters():
            s = src[name]
            if name.endswith((".wqkv", ".bqkv")):
                p.copy_(s.index_select(0, rows))
            elif name.endswith(".bo"):
                p.copy_(s if tp_rank == 0 else torch.zeros_like(s))
            elif name.endswith(".wo"):
                p.copy_(s[:, tp_rank * hq * hd:(tp_rank + 1) * hq * hd])
            else:
                p.copy_(s)
    return shard


def tp_attn_reduce(colls: PhaseCollectives, phase: Phase = Phase.PREFILL) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``attn_reduce`` hook of a TP-sharded forward: all-reduce of the partial attention
    output over this rank's attention-TP group (P: the full-TP all-reduce)."""

    def reduce(o: torch.Tensor) -> torch.Tensor:
        o = o.contiguous()
        return colls.all_reduce(phase, o)

    return reduce
