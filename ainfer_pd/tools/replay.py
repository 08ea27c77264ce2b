"""Closed-loop agentic replay client.

Every conversation of a :class:`~ainfer_pd.tools.trace.Trace` is one task:
``generate(prompt)`` for turn 0, then for each later turn ``sleep(tool wait)`` and
``continue_(trajectory, observation)``, finally ``release``. All conversations start at
once (a fixed workload: the trainer waits for the whole set), so the makespan is the
time until the last trajectory finishes.

Prompt and observation ids are random (seeded per conversation, ids in ``[2, vocab)``)
and sampling is greedy with ``ignore_eos``, so each turn generates exactly the trace's
token count and the outputs can be compared across policies. A trace with a response budget
asks each turn for that budget and lets the model's EOS end it (:func:`turn_params`). A GRPO-shaped trace
(:meth:`Trace.with_samples_per_prompt`) gives each group of ``n`` conversations one first
prompt and samples each member with its own seed (see :func:`turn_params`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import AInferPDError, InvalidRequestError
from ..request import SamplingParams
from .trace import Trace, cell_wait_factor


@dataclass(slots=True)
class RequestRecord:
    conversation: int
    turn: int
    submit_s: float
    """Submit time, seconds since the replay started."""
    done_s: float = float("nan")
    """Completion time, seconds since the replay started (NaN when it failed)."""
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    """Completion latency measured by the client (submit -> result)."""
    wait_s: float = 0.0
    """Tool wait the client slept before submitting this turn."""
    new_tokens: int = 0
    gen_tokens: int = 0
    """Tokens asked for (``max_new_tokens``)."""
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(slots=True)
class TrajectoryRecord:
    conversation: int
    trajectory_id: str = ""
    start_s: float = 0.0
    end_s: float = float("nan")
    """Completion time of its last turn, seconds since the replay started."""
    turns_done: int = 0
    turns_total: int = 0
    total_wait_s: float = 0.0
    failed: bool = False

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    trajectories: list[TrajectoryRecord]
    outputs: dict[tuple[int, int], list[int]]
    """Greedy token ids per (conversation, turn)."""
    metrics: dict[str, Any]
    """``worker.metrics()`` at the end of the replay."""
    makespan_s: float
    cell: str = "P1"
    seed: int = 0
    time_scale: float = 1.0
    label: str = ""
    failures: int = 0
    """Failed requests (typed library errors caught by the client)."""
    planned_requests: int = 0
    """Requests in the trace (failed conversations skip their remaining turns)."""
    timeline: list | None = None
    """``worker.timeline()`` when the worker offers it."""
    errors: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.records)

    @property
    def completed(self) -> int:
        return sum(1 for r in self.records if r.ok)

    def to_dict(self, *, with_outputs: bool = False, with_timeline: bool = False) -> dict[str, Any]:
        d = {
            "label": self.label, "cell": self.cell, "seed": self.seed, "time_scale": self.time_scale,
            "makespan_s": self.makespan_s, "failures": self.failures,
            "planned_requests": self.planned_requests, "errors": self.errors[:20],
            "records": [asdict(r) for r in self.records],
            "trajectories": [asdict(t) for t in self.trajectories],
            "metrics": _jsonable(self.metrics),
        }
        if with_outputs:
            d["outputs"] = {f"{c}/{t}": v for (c, t), v in self.outputs.items()}
        if with_timeline and self.timeline is not None:
            d["timeline"] = _jsonable(self.timeline)
        return d


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def conversation_token_ids(trace: Trace, conv_index: int, *, seed: int, vocab_size: int) -> list[list[int]]:
    """The seeded token ids appended before each turn of one conversation (ids in ``[2, vocab)``),
    seeded by the conversation's id, not its index (a rank replaying its share of a trace draws
    the same ids as world size 1)."""
    if vocab_size < 3:
        raise InvalidRequestError("vocab_size must be >= 3")
    conv = trace.conversations[conv_index]
    cid = conv.conv_id
    rng = np.random.default_rng([seed, cid])
    ids = [rng.integers(2, vocab_size, size=t.new_tokens).tolist() for t in conv.turns]
    n = trace.samples_per_prompt
    if n > 1:          # GRPO: the group's first prompt (its first member's draw)
        first = np.random.default_rng([seed, cid - cid % n])
        ids[0] = first.integers(2, vocab_size, size=conv.turns[0].new_tokens).tolist()
    return ids


def turn_params(trace: Trace, conv_index: int, turn: int, gen_tokens: int, *, seed: int) -> SamplingParams:
    """Greedy with ``ignore_eos`` (exactly ``gen_tokens`` tokens, comparable across runs); in a
    GRPO-shaped trace (``samples_per_prompt`` > 1) seeded sampling at temperature 1 instead, one
    seed per (conversation, turn): the members of a group diverge after their shared prompt, and
    a rerun gives the same tokens. A trace with a response budget (:meth:`Trace.response_budget`)
    asks for that many tokens a turn and stops at the model's EOS, sampled the same seeded way
    (the turn's length is the model's: the same in every run whose logits are, as fp32 on the CPU;
    bf16 logits move with the batch, and near-tied random-init ones then change a sampled token)."""
    budget = trace.response_budget
    if trace.samples_per_prompt > 1 or budget is not None:
        cid = trace.conversations[conv_index].conv_id
        s = int(np.random.default_rng([seed, cid, turn, 7]).integers(0, 2 ** 63))
        if budget is not None:
            return SamplingParams(max_new_tokens=budget, temperature=1.0, seed=s)
        return SamplingParams(max_new_tokens=gen_tokens, temperature=1.0, seed=s, ignore_eos=True)
    return SamplingParams(max_new_tokens=gen_tokens, temperature=0.0, ignore_eos=True)


def synthetic_eos_ids(vocab_size: int, every: int, *, seed: int = 0) -> tuple[int, ...]:
    """An EOS set for a random-weight model: about ``vocab_size / every`` ids of ``[2, vocab)`` drawn
    with ``seed``, so that a turn sampled at temperature 1 (near-uniform tokens) ends after about
    ``every`` tokens, at a length the engine cannot know in advance."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InvalidRequestError(f"eos_every must be a positive integer, got {every!r}")
    n = max(1, min(vocab_size - 2, round(vocab_size / every)))
    ids = np.random.default_rng([seed, 11]).choice(np.arange(2, vocab_size), size=n, replace=False)
    return tuple(sorted(int(i) for i in ids))


