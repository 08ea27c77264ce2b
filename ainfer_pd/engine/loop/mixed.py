"""The outside reference: vLLM/SGLang-style chunked prefill mixed into decode batches.

One loop, one stream: each step is one batch of every decode row plus a prefill chunk under a
shared token budget (``scheduler.mixed_chunk_tokens``). A step without a prefill chunk is a plain
decode iteration (graph replay when captured). There is no P task and no turnstile: P and D never
overlap, D rows simply wait inside the longer mixed step (so no "D wait" is recorded: the cost
shows as a longer step, ``m_step_s``). It is composed of the engine's book, runner and D context.
"""
from __future__ import annotations

from ...sched.planner import plan_step
from ..runtime.runner import BatchPlan
from .kv_growth import write_ahead
from .state import TurnState


async def run_mixed(eng) -> None:
    """The mixed-chunked loop of ``eng`` (an :class:`~ainfer_pd.engine.engine.Engine`)."""
    book, sc = eng.book, eng.cfg.scheduler
    while True:
        await eng.wait_for(lambda: book.has_live_rows() or book.p_admissible())
        running = [t for t in book.decoding if not t.abort_requested]
        if len(running) > sc.max_decode_batch:
            running = book.by_priority(running, waiting=False)
        sp = plan_step([t.request_id for t in running], book.pending_view(), max_decode_rows=sc.max_decode_batch,
                       prefill_budget=sc.mixed_chunk_tokens, available_blocks=book.available_blocks(), mixed=True)
        work = book.admit(sp.prefill, sp.admitted)
        rows = running[:len(sp.decode)]
        extra = write_ahead(eng.spec)
        if book.grow_rows(rows, extra):       # a full pool: preempt (nothing is in flight between steps)
            book.fit_rows(lambda: [t for t in rows if t.state is TurnState.DECODING], extra)
            rows = [t for t in rows if t.state is TurnState.DECODING]
        if not work and not rows:
            # NOTE: nothing runnable (cannot happen while plan and admission share `fits`):
            # wait for a change, never spin a core (issue 13, case 1 spun here).
            await eng.wait_changed()
            continue
        await _step(eng, work, rows)


async def _step(eng, work, rows) -> None:
    """One mixed step: the batch on the D stream, then P's and D's tokens booked (the decode rows
    verify their drafts in it when the speculator gives them some)."""
    book, rec, spec = eng.book, eng.rec, eng.spec
    batch = None
    if spec is not None and spec.worth_drafting(rows):
        await spec.prepare(rows)              # a device drafter (MTP) drafts first
        batch = spec.plan(rows)
    t_build = rec.now()
    plan = eng.runner.build(work, rows, drafts=batch.drafts if batch is not None else None)
    if batch is not None:
        spec.overhead.observe_host(batch.host_s + rec.now() - t_build)
    t0 = rec.now()
    # a step without a prefill chunk is a plain decode iteration (graph replay when captured)
    step = eng.runner.decode if not work else eng.runner.forward
    with book.in_flight([t for t, _, _ in work] + rows):
        w = eng.decode_ctx.stream.submit(step, plan, eng.decode_ctx, label="M.step")
        logits = await w.done()
    rec.sample("m_step_s", rec.now() - t0)
    n_p = len([1 for t in plan.logit_turns if t.state is TurnState.WAITING])
    d_plan = BatchPlan(plan.fb, [], plan.decode, plan.logit_turns[n_p:], drafts=plan.drafts)
    if batch is not None:
        spec.observe(batch, book.finish_verify(d_plan, logits[n_p:]))
    else:
        book.finish_decode(d_plan, logits[n_p:])
    book.finish_prefill(BatchPlan(plan.fb, plan.prefill, [], plan.logit_turns[:n_p]), logits[:n_p])
    book.drain_cleanups()
    eng.notify()
