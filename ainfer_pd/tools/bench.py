"""Fixed-workload benchmark orchestration: every policy on the same trace, fresh worker per run.

``run_bench`` is what ``ainfer-pd bench`` and ``ainfer-pd replay`` call. For each cell and
repeat it runs every variant (a policy, optionally with a fixed span) on the *same* trace
with the *same* seed, each in a fresh :class:`~ainfer_pd.worker.RolloutWorker`, then
summarises, aggregates (median / IQR), compares greedy outputs against the baseline,
prints a table per cell and optionally writes ``results.json``, ``runs.jsonl`` and plots.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from ..config import POLICIES, SPANS, WorkerConfig
from ..engine.kv.residency import kv_sizing_inputs
from ..errors import ConfigError
from . import report
from .replay import ReplayResult, replay
from .trace import CELLS, Trace

DEFAULT_POLICIES = POLICIES          # every policy, in the ladder's order


@dataclass(frozen=True, slots=True)
class Variant:
    """One column of the comparison: a policy, optionally with a fixed turnstile span."""
    policy: str
    span: str | None = None
    label: str = ""
    priority: str | None = None           # scheduler.priority (None: the config's)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        base = self.policy if self.span is None else f"{self.policy}/K={self.span}"
        return base if self.priority in (None, "fifo") else f"{base}+{self.priority}"

    def config(self, base: WorkerConfig) -> WorkerConfig:
        kw: dict[str, Any] = {"scheduler.policy": self.policy}
        if self.span is not None:
            kw["mux.span"] = str(self.span)
        if self.priority is not None:
            kw["scheduler.priority"] = self.priority
        return base.replace(**kw)


def make_variants(policies: Sequence[str], *, span: str | None = None,
                  spans: Sequence[str] | None = None, priorities: Sequence[str] = ("fifo",)) -> list[Variant]:
    """Variants for ``policies`` x ``priorities`` (fine-grained with ``span`` when given) plus a
    fine-grained span sweep (each span x ``priorities``)."""
    from ..sched.priority import PRIORITIES
    out: list[Variant] = []
    for pr in priorities:
        if pr not in PRIORITIES:
            raise ConfigError(f"unknown priority {pr!r}: expected one of {', '.join(PRIORITIES)}")
    for pr in priorities:
        for p in policies:
            if p not in POLICIES:
                raise ConfigError(f"unknown policy {p!r}: expected one of {', '.join(POLICIES)}")
            out.append(Variant(p, span if (span is not None and p == "fine-grained") else None, priority=pr))
    for k in spans or ():
        if str(k) not in SPANS:
            raise ConfigError(f"unknown span {k!r}: expected one of {', '.join(SPANS)}")
        for pr in priorities:                        # the sweep runs under every requested priority
            v = Variant("fine-grained", str(k), priority=pr)
            if v.name not in {x.name for x in out}:
                out.append(v)
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate variants: {names}")
    if not out:
        raise ConfigError("no policy to run")
    return out


def default_worker_factory(cfg: WorkerConfig) -> Any:
    try:
        from .. import RolloutWorker  # type: ignore[attr-defined]
    except ImportError:
        from ..worker import RolloutWorker  # type: ignore[no-redef]
    return RolloutWorker(cfg)


@dataclass(slots=True)
class BenchResult:
    variants: list[str]
    cells: list[str]
    baseline: str
    summaries: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    """cell -> variant -> one summary per repeat."""
    aggregates: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    """cell -> variant -> metric -> {median, q1, q3, iqr, ...}."""
    output_mismatches: dict[str, dict[str, int]] = field(default_factory=dict)
    """cell -> variant -> number of (conversation, turn) outputs differing from the baseline's."""
    results: dict[str, dict[str, list[ReplayResult]]] = field(default_factory=dict)
    """cell -> variant -> replay results (timelines kept for the first repeat only)."""
    trace_summary: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def tables(self) -> dict[str, str]:
        return {cell: report.format_table(self.aggregates[cell], baseline=self.baseline,
                                          title=f"== cell {cell} ==")
                for cell in self.cells if cell in self.aggregates}

    def to_dict(self) -> dict[str, Any]:
        return {
            "variants": self.variants, "cells": self.cells, "baseline": self.baseline,
            "wall_s": self.wall_s, "trace": self.trace_summary,
            "aggregates": self.aggregates, "summaries": self.summaries,
            "ratios": {cell: report.ratios(agg, self.baseline) for cell, agg in self.aggregates.items()},
            "output_mismatches": self.output_mismatches,
        }


