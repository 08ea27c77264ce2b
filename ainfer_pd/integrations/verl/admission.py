"""The verl server's admission gate and request aborts. A mixin of
:class:`~.server.AInferPDServer` (its state, ``_inflight`` (admitted request_id -> trajectory
id), ``_abort_marked``, ``_paused`` / ``_rejecting`` / ``_resume`` (the gate), is the server's).

``abort_all_requests`` closes the gate and aborts every admitted request (verl's partial
rollout); ``resume_generation`` opens it again; ``abort_request`` aborts one request.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from ...errors import UnknownTrajectoryError


class RequestAdmission:
    async def abort_request(self, request_id: str, reset_prefix_cache: bool = False) -> dict[str, Any]:
        """Abort one admitted request: its turn ends "aborted" with its partial output (kept for a
        resubmission); one not yet at the worker returns "aborted" without running."""
        if request_id not in self._inflight:
            return {"aborted": False, "request_id": request_id, "error": "request not found"}
        self._abort_marked.add(request_id)
        try:
            await self.worker.abort(self._inflight[request_id])
        except UnknownTrajectoryError:      # not submitted to the worker yet: the mark stops it
            pass
        if reset_prefix_cache:
            await self._reset_prefix_cache()
        return {"aborted": True, "request_id": request_id}

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """Close admission and abort every request the server has admitted (``stop_reason="aborted"``,
        with the tokens produced so far): turns running or queued in the worker, and admitted
        requests whose turn has not reached the worker yet (they return without running). Requests
        arriving later park at the gate until :meth:`resume_generation` (``reject_request``: they
        return "aborted" at once). Waits until every admitted request has returned.

        ``reset_prefix_cache`` (default, as vLLM): then drop the cached KV (prefix blocks and the
        retained trajectories' KV, on every rank); trajectories keep their tokens and recompute
        them on their next turn. ``False`` keeps it (a partial rollout resumes without recompute).
        """
        self._paused = True
        self._rejecting = reject_request
        self._resume.clear()
        request_ids = list(self._inflight)
        self._abort_marked.update(request_ids)
        if self.worker is not None:
            await self.worker.abort_all()
        await self.wait_for_requests_to_drain()
        if reset_prefix_cache:
            await self._reset_prefix_cache()
        return {"aborted_count": len(request_ids), "request_ids": request_ids}

    async def _reset_prefix_cache(self) -> None:
        if self.worker is not None:
            await self._all_ranks("release_kv_cache")
            self.stats["prefix_cache_resets"] += 1

    async def resume_generation(self) -> None:
        self._paused = False
        self._rejecting = False
        self._resume.set()

    async def wait_for_requests_to_drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