def _vocab_of(worker: Any) -> int | None:
    cfg = getattr(worker, "cfg", None) or getattr(worker, "config", None)
    model = getattr(cfg, "model", None)
    v = getattr(model, "vocab_size", None)
    return int(v) if isinstance(v, int) else None


async def replay(worker: Any, trace: Trace, *, cell: str = "P1", seed: int = 0, progress: bool = False,
                 vocab_size: int | None = None, time_scale: float = 1.0, raise_errors: bool = False,
                 label: str = "", max_concurrency: int | None = None,
                 on_request: Callable[[RequestRecord], None] | None = None) -> ReplayResult:
    """Replay ``trace`` closed-loop against ``worker`` and collect per-request records.

    ``cell`` picks the wait multiplier (P1-P4, trace) and ``time_scale`` multiplies every
    wait on top (short CPU runs). Typed library failures (:class:`AInferPDError`) end that
    conversation and are counted, unless ``raise_errors`` (then the first one propagates
    and the other conversations are cancelled). Cancelling the replay cancels every
    in-flight request; the worker aborts them.
    """
    factor = cell_wait_factor(cell) * float(time_scale)
    if time_scale < 0:
        raise InvalidRequestError("time_scale must be >= 0")
    if vocab_size is None:
        vocab_size = _vocab_of(worker) or 512
    run = _ReplayRun(worker, trace, seed=seed, vocab_size=vocab_size, factor=factor, raise_errors=raise_errors,
                     progress=progress, label=label, max_concurrency=max_concurrency, on_request=on_request)
    try:
        await _run_all([run.conversation(i) for i in range(len(trace.conversations))])
    finally:
        if run.bar is not None:
            run.bar.close()
    makespan = run.now()
    records = sorted(run.records, key=lambda r: (r.conversation, r.turn))
    return ReplayResult(records=records, trajectories=run.trajs, outputs=run.outputs, metrics=_safe_metrics(worker),
                        makespan_s=makespan, cell=cell, seed=seed, time_scale=time_scale, label=label,
                        failures=sum(1 for r in records if not r.ok), planned_requests=trace.num_requests,
                        timeline=_safe_timeline(worker), errors=run.errors)


