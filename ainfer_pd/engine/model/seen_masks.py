"""The repetition penalty's seen-token masks, kept on the device across D iterations.

A penalized row's sampling needs the set of tokens its trajectory has seen (its context and what
the turn generated so far). Built afresh each step, that set is the row's whole history uploaded:
64 rows of 10K-token histories took 11.3 ms of host time a step on the H200 host (pinned staging
of 5 MB, then its copy), against 0.8 ms for the same rows unpenalized. Here each trajectory keeps
a slot of a ``[slots, V]`` boolean mask on the device, and a step uploads only the tokens its slot
has not seen yet (in the D loop: one a row), scattered into the slot in stream order.

The host history stays the source of truth: a slot caches ``history[:n]`` of one history object
(the turn's ``array('q')``, append-only). A row whose history is another object (a new turn), or
shorter than what its slot holds, starts its slot again; a slot not used by the current batch is
evicted first when the pool is full, and the pool grows when one batch needs more slots. Eviction
and growth cost uploads, never correctness.

One pool per user of it, on one stream: the D loop's (``ModelRunner.seen_masks``, used on the D
stream by :func:`~ainfer_pd.engine.loop.d_overlap.decode_sampled`). It is device memory of the
runner's: :meth:`release` gives it back (sleep, shutdown).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["SeenMasks"]

MIN_SLOTS = 16


@dataclass(slots=True)
class _Slot:
    index: int
    history: Any        # the history object the slot caches a prefix of
    n: int              # tokens of it in the mask


class SeenMasks:
    """Seen-token masks of penalized trajectories, one slot each, on the device."""

    def __init__(self) -> None:
        self.masks: Tensor | None = None            # [slots, V] bool
        self.slots: OrderedDict[str, _Slot] = OrderedDict()   # key -> its slot, least recently used first
        self.free: list[int] = []
        self.num_uploaded = 0
        """Token ids uploaded so far (a full history when a slot starts, then the new tokens)."""
        self.num_restarts = 0
        """Slots started (a trajectory seen first, a new turn, a shorter history, after an eviction)."""

    def release(self) -> None:
        """Give the device memory back; the next use starts every slot again."""
        self.masks = None
        self.slots.clear()
        self.free = []

    def gather(self, keys: list[str], histories: list, lengths: list[int], vocab: int, device: torch.device,
               to: Callable[[Tensor], Tensor]) -> Tensor:
        """[len(keys), vocab] bool: row i's mask of ``histories[i][:lengths[i]]`` (``keys[i]``: its
        trajectory, at most once in a call). Enqueued on the current stream; ``to`` moves a host
        tensor to ``device`` (the sampler's: pinned and non-blocking on the D loop)."""
        if self.masks is None or self.masks.shape[1] != vocab or self.masks.device != device:
            self.release()
            self._grow(max(MIN_SLOTS, len(keys)), vocab, device)
        elif len(keys) > self.masks.shape[0]:
            self._grow(max(len(keys), 2 * self.masks.shape[0]), vocab, device)
        using = set(keys)
        restart: list[int] = []
        flat: list[Tensor] = []
        rows: list[int] = []
        for key, hist, n in zip(keys, histories, lengths):
            s = self.slots.get(key)
            if s is None or s.history is not hist or s.n > n:
                if s is None:
                    s = self.slots[key] = _Slot(self._take(using), hist, 0)
                else:
                    s.history, s.n = hist, 0
                restart.append(s.index)
                self.num_restarts += 1
            self.slots.move_to_end(key)
            if n > s.n:
                new = torch.frombuffer(hist[s.n:n], dtype=torch.int64) if _is_q(hist) else \
                    torch.tensor(list(hist[s.n:n]), dtype=torch.int64)
                flat.append(new + s.index * vocab)
                self.num_uploaded += n - s.n
                s.n = n
            rows.append(s.index)
        masks = self.masks
        if restart:
            masks.index_fill_(0, to(torch.tensor(restart, dtype=torch.int64)), False)
        if flat:
            masks.view(-1).index_fill_(0, to(torch.cat(flat)), True)
        return masks.index_select(0, to(torch.tensor(rows, dtype=torch.int64)))

    def _take(self, using: set[str]) -> int:
        """A slot for a key not held: a free one, else the least recently used one no key of the
        current call holds (the caller grew the pool to the call's keys)."""
        if self.free:
            return self.free.pop()
        for key in self.slots:
            if key not in using:
                return self.slots.pop(key).index
        raise AssertionError("SeenMasks: no slot to take (the pool was not grown to the call's keys)")

    def _grow(self, slots: int, vocab: int, device: torch.device) -> None:
        old = self.masks
        have = 0 if old is None else old.shape[0]
        self.masks = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        if old is not None:
            self.masks[:have].copy_(old)
        self.free.extend(range(slots - 1, have - 1, -1))


def _is_q(hist) -> bool:
    return getattr(hist, "typecode", None) == "q"