async def run_one(cfg: WorkerConfig, trace: Trace, *, cell: str, seed: int = 0, time_scale: float = 1.0,
                  label: str = "", progress: bool = False,
                  worker_factory: Callable[[WorkerConfig], Any] | None = None,
                  raise_errors: bool = False) -> ReplayResult:
    """One replay in a fresh worker."""
    factory = worker_factory or default_worker_factory
    async with factory(cfg) as worker:
        return await replay(worker, trace, cell=cell, seed=seed, progress=progress,
                            vocab_size=cfg.model.vocab_size, time_scale=time_scale, label=label,
                            raise_errors=raise_errors)


async def run_bench(cfg: WorkerConfig, trace: Trace, *, variants: Sequence[Variant],
                    cells: Sequence[str] = ("P1",), repeats: int = 1, seed: int = 0,
                    time_scale: float = 1.0, progress: bool = False, out_dir: str | Path | None = None,
                    worker_factory: Callable[[WorkerConfig], Any] | None = None,
                    baseline: str | None = None, plots: bool = True,
                    log: Callable[[str], None] | None = None) -> BenchResult:
    """Run every variant x cell x repeat on ``trace``; see the module docstring."""
    for c in cells:
        if c not in CELLS:
            raise ConfigError(f"unknown cell {c!r}: expected one of {', '.join(CELLS)}")
    if repeats < 1:
        raise ConfigError("repeats must be >= 1")
    names = [v.name for v in variants]
    base = baseline or ("normal" if "normal" in names else names[0])
    cfgs = {v.name: v.config(cfg) for v in variants}          # validate every config up front
    res = BenchResult(variants=names, cells=list(cells), baseline=base, trace_summary=trace.summary())
    out = Path(out_dir) if out_dir else None
    run = _BenchRun(trace=trace, variants=list(variants), cfgs=cfgs, repeats=repeats, seed=seed, time_scale=time_scale,
                    progress=progress, worker_factory=worker_factory, total=len(cells) * repeats * len(variants),
                    log=log or (lambda s: print(s, file=sys.stderr, flush=True)))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        run.runs_file = (out / "runs.jsonl").open("w")
    t_start = time.perf_counter()
    try:
        for cell in cells:
            await run.cell(res, cell)
    finally:
        if run.runs_file is not None:
            run.runs_file.close()
    res.wall_s = time.perf_counter() - t_start
    if out is not None:
        _write_results(out, res, plots)
    return res


