"""The verl server's index of retained trajectories: which one a request reuses, LRU eviction
and release. A mixin of :class:`~.server.AInferPDServer` (its state, ``_contexts`` (trajectory
-> token context, LRU order), ``_sessions`` and ``_busy``, is the server's).

KV reuse across turns. The worker keeps the KV cache of every *retained trajectory*.
A request reuses one in three ways, best first:

1. ``ainfer_pd_continue=True, ainfer_pd_trajectory_id=tid``: ``prompt_ids`` holds only the
   new observation tokens -> ``worker.continue_(tid, obs)`` (the ``ainfer_pd_tool_agent``
   loop sends this).
2. ``session_id=...`` (explicit session hint): the trajectory last used by that session
   is reused when the request's prompt extends its context.
3. prefix match: verl's own ``ToolAgentLoop`` re-sends the whole context under a fresh
   request id every turn; a retained, idle trajectory whose *whole* context is a prefix
   of the prompt is reused (``worker.find_prefix_trajectory`` when the worker has it,
   else this server's own index). Partial matches are not taken, so GRPO siblings that
   share a prompt never steal each other's trajectory.

Retained trajectories are bounded (``max_retained_trajectories``, LRU over idle ones)
and all released by :meth:`clear_kv_cache` (called by verl after every weight update:
KV computed under old weights is never reused under new ones).
"""
from __future__ import annotations

from typing import Optional

from ...errors import TrajectoryBusyError, UnknownTrajectoryError


class TrajectoryReuse:
    def _find_reuse(self, prompt_ids: list[int], session_id: Optional[str]) -> Optional[str]:
        """An idle retained trajectory whose whole context is a prefix of ``prompt_ids``."""
        def extends(tid: Optional[str]) -> bool:
            ctx = self._contexts.get(tid) if tid else None
            return (ctx is not None and tid not in self._busy and len(ctx) <= len(prompt_ids)
                    and prompt_ids[:len(ctx)] == ctx)

        if session_id is not None and extends(self._sessions.get(session_id)):
            self.stats["reuse_session"] += 1
            return self._sessions[session_id]
        finder = getattr(self.worker, "find_prefix_trajectory", None)
        if finder is not None:
            hit = finder(prompt_ids)
            if hit is not None:
                tid, n = hit
                if extends(tid) and n >= len(self._contexts[tid]):
                    self.stats["reuse_prefix_worker"] += 1
                    return tid
        # Fallback (worker without find_prefix_trajectory): this server's own index.
        best, best_len = None, 0
        for tid, ctx in self._contexts.items():
            if len(ctx) > best_len and extends(tid):
                best, best_len = tid, len(ctx)
        if best is not None:
            self.stats["reuse_prefix_server"] += 1
        return best

    async def _release_quietly(self, tid: Optional[str], keep_context: Optional[list[int]] = None) -> None:
        if not tid:
            return
        try:
            await self.worker.release(tid)
        except (UnknownTrajectoryError, TrajectoryBusyError):
            pass
        if keep_context is not None:
            self._contexts[tid] = keep_context
        else:
            self._contexts.pop(tid, None)
            for s in [s for s, t in self._sessions.items() if t == tid]:
                del self._sessions[s]

    async def _evict(self) -> None:
        while len(self._contexts) > self.max_retained:
            victim = next((t for t in self._contexts if t not in self._busy), None)
            if victim is None:
                return
            await self._release_quietly(victim)
            self.stats["evicted"] += 1

    async def release_trajectory(self, trajectory_id: str) -> bool:
        """End of an episode: free its KV now instead of waiting for LRU eviction."""
        known = trajectory_id in self._contexts
        if trajectory_id not in self._busy:
            await self._release_quietly(trajectory_id)
        return known

    async def clear_kv_cache(self) -> None:
        """Release every idle retained trajectory (after a weight update)."""
        for tid in [t for t in self._contexts if t not in self._busy]:
            await self._release_quietly(tid)
        self._sessions.clear()
