"""Agent loop ``ainfer_pd_tool_agent``: verl's ``ToolAgentLoop`` with one trajectory per episode.

verl's ``ToolAgentLoop`` re-sends the whole running context (prompt, assistant turns,
tool responses) every turn; ``LLMServerClient`` even gives each turn a fresh request id.
This loop keeps the same state machine, tools, tool parser and Continuous-Token
tokenisation, but routes every turn through an :class:`EpisodeClient` that:

* names the episode's ainfer-pd trajectory itself (``ainfer_pd_trajectory_id``, sent with every
  turn), so it needs nothing back from the client: verl's ``FullyAsyncLLMServerClient`` rebuilds
  each ``TokenOutput`` across partial-rollout resumes and keeps none of the server's fields;
* remembers the context the server holds (prompt + generated tokens) after a completed turn;
* when the new prompt extends that context, sends **only the new observation tokens**
  with ``ainfer_pd_continue=True``, so the server prefills just the suffix and reuses the KV
  of earlier turns (a resume of an aborted turn inside ``FullyAsyncLLMServerClient`` sends the
  same new tokens plus the partial ones, which the server holds already);
* otherwise (first turn, the builder re-rendered earlier tokens, or the server no longer holds
  the trajectory: ``UnknownTrajectoryError``) sends the full context;
* releases the trajectory when the episode ends (through the client's sticky routing).

The loop's output has the same keys as every other agent loop's (``DataProto.concat`` of a
batch mixing agent loops needs that); the episode's per-turn numbers (tokens sent, prompt
tokens served from cache) are on the loop's ``episode`` (:class:`EpisodeClient`).
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

logger = logging.getLogger(__name__)

AGENT_NAME = "ainfer_pd_tool_agent"


class EpisodeClient:
    """Wraps verl's ``LLMServerClient`` (or ``FullyAsyncLLMServerClient``) for one episode (same
    ``generate`` signature)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trajectory_id = f"ep-{uuid.uuid4().hex[:16]}"
        self.context: Optional[list[int]] = None
        self.request_id: Optional[str] = None
        self.cached_tokens: list[int] = []
        self.sent_tokens: list[int] = []
        self.released = False

    def __getattr__(self, name: str) -> Any:  # anything else: the real client
        return getattr(self.inner, name)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from ...errors import UnknownTrajectoryError
        self.request_id = request_id
        prompt_ids = [int(t) for t in prompt_ids]
        ctx = self.context
        send = prompt_ids
        out = None
        if ctx is not None and len(prompt_ids) > len(ctx) and prompt_ids[: len(ctx)] == ctx:
            send = prompt_ids[len(ctx):]
            try:
                out = await self.inner.generate(request_id, prompt_ids=send, sampling_params=sampling_params,
                                                ainfer_pd_trajectory_id=self.trajectory_id, ainfer_pd_continue=True,
                                                **kwargs)
            except UnknownTrajectoryError:      # not retained there any more (cleared, evicted): all of it
                send = prompt_ids
        if out is None:
            out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                            ainfer_pd_trajectory_id=self.trajectory_id, **kwargs)
        self.sent_tokens.append(len(send))
        self.cached_tokens.append(int(out.extra_fields.get("num_cached_tokens") or 0))
        # after an aborted turn the server's context is not known here: the next turn sends it all
        self.context = prompt_ids + list(out.token_ids) if out.stop_reason not in ("aborted", "abort") else None
        return out

    async def release(self) -> None:
        """Free the episode's KV on its server (sticky routing finds the same replica)."""
        if self.request_id is None or self.released:
            return
        acquire = getattr(self.inner, "_acquire_server", None)
        release = getattr(self.inner, "_release_server", None)
        if acquire is None or release is None:
            return  # the server's LRU eviction frees it later
        self.released, self.context = True, None
        try:
            server_id, server = await acquire(self.request_id)
            try:
                await server.release_trajectory.remote(self.trajectory_id)
            finally:
                release(server_id, request_id=self.request_id)
        except Exception as exc:  # never fail an episode over cleanup
            logger.debug("ainfer_pd: releasing trajectory %s failed: %s", self.trajectory_id, exc)


@register(AGENT_NAME)
class AInferPDToolAgentLoop(ToolAgentLoop):
    episode: Optional[EpisodeClient] = None
    """The last episode's client: its trajectory id and per-turn ``sent_tokens`` / ``cached_tokens``."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        real = self.server_manager
        client = EpisodeClient(real)
        self.episode = client
        self.server_manager = client
        try:
            return await super().run(sampling_params, **kwargs)
        finally:
            self.server_manager = real
            await client.release()
