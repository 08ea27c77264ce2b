"""The outside reference: vLLM/SGLang-style chunked prefill mixed into decode batches.

One loop, one stream: each step is one batch of every decode row plus a prefill chunk under
a shared token budget (``scheduler.mixed_chunk_tokens``). A step without a prefill chunk is a
plain decode iteration (graph replay when captured). There is no separate P task and no
turnstile: P and D never overlap, D rows simply wait inside the longer mixed step (so no
"D wait" is recorded: the cost shows as a longer step, ``m_step_s``).
"""
from __future__ import annotations

import asyncio

from ..sched.planner import plan_step
from .engine import Engine
from .runner import BatchPlan
from .state import TurnState


class MixedChunkedEngine(Engine):
    runs_overlap_decode = False     # one loop of its own, P chunks and D rows in each step

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._mixed_loop(), name="mixed")

    async def _mixed_loop(self) -> None:
        """Outside reference (vLLM/SGLang-style): each step is one batch of every
        decode row plus a prefill chunk under a shared token budget."""
        book = self.book
        while True:
            await self._wait_for(lambda: book.has_live_rows() or book.p_admissible())
            running = [t for t in book.decoding if not t.abort_requested]
            if len(running) > self.cfg.scheduler.max_decode_batch:
                running = book.by_priority(running, waiting=False)
            sp = plan_step([t.request_id for t in running], book.pending_view(),
                           max_decode_rows=self.cfg.scheduler.max_decode_batch,
                           prefill_budget=self.cfg.scheduler.mixed_chunk_tokens,
                           available_blocks=book.available_blocks(), mixed=True)
            work = book.admit(sp.prefill, sp.admitted)
            rows = running[:len(sp.decode)]
            if not work and not rows:
                # NOTE: nothing runnable (cannot happen while plan and admission share `fits`):
                # wait for a change, never spin a core (issue 13, case 1 spun here).
                await self._changed.wait()
                continue
            plan = self.runner.build(work, rows)
            touched = [t for t, _, _ in work] + rows
            for t in touched:
                t.in_flight += 1
            t0 = self.rec.now()
            # a step without a prefill chunk is a plain decode iteration (graph replay when captured)
            step = self.runner.decode if not work else self.runner.forward
            w = self.decode_ctx.stream.submit(step, plan, self.decode_ctx, label="M.step")
            try:
                logits = await w.done()
            finally:
                for t in touched:
                    t.in_flight -= 1
            self.rec.sample("m_step_s", self.rec.now() - t0)
            n_p = len([1 for t in plan.logit_turns if t.state is TurnState.WAITING])
            p_plan = BatchPlan(plan.fb, plan.prefill, [], plan.logit_turns[:n_p])
            d_plan = BatchPlan(plan.fb, [], plan.decode, plan.logit_turns[n_p:])
            book.finish_decode(d_plan, logits[n_p:])
            book.finish_prefill(p_plan, logits[:n_p])
            book.drain_cleanups()
            self._notify()

