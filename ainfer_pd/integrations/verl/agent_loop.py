"""Agent loop ``ainfer_pd_tool_agent``: verl's ``ToolAgentLoop`` with one trajectory per episode.

verl's ``ToolAgentLoop`` re-sends the whole running context (prompt, assistant turns,
tool responses) every turn; ``LLMServerClient`` even gives each turn a fresh request id.
This loop keeps the same state machine, tools, tool parser and Continuous-Token
tokenisation, but routes every turn through an :class:`EpisodeClient` that:

* remembers the episode's ainfer-pd trajectory id and the context the server holds
  (prompt + generated tokens);
* when the new prompt extends that context, sends **only the new observation tokens**
  with ``ainfer_pd_continue=True`` (the server calls ``worker.continue_``), so the server
  prefills just the suffix and reuses the KV of earlier turns;
* otherwise (first turn, or the builder re-rendered earlier tokens) sends the full
  context with the session hint ``session_id=<episode request id>``;
* releases the trajectory when the episode ends.

Every ``TokenOutput`` carries ``extra_fields["num_cached_tokens"]``; the per-turn values
are collected in ``AgentLoopOutput.extra_fields["ainfer_pd_cached_tokens"]``.

Use it with ``LLMServerClient`` (the default). ``FullyAsyncLLMServerClient`` works too:
an aborted turn releases the trajectory's KV and the retry re-prefills its context.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

logger = logging.getLogger(__name__)

AGENT_NAME = "ainfer_pd_tool_agent"


class EpisodeClient:
    """Wraps verl's ``LLMServerClient`` for one episode (same ``generate`` signature)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trajectory_id: Optional[str] = None
        self.context: Optional[list[int]] = None
        self.request_id: Optional[str] = None
        self.cached_tokens: list[int] = []
        self.sent_tokens: list[int] = []

    def __getattr__(self, name: str) -> Any:  # anything else: the real client
        return getattr(self.inner, name)

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.request_id = request_id
        prompt_ids = [int(t) for t in prompt_ids]
        ctx = self.context
        if (self.trajectory_id is not None and ctx is not None and len(prompt_ids) > len(ctx)
                and prompt_ids[: len(ctx)] == ctx):
            send = prompt_ids[len(ctx):]
            out = await self.inner.generate(request_id, prompt_ids=send, sampling_params=sampling_params,
                                            ainfer_pd_trajectory_id=self.trajectory_id, ainfer_pd_continue=True,
                                            **kwargs)
            if out.extra_fields.get("ainfer_pd_resend_full"):
                send = prompt_ids
                out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                                session_id=request_id, **kwargs)
        else:
            send = prompt_ids
            out = await self.inner.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params,
                                            session_id=request_id, **kwargs)
        self.sent_tokens.append(len(send))
        self.cached_tokens.append(int(out.extra_fields.get("num_cached_tokens") or 0))
        tid = out.extra_fields.get("ainfer_pd_trajectory_id")
        if tid and out.stop_reason != "aborted":
            self.trajectory_id, self.context = tid, prompt_ids + list(out.token_ids)
        else:
            self.trajectory_id, self.context = None, None
        return out

    async def release(self) -> None:
        """Free the episode's KV on its server (sticky routing finds the same replica)."""
        if self.trajectory_id is None or self.request_id is None:
            return
        acquire = getattr(self.inner, "_acquire_server", None)
        release = getattr(self.inner, "_release_server", None)
        if acquire is None or release is None:
            return  # the server's LRU eviction frees it later
        tid, self.trajectory_id, self.context = self.trajectory_id, None, None
        try:
            server_id, server = await acquire(self.request_id)
            try:
                await server.release_trajectory.remote(tid)
            finally:
                release(server_id, request_id=self.request_id)
        except Exception as exc:  # never fail an episode over cleanup
            logger.debug("ainfer_pd: releasing trajectory %s failed: %s", tid, exc)


@register(AGENT_NAME)
class AInferPDToolAgentLoop(ToolAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        real = self.server_manager
        client = EpisodeClient(real)
        self.server_manager = client
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            self.server_manager = real
            await client.release()
        output.extra_fields["ainfer_pd_cached_tokens"] = list(client.cached_tokens)
        output.extra_fields["ainfer_pd_sent_tokens"] = list(client.sent_tokens)
        return output
