"""Progress watchdog of one rank: no progress for ``stall_s`` seconds while device work is
pending -> :class:`StallError` with the cross-rank frontier.

Progress is any change of the rank's progress key (completed collectives, D iterations,
P segments, completed requests); an idle rank (nothing pending on its device: clients in their
tool waits) is never stalled. On a stall every rank publishes its local frontier (completed
requests, D iterations and P segments, collectives in flight with communicator, group, phase,
sequence number, stream and state, and how many collectives it has *joined* per communicator) in the
``torch.distributed`` store, waits briefly for its peers' frontiers, and raises a
:class:`StallError` whose message says, for every collective running on a rank (holding a
residency slot), which peers have not joined it, and names the device-progress cycle when the
wait-for graph has one.

A heartbeat thread writes ``hb/<rank>`` into the store every ``heartbeat_s``; after any
failure :meth:`Watchdog.unresponsive` names the ranks whose heartbeat stopped (dead or
wedged processes), which turns "connection closed by peer" into "rank 3 is gone".
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import PeerLostError, StallError

__all__ = ["Watchdog", "describe_frontier", "find_wait_cycle"]


class Watchdog:
    def __init__(self, *, rank: int, world_size: int, stall_s: float, progress: Callable[[], Any],
                 probe: Callable[[], dict], store: Any = None, prefix: str = "ainfer_pd/mr",
                 heartbeat_s: float = 0.25, peer_wait_s: float = 1.5, poll_s: float = 0.05,
                 busy: Callable[[], bool] | None = None, error: type[StallError] = StallError) -> None:
        if stall_s <= 0:
            raise ValueError("stall_s must be > 0")
        self.rank, self.world_size = rank, world_size
        self.stall_s = float(stall_s)
        self._progress, self._probe = progress, probe
        self._busy = busy or (lambda: True)
        self._error = error
        """What a device-progress stall raises (:class:`~ainfer_pd.errors.DeviceStallError` on one rank)."""
        self._store = store
        self.prefix = prefix
        self.heartbeat_s, self.peer_wait_s, self.poll_s = heartbeat_s, peer_wait_s, poll_s
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None
        self.report: dict | None = None
        self.stalling = False
        """A stall was detected and its report is being assembled."""

    # ------------------------------------------------------------------ store helpers
    def _set(self, key: str, value: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"{self.prefix}/{key}", value)
        except Exception:  # the store host may be gone: reporting is best effort
            pass

    def _get(self, key: str) -> str | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([f"{self.prefix}/{key}"]):
                return None
            return self._store.get(f"{self.prefix}/{key}").decode()
        except Exception:
            return None

    # ------------------------------------------------------------------ heartbeat
    def start(self) -> None:
        if self._store is None or self._hb is not None:
            return

        def beat() -> None:
            while not self._stop.is_set():
                self._set(f"hb/{self.rank}", repr(time.time()))
                self._stop.wait(self.heartbeat_s)

        self._set(f"hb/{self.rank}", repr(time.time()))
        self._hb = threading.Thread(target=beat, name=f"ainfer-pd-hb-r{self.rank}", daemon=True)
        self._hb.start()

    def stop(self) -> None:
        self._stop.set()

    def unresponsive(self, stale_s: float = 1.0) -> list[int]:
        """Ranks whose heartbeat is older than ``stale_s`` (or absent)."""
        now = time.time()
        out = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            v = self._get(f"hb/{r}")
            try:
                if v is None or now - float(v) > stale_s:
                    out.append(r)
            except ValueError:
                out.append(r)
        return out

    # ------------------------------------------------------------------ stall
    async def watch(self) -> None:
        """Return never; raise :class:`StallError` (or :class:`PeerLostError` when a peer's
        heartbeat stopped) once progress stops for ``stall_s``."""
        last_key = self._progress()
        last_t = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_s)
            key = self._progress()
            now = time.monotonic()
            if key != last_key or not self._busy():
                last_key, last_t = key, now
                continue
            if now - last_t >= self.stall_s:
                raise await self.stall_error(now - last_t)

    async def stall_error(self, idle_s: float) -> StallError | PeerLostError:
        """The report of a stall: :class:`PeerLostError` when some peer's heartbeat stopped
        (a dead or wedged process, named), else :class:`StallError` (a device-progress stall)."""
        self.stalling = True
        local = self._probe()
        local["rank"] = self.rank
        lost = self.unresponsive(stale_s=max(1.0, 4 * self.heartbeat_s))
        # a peer that published its own stall frontier and then exited (torchrun: each rank
        # leaves on its own) is part of this stall, not a lost peer
        lost = [r for r in lost if self._get(f"frontier/{r}") is None]
        local["lost_peers"] = lost
        self._set(f"frontier/{self.rank}", json.dumps(local, default=str))
        if self._get("stall") is None:
            self._set("stall", str(self.rank))
        frontiers: dict[int, dict] = {self.rank: local}
        waiting_for = [r for r in range(self.world_size) if r not in lost]
        end = time.monotonic() + self.peer_wait_s
        while True:
            for r in waiting_for:
                if r not in frontiers:
                    v = self._get(f"frontier/{r}")
                    if v is not None:
                        frontiers[r] = json.loads(v)
            if all(r in frontiers for r in waiting_for) or time.monotonic() >= end:
                break
            await asyncio.sleep(0.05)
        text, cycle = describe_frontier(frontiers, self.world_size)
        self.report = {"idle_s": idle_s, "frontiers": frontiers, "cycle": cycle, "lost_peers": lost}
        head = f"rank {self.rank}: no progress for {idle_s:.1f} s (watchdog {self.stall_s:g} s)"
        exc: StallError | PeerLostError
        if lost:
            names = ", ".join(f"rank {r}" for r in lost)
            exc = PeerLostError(f"{head}: peer {names} stopped responding (no heartbeat: dead or wedged).\n{text}",
                                ranks=tuple(lost))
        else:
            exc = self._error(f"{head}: device-progress stall.\n{text}")
        exc.frontier = {str(r): f for r, f in frontiers.items()}  # type: ignore[attr-defined]
        exc.cycle = cycle  # type: ignore[attr-defined]
        exc.lost_peers = lost  # type: ignore[attr-defined]
        exc.rank = self.rank  # type: ignore[attr-defined]
        exc.unfinished = local.get("unfinished", [])  # type: ignore[attr-defined]
        return exc

    def peer_declared_stall(self) -> int | None:
        v = self._get("stall")
        return None if v is None else int(v)


def _not_joined(coll: dict, frontiers: dict[int, dict]) -> list[int | str]:
    out: list[int | str] = []
    for q in coll.get("group", []):
        f = frontiers.get(q)
        if f is None:
            out.append(f"{q}?")
            continue
        if f.get("colls", {}).get("joined", {}).get(coll["comm"], 0) < coll["seq"]:
            out.append(q)
    return out


def find_wait_cycle(frontiers: dict[int, dict]) -> list[int]:
    """A cycle of the wait-for graph (rank -> peers that have not joined its running
    collective), as a list of ranks, or [] if there is none."""
    edges: dict[int, list[int]] = {}
    for r, f in frontiers.items():
        for c in f.get("colls", {}).get("inflight", []):
            if c.get("state") == "running":
                edges.setdefault(r, []).extend(q for q in _not_joined(c, frontiers) if isinstance(q, int))
    color: dict[int, int] = {}
    stack: list[int] = []

    def dfs(u: int) -> list[int]:
        color[u] = 1
        stack.append(u)
        for v in edges.get(u, []):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if color.get(v) is None:
                cyc = dfs(v)
                if cyc:
                    return cyc
        stack.pop()
        color[u] = 2
        return []

    for u in sorted(edges):
        if color.get(u) is None:
            cyc = dfs(u)
            if cyc:
                return cyc
    return []


def describe_frontier(frontiers: dict[int, dict], world_size: int) -> tuple[str, list[int]]:
    """Human-readable frontier (one line per rank and collective) and the wait cycle."""
    lines = []
    for r in range(world_size):
        f = frontiers.get(r)
        if f is None:
            lines.append(f"  rank {r}: no frontier report (dead, or not stalled)")
            continue
        done = f", completed requests {f['requests_done']}" if f.get("requests_done") is not None else ""
        lines.append(f"  rank {r}: completed D iterations {f.get('d_done')}, P segments {f.get('p_done')}{done}"
                     f"{', ' + f['note'] if f.get('note') else ''}")
        queued = []
        for c in f.get("colls", {}).get("inflight", []):
            if c["state"] == "admitting":
                lines.append(f"    {c['phase']} {c['op']} {c['comm']}#{c['seq']} group {tuple(c['group'])} on stream "
                             f"{c['stream']}: NOT ADMITTED (its stream reached it; it does not fit beside the "
                             f"collectives resident on this device)")
                continue
            if c["state"] != "running":
                queued.append(c)
                continue
            lines.append(f"    {c['phase']} {c['op']} {c['comm']}#{c['seq']} group {tuple(c['group'])} on stream "
                         f"{c['stream']} (epoch {c.get('epoch')}, boundary {c.get('boundary')}): RUNNING (resident: holds "
                         f"its slot), peers not joined: {_not_joined(c, frontiers)}")
        for u in f.get("unfinished", []):
            a = u.get("attrs", {})
            lines.append(f"    stream {u['stream']}: oldest unfinished item {u['label']} (lane {u.get('lane')}, "
                         f"phase {a.get('phase')}, epoch {a.get('epoch')}) unfinished for {u['age_s']:.1f} s, "
                         f"{u['state']}{', parked' if u.get('parked') else ''}; {u['count']} unfinished on the stream")
        if queued:
            heads = {}
            for c in queued:                       # the next one of each stream: what waits behind the slot
                heads.setdefault(c["stream"], c)
            lines.append(f"    {len(queued)} queued; next per stream: " + "; ".join(
                f"{st}: {c['phase']} {c['op']} {c['comm']}#{c['seq']} group {tuple(c['group'])}"
                for st, c in sorted(heads.items())))
    cycle = find_wait_cycle(frontiers)
    if world_size == 1:
        pass                                    # one rank waits for no peer: no wait-for graph
    elif cycle:
        parts = []
        for a, b in zip(cycle, cycle[1:]):
            run = [c for c in frontiers[a]["colls"]["inflight"] if c["state"] == "running"]
            desc = ", ".join(f"{c['phase']} {c['op']} {c['comm']}#{c['seq']}" for c in run)
            parts.append(f"rank {a} [{desc}] waits for rank {b}")
        lines.append("  device-progress cycle: " + " -> ".join(parts))
    else:
        lines.append("  no wait cycle found among the reported ranks")
    return "\n".join(lines), cycle
