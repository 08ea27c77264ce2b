"""All-rank CPU rendezvous for the turnstile (SPEC 3.2), awaited from the event loop.

Every implementation follows the :class:`Rendezvous` protocol: ``await rdv.arrive(tag, payload,
epoch=, boundary=)`` returns every rank's payload (index = rank) once all ranks have arrived
at the same rendezvous. The caller checks agreement (:func:`~ainfer_pd.turnstile.rendezvous.assert_agree`). Ranks must
arrive at the same sequence of tags; a different tag at the same round raises
:class:`RendezvousMismatch`. A rendezvous that does not complete within ``timeout_s`` raises
:class:`RendezvousTimeout` naming the missing ranks, the epoch and the boundary; after a
timeout or transport failure the object is broken (further ``arrive`` raises
:class:`DistributedError`).

* :class:`GlooRendezvous`: every rank's fixed-size int64 row exchanged over a dedicated gloo group
  (a plain ``all_gather``, or optionally a SUM all-reduce of a zeroed (world, row) board).
  The blocking collective runs on a dedicated daemon thread (``mode="thread"``, default) or is
  issued with ``async_op=True`` and polled from the loop (``mode="poll"``). Each rank bumps its
  arrival counter in the ``torch.distributed`` store before entering the collective, so a
  timeout can name who never arrived.
* :class:`ShmRendezvous`: same-host fast path. A shared-memory board (an mmap of a file in
  /dev/shm) with one block per rank: arrival sequence number plus two payload rows (indexed by
  sequence parity, so a fast rank writing round k+1 never overwrites a row a slow rank still
  reads for round k). Arrive = write own row, publish own sequence number, wait until every
  rank's sequence number is >= ours, read. The wait polls inline for at most a few tens of
  microseconds, then hands off to a waiter thread (spin with ``sched_yield``, then short sleeps
  with backoff) that resolves a future via ``call_soon_threadsafe``. The board file is unlinked by rank 0 as soon as every rank has
  mapped it, so no segment leaks even if a process is killed later.
* :func:`make_rendezvous` picks shm when ``fast_rendezvous`` and all ranks share a host,
  otherwise gloo; a single rank gets :class:`~ainfer_pd.turnstile.rendezvous.LocalRendezvous`.

Homes: the protocol, the agreement check and the world-size-1 rendezvous in
:mod:`.rendezvous`; the row codec and checks every implementation shares in
:mod:`.rendezvous_base`; gloo in :mod:`.gloo_rendezvous`; shared memory in
:mod:`.shm_rendezvous`. This module holds the choice (:func:`make_rendezvous`,
:func:`detect_same_host`) and re-exports the implementations.

Memory ordering of the board relies on x86-64 TSO (aligned 8-byte stores are atomic, stores
are not reordered with stores nor loads with loads); it is not meant for weakly ordered CPUs.
"""
from __future__ import annotations

import datetime as _dt
import socket
from typing import Any

from .gloo_rendezvous import GlooRendezvous
from .rendezvous import LocalRendezvous, Rendezvous, assert_agree
from .rendezvous_base import MAX_PAYLOAD
from .shm_rendezvous import ShmRendezvous

__all__ = ["Rendezvous", "GlooRendezvous", "ShmRendezvous", "LocalRendezvous", "make_rendezvous",
           "assert_agree", "detect_same_host", "MAX_PAYLOAD"]


def detect_same_host(store: Any, rank: int, world_size: int, *, key: str = "ainfer_pd/host",
                     timeout_s: float = 30.0) -> bool:
    """True when every rank reports the same host identity (hostname + boot id).

    Collective over the store: every rank must call it with the same ``key``.
    """
    ident = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            ident += "/" + f.read().strip()
    except OSError:
        pass
    store.set(f"{key}/{rank}", ident)
    keys = [f"{key}/{r}" for r in range(world_size)]
    store.wait(keys, _dt.timedelta(seconds=timeout_s))
    return all(store.get(k).decode() == ident for k in keys)


def make_rendezvous(parallel_cfg: Any, topology: Any, *, same_host: bool, group: Any = None,
                    store: Any = None, name: str | None = None, **kwargs: Any) -> Rendezvous:
    """The rendezvous for this rank: shm when ``parallel_cfg.fast_rendezvous`` and
    ``same_host``, otherwise gloo over ``group`` (default: a new gloo group over the world;
    pass ``build_process_groups(...)["control"]``). Collective: every rank calls it in the same
    order. ``kwargs`` go to the implementation (``mode=``, ``loop_spin_s=``, ``max_payload=``)."""
    timeout = parallel_cfg.rendezvous_timeout_s
    if topology.world_size == 1:
        return LocalRendezvous(timeout, **{k: v for k, v in kwargs.items() if k == "max_payload"})
    if parallel_cfg.fast_rendezvous and same_host:
        if store is None:
            from ..launch import get_store
            store = get_store()
        return ShmRendezvous(topology.rank, topology.world_size, timeout, store=store, name=name, **kwargs)
    return GlooRendezvous(group, timeout, store=store, name=name, **kwargs)
