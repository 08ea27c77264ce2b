"""Expert parallelism over ``torch.distributed`` all-to-all (gloo on CPU, NCCL on GPU).

Shape legend: T = tokens on this rank, k = top-k, D = hidden, E = experts, L = E / ep
local experts, S = rows sent (valid (token, slot) pairs), R = rows received.

- notify  = async all_to_all of the per-(destination rank, local expert) counts
            ``[ep, L]`` over the phase's OWN process group (peers learn the shape);
- dispatch = ``all_to_all_single`` of the S rows with split sizes from the counts, then
            local regrouping of the R rows from (source, expert) to (expert, source) order;
- combine  = the reverse ``all_to_all_single`` + weighted sum over top-k.

Each phase owns its group, send/recv buffers, counters, workspace, stream and events
(D also a double-buffer index), so P and D run concurrently from two threads without
sharing mutable state. NOTE: with gloo, two collectives on the SAME group from two
threads at once are unsafe: that is exactly why each phase owns its group.

Rows are sent once per (token, slot) pair (DeepEP dedups per destination rank; this
backend keeps the simpler layout). Buffers are preallocated for ``max_tokens`` tokens
(receive side: the worst case ``ep * max_tokens * k`` rows).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...errors import CollectiveFailedError, ConfigError
from ...phase import Phase
from .base import (BaseDispatcher, Dispatched, DoubleBufferIndex, LifetimeToken, Notified,
                   RecvCounts, expert_keys, make_event, make_stream, qp_slice)


def new_phase_groups(ranks: Sequence[int] | None = None,
                     backend: str | None = None) -> dict[Phase, Any]:
    """One expert-parallel process group per phase (collective: every rank calls it, in order)."""
    p = dist.new_group(list(ranks) if ranks is not None else None, backend=backend)
    d = dist.new_group(list(ranks) if ranks is not None else None, backend=backend)
    return {Phase.PREFILL: p, Phase.DECODE: d}


class TorchAllToAllDispatcher(BaseDispatcher):
    backend = "torch"

    def __init__(self, phase: Phase, group: Any, ep_rank: int, ep_size: int, num_experts: int,
                 *, hidden: int, top_k: int, max_tokens: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", stream: Any = None, recorder: Any = None,
                 num_qps: int = 1) -> None:
        super().__init__(phase, num_experts=num_experts, ep_rank=ep_rank, ep_size=ep_size,
                         recorder=recorder)
        if group is None:
            raise ConfigError("TorchAllToAllDispatcher needs the phase's own process group")
        if dist.get_world_size(group) != ep_size or dist.get_rank(group) != ep_rank:
            raise ConfigError(f"group has size {dist.get_world_size(group)} / rank "
                              f"{dist.get_rank(group)}; expected ep_size={ep_size} ep_rank={ep_rank}")
        if hidden < 1 or top_k < 1 or max_tokens < 1 or top_k > num_experts:
            raise ConfigError(f"bad dispatcher sizes: hidden={hidden} top_k={top_k} "
                              f"max_tokens={max_tokens} num_experts={num_experts}")
        dev = torch.device(device)
        self.group = group
        self.hidden, self.top_k, self.max_tokens, self.dtype, self.device = hidden, top_k, max_tokens, dtype, dev
        rows = max_tokens * top_k
        recv_rows = rows * ep_size
        L = self.num_local_experts
        i64 = dict(dtype=torch.int64, device=dev)
        act = dict(dtype=dtype, device=dev)
        # counters
        self._send_counts = torch.zeros(num_experts + 1, **i64)      # [E + 1] (bucket E: -1)
        self._recv_counts = torch.zeros(ep_size, L, **i64)           # [ep (source), L]
        # workspace
        self._ones = torch.ones(rows, **i64)
        self._sorted = torch.empty(rows, **i64)
        self._order = torch.empty(rows, **i64)
        self._tok = torch.empty(rows, **i64)
        self._gather = torch.empty(recv_rows, **i64)
        # buffers (D double-buffers the received rows)
        self._dbi = DoubleBufferIndex() if phase is Phase.DECODE else None
        num_sets = 2 if self._dbi is not None else 1
        self._send_x = torch.empty(rows, hidden, **act)
        self._recv_x = [torch.empty(recv_rows, hidden, **act) for _ in range(num_sets)]
        self._grouped = [torch.empty(recv_rows, hidden, **act) for _ in range(num_sets)]
        self._back = torch.empty(recv_rows, hidden, **act)
        self._ret = torch.empty(rows, hidden, **act)
        self._pairs = torch.empty(rows, hidden, **act)
        self.stream = stream if stream is not None else make_stream(dev, f"{phase.value}-expert-stream")
        self.events = {n: make_event(dev, f"{phase.value}-{n}") for n in ("notify_done", "combine_done")}
        self._outstanding: list[Any] = []   # async works not yet waited (counts exchange)
        self._register(num_qps)

    def _register(self, num_qps: int) -> None:
        ph, tag, reg = self.phase, f"{self.phase.value}.torch", self._owned
        reg.register("counters", f"{tag}.send_counts", ph, self._send_counts)
        reg.register("counters", f"{tag}.recv_counts", ph, self._recv_counts)
        for name in ("ones", "sorted", "order", "tok", "gather"):
            reg.register("workspace", f"{tag}.{name}", ph, getattr(self, f"_{name}"))
        reg.register("buffer", f"{tag}.send_x", ph, self._send_x)
        for i in range(len(self._recv_x)):
            reg.register("buffer", f"{tag}.recv_x[{i}]", ph, self._recv_x[i])
            reg.register("buffer", f"{tag}.grouped[{i}]", ph, self._grouped[i])
        for name in ("back", "ret", "pairs"):
            reg.register("buffer", f"{tag}.{name}", ph, getattr(self, f"_{name}"))
        reg.register("stream", f"{ph.value}.stream", ph, self.stream)
        for n, ev in self.events.items():
            reg.register("events", f"{ph.value}.{n}", ph, ev)
        reg.register("process_group", f"{tag}.group", ph, self.group)
        reg.register("qp_range", f"{tag}.qp_range", ph, identity=id(self) ^ 0x9E37,
                     qp_range=qp_slice(ph, num_qps),
                     note="logical slice: gloo/NCCL groups own their channels")
        if self._dbi is not None:
            reg.register("double_buffer_index", f"{tag}.double_buffer_index", ph, self._dbi)

    @contextlib.contextmanager
    def _on_phase_stream(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        cur = torch.cuda.current_stream(self.device)   # pragma: no cover - GPU host only
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            yield
        cur.wait_stream(self.stream)

    @contextlib.contextmanager
    def _transport(self, what: str) -> Iterator[None]:
        """Around the ``torch.distributed`` calls only: a transport failure (gloo / NCCL raise
        RuntimeError subclasses when a peer dies or closes its connection) becomes a typed
        :class:`CollectiveFailedError` naming this phase's group."""
        try:
            yield
        except RuntimeError as exc:
            ranks = tuple(dist.get_process_group_ranks(self.group))
            raise CollectiveFailedError(
                f"rank {dist.get_rank()}: {self.phase.value} expert {what} over ranks {list(ranks)} failed "
                f"(a peer of the group died or failed): {exc}", group_ranks=ranks) from exc

    # ---- notify: counts exchange ----
    def _notify_impl(self, topk_idx: Tensor, seq: int,
                     tokens: tuple[LifetimeToken, ...]) -> Notified:
        T, k = topk_idx.shape
        if T > self.max_tokens or k != self.top_k:
            raise ConfigError(f"{self.phase.value} dispatch of [{T}, {k}] exceeds "
                              f"max_tokens={self.max_tokens} / top_k={self.top_k}")
        E, ep, L, n = self.num_experts, self.ep_size, self.num_local_experts, T * k
        with self._on_phase_stream():
            keys = expert_keys(topk_idx, E)                                     # [n]
            self._send_counts.zero_()
            self._send_counts.scatter_add_(0, keys, self._ones[:n])             # [E + 1]
            torch.sort(keys, stable=True, out=(self._sorted[:n], self._order[:n]))
            torch.div(self._order[:n], k, rounding_mode="floor", out=self._tok[:n])
            send_mat = self._send_counts[:E].view(ep, L)                        # [ep (dest), L]
            with self._transport("counts all-to-all"):
                work = dist.all_to_all_single(self._recv_counts, send_mat, group=self.group,
                                              async_op=True)
        self._outstanding.append(work)
        _record(self.events["notify_done"])

        def wait() -> RecvCounts:
            with self._transport("counts all-to-all"):
                work.wait()
            with contextlib.suppress(ValueError):
                self._outstanding.remove(work)
            recv = self._recv_counts.tolist()                                   # [ep][L] host
            send_splits = [int(v) for v in send_mat.sum(1).tolist()]            # rows per dest
            notified.impl["send_splits"] = send_splits
            notified.impl["recv_matrix"] = recv
            return RecvCounts(per_expert=tuple(sum(r[l] for r in recv) for l in range(L)),
                              per_source=tuple(sum(r) for r in recv))

        notified = Notified(self, seq, tokens, T, ready=work.is_completed, wait=wait)
        notified.impl.update(n=n, T=T)
        return notified

    # ---- dispatch: routed data movement ----
    def _dispatch_impl(self, notified: Notified, x: Tensor, topk_idx: Tensor,
                       topk_weights: Tensor) -> Dispatched:
        counts = notified.counts
        send_splits = notified.impl["send_splits"]
        S, R = sum(send_splits), counts.total
        buf = self._dbi.flip() if self._dbi is not None else 0
        with self._on_phase_stream():
            send_x = self._send_x[:S]
            torch.index_select(x, 0, self._tok[:S], out=send_x)                 # [S, D] by dest
            recv_x = self._recv_x[buf][:R]
            with self._transport("dispatch all-to-all"):
                dist.all_to_all_single(recv_x, send_x, output_split_sizes=list(counts.per_source),
                                       input_split_sizes=send_splits, group=self.group)
            # (source, expert) blocks -> (expert, source) blocks
            flat = self._recv_counts.reshape(-1)                                # [ep * L]
            starts = torch.cumsum(flat, 0) - flat                               # recv-order starts
            blk = torch.arange(flat.numel(), device=self.device).view(
                self.ep_size, self.num_local_experts).t().reshape(-1)           # grouped block order
            lens, bstarts = flat[blk], starts[blk]
            gstarts = torch.cumsum(lens, 0) - lens
            gather = self._gather[:R]
            torch.add(torch.arange(R, device=self.device),
                      torch.repeat_interleave(bstarts - gstarts, lens, output_size=R), out=gather)
            grouped = self._grouped[buf][:R]
            torch.index_select(recv_x, 0, gather, out=grouped)                  # [R, D]
            per_expert = self._recv_counts.sum(0)                               # [L]
        return Dispatched(notified, grouped, per_expert,
                          impl={"S": S, "R": R, "w": topk_weights.to(self.dtype),
                                "valid": topk_idx >= 0})

    # ---- combine: reverse all-to-all + weighted top-k sum ----
    def _combine_impl(self, dispatched: Dispatched, expert_out: Tensor) -> Tensor:
        nt = dispatched.notified
        S, R, T = dispatched.impl["S"], dispatched.impl["R"], nt.impl["T"]
        if expert_out.shape[0] != R:
            raise ConfigError(f"expert_out has {expert_out.shape[0]} rows, dispatch gave {R}")
        with self._on_phase_stream():
            back = self._back[:R]
            back.index_copy_(0, self._gather[:R], expert_out)                   # recv order
            ret = self._ret[:S]
            with self._transport("combine all-to-all"):
                dist.all_to_all_single(ret, back, output_split_sizes=nt.impl["send_splits"],
                                       input_split_sizes=list(nt.counts.per_source), group=self.group)
            pairs = self._pairs[: nt.impl["n"]]
            pairs.index_copy_(0, self._order[:S], ret)                          # (token, slot) order
            y = pairs.view(T, self.top_k, self.hidden)                          # [T, k, D]
            w, valid = dispatched.impl["w"], dispatched.impl["valid"]
            out = torch.where(valid.unsqueeze(-1), y * w.unsqueeze(-1), 0).sum(1)  # [T, D]
        _record(self.events["combine_done"])
        return out

    def _drain_impl(self) -> None:
        """Wait for every outstanding collective of this phase's group (quiescent point)."""
        while self._outstanding:
            with self._transport("counts all-to-all"):
                self._outstanding.pop().wait()
        if self.device.type == "cuda":  # pragma: no cover - GPU host only
            self.stream.synchronize()


def _record(ev: Any) -> None:
    if hasattr(ev, "record"):
        ev.record()
