"""What verl's sleep / wake / release calls mean for a :class:`RolloutWorker` (pure policy).

verl 0.9.1's servers (``vllm_async_server.py``, ``async_sglang_server.py``) decide by rollout mode:

* ``sleep()``: nothing unless ``free_cache_engine`` and node rank 0. HYBRID (trainer and rollout
  share the GPUs, the naive sync follows) -> level 2, weights *discarded* (vLLM
  ``_resolve_sleep_level``; the trainer then calls ``resume(["weights"])``, syncs every tensor and
  ``resume(["kv_cache"])``). COLOCATED -> level 1 (KV pool freed, weights stay). STANDALONE: skipped.
* ``wake_up(tags)``: HYBRID the given tags (default both); COLOCATED both; STANDALONE skipped.
* ``release_kv_cache()`` / ``resume_kv_cache()`` (the checkpoint engine around a weight sync that
  writes into the existing weight buffers): free / reallocate the KV pool only, unless COLOCATED
  or ``free_cache_engine`` is off.

``sleep_level`` / ``sleep_keep_weights`` in ``engine_kwargs.ainfer_pd`` override the level and
whether level 2 keeps the weights in pinned host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...errors import ConfigError

HYBRID, COLOCATED, STANDALONE = "hybrid", "colocated", "standalone"
ALL_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class SleepPlan:
    level: int
    keep_weights: bool


def _mode(mode: object) -> str:
    m = str(getattr(mode, "value", mode)).lower()
    if m not in (HYBRID, COLOCATED, STANDALONE):
        raise ConfigError(f"unknown verl rollout mode {mode!r}")
    return m


def sleep_plan(mode: object, *, free_cache_engine: bool, node_rank: int = 0, level: Optional[int] = None,
               keep_weights: Optional[bool] = None) -> Optional[SleepPlan]:
    """The worker's ``sleep(level, keep_weights)`` for verl's ``sleep()``; None: do nothing."""
    m = _mode(mode)
    if node_rank != 0 or not free_cache_engine or m == STANDALONE:
        return None
    lvl = (2 if m == HYBRID else 1) if level is None else level
    if lvl not in (0, 1, 2) or isinstance(lvl, bool):
        raise ConfigError(f"engine_kwargs.ainfer_pd.sleep_level must be 0, 1 or 2, got {level!r}")
    return SleepPlan(lvl, bool(keep_weights) if keep_weights is not None else False)


def wake_tags(mode: object, tags: Optional[list[str]], *, node_rank: int = 0) -> Optional[list[str]]:
    """The worker's ``wake_up(tags)`` for verl's ``wake_up(tags)``; None: do nothing."""
    m = _mode(mode)
    if node_rank != 0 or m == STANDALONE:
        return None
    if m == COLOCATED or not tags:
        return list(ALL_TAGS)
    return list(tags)


def frees_kv_pool(mode: object, *, free_cache_engine: bool, node_rank: int = 0) -> bool:
    """Whether ``release_kv_cache`` frees the KV pool (``sleep(1)``) rather than just dropping the
    cached blocks (and ``resume_kv_cache`` reallocates it)."""
    return node_rank == 0 and free_cache_engine and _mode(mode) != COLOCATED