class _ReplayRun:
    """One :func:`replay` in progress: its conversation tasks fill in the request records, the
    trajectory records and the outputs."""

    def __init__(self, worker: Any, trace: Trace, *, seed: int, vocab_size: int, factor: float,
                 raise_errors: bool, progress: bool, label: str, max_concurrency: int | None,
                 on_request: Callable[[RequestRecord], None] | None) -> None:
        self.worker, self.trace, self.seed, self.vocab_size = worker, trace, seed, vocab_size
        self.factor, self.raise_errors, self.on_request = factor, raise_errors, on_request
        self.records: list[RequestRecord] = []
        self.trajs = [TrajectoryRecord(conversation=c.conv_id, turns_total=c.num_turns) for c in trace.conversations]
        self.outputs: dict[tuple[int, int], list[int]] = {}
        self.errors: list[str] = []
        self.tids: dict[int, str] = {}
        """Conversation index -> its trajectory id, from its first turn's result until released."""
        self.bar = None
        if progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=trace.num_requests, desc=label or "replay", unit="req", leave=False,
                            dynamic_ncols=True)
        self.sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the replay started."""
        return time.perf_counter() - self.t0

    async def conversation(self, ci: int) -> None:
        """Conversation ``ci``'s turns in order (a failed turn ends it), then its release."""
        conv = self.trace.conversations[ci]
        ids = conversation_token_ids(self.trace, ci, seed=self.seed, vocab_size=self.vocab_size)
        acquired = False
        try:
            if self.sem is not None:
                await self.sem.acquire()
                acquired = True
            self.trajs[ci].start_s = self.now()
            for ti, turn in enumerate(conv.turns):
                if not await self._turn(ci, ti, turn, ids[ti]):
                    return
        finally:
            if acquired:
                self.sem.release()
            if ci in self.tids:
                try:
                    await self.worker.release(self.tids.pop(ci))
                except AInferPDError:
                    pass

    async def _turn(self, ci: int, ti: int, turn: Any, ids: list[int]) -> bool:
        """Turn ``ti`` of conversation ``ci``: its tool wait, then the request; False when it failed."""
        conv, tr = self.trace.conversations[ci], self.trajs[ci]
        wait = 0.0 if ti == 0 else turn.tool_wait_s * self.factor
        if wait > 0:
            await asyncio.sleep(wait)
            tr.total_wait_s += wait
        params = turn_params(self.trace, ci, ti, turn.gen_tokens, seed=self.seed)
        rec = RequestRecord(conversation=conv.conv_id, turn=ti, submit_s=self.now(), wait_s=wait,
                            new_tokens=turn.new_tokens, gen_tokens=params.max_new_tokens)
        self.records.append(rec)
        try:
            if ti == 0:
                out = await self.worker.generate(ids, params)
                self.tids[ci] = tr.trajectory_id = out.trajectory_id
            else:
                out = await self.worker.continue_(self.tids[ci], ids, params)
        except AInferPDError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            self.errors.append(f"conv {conv.conv_id} turn {ti}: {rec.error}")
            tr.failed = True
            if self.bar is not None:
                self.bar.update(conv.num_turns - ti)
            if self.raise_errors:
                raise
            return False
        self._completed(rec, ci, ti, out)
        return True

    def _completed(self, rec: RequestRecord, ci: int, ti: int, out: Any) -> None:
        """Record turn ``ti`` of conversation ``ci`` as done with result ``out``."""
        conv, tr = self.trace.conversations[ci], self.trajs[ci]
        rec.done_s = self.now()
        rec.latency_s = rec.done_s - rec.submit_s
        rec.ttft_s = float(getattr(out, "ttft_s", float("nan")))
        rec.num_output_tokens = len(out.token_ids)
        rec.num_prompt_tokens = int(getattr(out, "num_prompt_tokens", 0))
        rec.num_cached_tokens = int(getattr(out, "num_cached_tokens", 0))
        rec.finish_reason = str(getattr(out, "finish_reason", ""))
        self.outputs[(conv.conv_id, ti)] = list(out.token_ids)
        tr.turns_done = ti + 1
        tr.end_s = rec.done_s
        if self.on_request is not None:
            self.on_request(rec)
        if self.bar is not None:
            self.bar.update(1)


def _safe_timeline(worker: Any) -> list | None:
    """``worker.timeline()`` when the worker offers it (optional diagnostics: None on any error)."""
    tl = getattr(worker, "timeline", None)
    if not callable(tl):
        return None
    try:
        return list(tl())
    except Exception:  # noqa: BLE001 - a timeline is optional diagnostics
        return None


def _safe_metrics(worker: Any) -> dict[str, Any]:
    m = getattr(worker, "metrics", None)
    if not callable(m):
        return {}
    try:
        return dict(m() or {})
    except AInferPDError:
        return {}


async def _run_all(coros: list) -> None:
    """Run every coroutine as a task; the first error cancels the rest and propagates (unwrapped)."""
    if hasattr(asyncio, "TaskGroup"):
        try:
            async with asyncio.TaskGroup() as tg:
                for c in coros:
                    tg.create_task(c)
        except BaseExceptionGroup as eg:  # noqa: F821 - Python >= 3.11 here
            first = _first_exception(eg)
            raise first from None
        return
    tasks = [asyncio.ensure_future(c) for c in coros]  # Python 3.10
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _first_exception(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup) and eg.exceptions:  # noqa: F821
        eg = eg.exceptions[0]
    return eg
