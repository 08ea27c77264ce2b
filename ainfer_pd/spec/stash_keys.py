"""A replica leader's names for its trajectories' MTP stashes on its TP followers (``spec.method: mtp``
under attention TP).

A TP follower keeps a mirror of its leader's stashes (:class:`~.mtp.MtpDrafter` keyed by these ints
instead of trajectory ids: the follower knows no trajectory), written and read by the catch-ups and
draft chains it receives from its leader (:mod:`ainfer_pd.engine.runtime.mtp_wire`). A key is given
the first time a trajectory's stash travels and never reused, so a follower that drops a key late
(the drop travels at the next step: :meth:`ainfer_pd.engine.loop.mtp_replica.MtpReplica.drop_stashes`) never
drops another trajectory's stash. Touched only from the leader's event loop.
"""
from __future__ import annotations

import itertools


class StashKeys:
    """Trajectory id -> the int its stash has on the followers; the keys of forgotten trajectories
    waiting to go to the followers (:attr:`dropped`, oldest first)."""

    def __init__(self) -> None:
        self._keys: dict[str, int] = {}
        self._next = itertools.count()
        self.dropped: list[int] = []

    def of(self, tid: str) -> int:
        """``tid``'s key, given now if it has none."""
        key = self._keys.get(tid)
        if key is None:
            key = self._keys[tid] = next(self._next)
        return key

    def forget(self, tid: str) -> None:
        """``tid``'s stash went (released, rolled back): its key goes to the followers' drops."""
        key = self._keys.pop(tid, None)
        if key is not None:
            self.dropped.append(key)

    def forget_all(self) -> None:
        """Every stash went (the KV pool was released)."""
        self.dropped.extend(self._keys.values())
        self._keys.clear()

    def take(self, n: int) -> list[int]:
        """The ``n`` oldest dropped keys (announced at a step), no longer pending."""
        out, self.dropped = self.dropped[:n], self.dropped[n:]
        return out

    def __len__(self) -> int:
        return len(self._keys)