@dataclass
class _BenchRun:
    """What every run of one :func:`run_bench` shares, and its progress count."""
    trace: Trace
    variants: list[Variant]
    cfgs: dict[str, WorkerConfig]
    repeats: int
    seed: int
    time_scale: float
    progress: bool
    worker_factory: Callable[[WorkerConfig], Any] | None
    total: int
    log: Callable[[str], None]
    runs_file: Any = None
    done: int = 0
    pools: dict[tuple, int] = field(default_factory=dict)
    """KV blocks by :func:`~ainfer_pd.engine.kv.residency.kv_sizing_inputs`: the first sizing's."""

    async def cell(self, res: BenchResult, cell: str) -> None:
        """Every repeat of every variant in ``cell``; then its aggregates and output mismatches."""
        names = [v.name for v in self.variants]
        res.summaries[cell] = {n: [] for n in names}
        res.results[cell] = {n: [] for n in names}
        for r in range(self.repeats):
            for v in self.variants:
                await self.one(res, cell, v, r)
        res.aggregates[cell] = {n: report.aggregate(res.summaries[cell][n]) for n in names}
        base_out = res.results[cell][res.baseline][0].outputs
        res.output_mismatches[cell] = {
            n: len(report.compare_outputs(base_out, res.results[cell][n][0].outputs)) for n in names}

    async def one(self, res: BenchResult, cell: str, v: Variant, r: int) -> None:
        """Repeat ``r`` of variant ``v`` in ``cell``: run, summarize, log, append to runs.jsonl."""
        self.done += 1
        label = f"{cell} {v.name} #{r + 1}"
        rr = await run_one(self.pinned(self.cfgs[v.name]), self.trace, cell=cell, seed=self.seed,
                           time_scale=self.time_scale, label=label, progress=self.progress,
                           worker_factory=self.worker_factory)
        self.pin(self.cfgs[v.name], rr.metrics.get("kv_total_blocks"))
        s = report.summarize(rr)
        if r > 0:
            rr.timeline = None                    # keep memory bounded
        res.summaries[cell][v.name].append(s)
        res.results[cell][v.name].append(rr)
        self._log_run(label, s, rr)
        if self.runs_file is not None:
            self.runs_file.write(json.dumps({"cell": cell, "variant": v.name, "repeat": r,
                                             "summary": s, **rr.to_dict()}, default=str) + "\n")
            self.runs_file.flush()

    def pinned(self, cfg: WorkerConfig) -> WorkerConfig:
        """``cfg`` with the bench's pool for its sizing inputs, where its pool is sized from the device
        and an earlier run sized one: every policy of one bench process runs on the same pool.
        Sized again per run, a later worker got a smaller one (on the H100, fine-grained 5% below
        normal): memory the process keeps once its first worker ran (loaded kernels, cuBLAS
        workspaces of its streams) counts as used to the next sizing."""
        blocks = self.pools.get(kv_sizing_inputs(cfg)) if not cfg.cache.num_blocks else None
        return cfg.replace(**{"cache.num_blocks": blocks}) if blocks else cfg

    def pin(self, cfg: WorkerConfig, blocks: Any) -> None:
        """The pool a run of ``cfg`` sized from the device (``blocks``) is the bench's for its inputs."""
        key = kv_sizing_inputs(cfg)
        if not cfg.cache.num_blocks and blocks and key not in self.pools:
            self.pools[key] = int(blocks)
            self.log(f"    KV pool {int(blocks)} blocks, sized from the device by this run: the bench's later "
                     f"runs of the same weights, KV block and memory fraction get it too")

    def _log_run(self, label: str, s: dict[str, float], rr: ReplayResult) -> None:
        """A run's progress line, its time breakdown and (with a timeline) where the device time went."""
        self.log(f"[{self.done}/{self.total}] {label}: makespan {s['makespan_s']:.3f} s, "
                 f"{s['requests_per_s']:.2f} req/s, p99 TTFT {_f(s['ttft_p99_s'])} s, "
                 f"D wait {_f(s['d_wait_mean_s'] * 1e3)} ms, failures {int(s['failures'])}")
        self.log("    " + report.breakdown(rr.metrics))
        if rr.timeline:
            self.log("    " + report.interval_stats(rr.timeline))
            self.log(f"    device: P beside D {s['both_s']:.2f} s, D alone {s['d_alone_s']:.2f} s, "
                     f"P alone {s['p_alone_s']:.2f} s, idle {s['idle_s']:.2f} s")


def _write_results(out: Path, res: BenchResult, plots: bool) -> None:
    """``results.json`` and (with ``plots``) each cell's plots in ``out``."""
    (out / "results.json").write_text(json.dumps(_finite(res.to_dict()), indent=1, default=str))
    if plots:
        from . import plots as _plots
        for cell in res.cells:
            _plots.plot_all(out, res.aggregates[cell], res.results[cell], prefix=cell,
                            title=f"cell {cell}")


def _f(x: float) -> str:
    return f"{x:.3f}" if isinstance(x, float) and math.isfinite(x) else "-"


def _finite(x: Any) -> Any:
    """JSON without NaN/inf (written as null)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def run_async(coro: Awaitable[Any], *, use_uvloop: bool = True) -> Any:
    """``asyncio.run`` on uvloop when it is installed (and wanted). With ``AINFER_PD_STALL_DUMP_S``
    set, every thread's and task's stack is written to stderr that many seconds in
    (:mod:`.stall_dump`: the harness's evidence when a run makes no progress)."""
    from .stall_dump import arm, seconds_from_env
    delay = seconds_from_env()
    if delay is not None:
        inner = coro

        async def armed() -> Any:
            arm(delay, asyncio.get_running_loop())
            return await inner
        coro = armed()
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            uvloop = None  # type: ignore[assignment]
        if uvloop is not None:
            if hasattr(asyncio, "Runner"):                      # Python >= 3.11
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    return runner.run(coro)  # type: ignore[arg-type]
            return uvloop.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]
