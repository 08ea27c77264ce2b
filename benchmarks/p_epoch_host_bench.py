"""A P epoch's wall time against its GPU busy time (GPU host), and where the host time goes.

For each ``(n, cached)``: a trajectory of ``cached`` prompt tokens is prefilled (not measured), then
continued with ``n`` observation tokens and one new token, alone on the engine (policy normal, no D
beside it): the engine's own ``p_epoch_s`` of that continuation (summed over its epochs, when the P
budget cuts it in two) is the **wall** time. The same pass
through ``ModelRunner.forward_fb`` gives:

* ``busy_ms``: the sum of its CUDA kernels' device time (torch profiler), the **device** time;
* ``host_ms``: how long the host takes to enqueue it, timed with the device kept busy beforehand (a
  long sleep kernel), so the launch queue never waits for the device: pure host time;
* ``host_us_per_layer``: ``host_ms`` over the layers;
* ``device_gaps`` (JSON, and a line under the table): the profiled pass's device span, the union of
  its kernels and the idle between them, with the longest gaps and the kernels that waited
  (:func:`device_gaps`): ``gaps_ms`` near ``wall - busy`` puts the miss in the pass itself (launch
  ramps, graph starts), near 0 in the engine around it.

``launch`` (ms, median): the host time inside P's item launch calls during the continuation (on CUDA
the enqueue of its kernels; near ``span``: the epoch was host-bound inside the engine).
``pickup`` / ``span`` / ``items`` / ``tail`` (ms, median; :func:`p_timeline`) split the engine's side
from P's stream items' recorded device intervals: the call to P's first item starting on the device,
the device span to its last item's end, the items' own union, and that end to ``continue_``
returning. Where wall exceeds busy, they say whether the time is before the device starts, in gaps
inside the span, or after it ends.

``--cprofile`` prints the top host functions (own time) of one enqueue of the first case.

    python benchmarks/p_epoch_host_bench.py [--config configs/qwen3-30b-a3b-shape.yaml] [--cases 512:2048,2048:4096,8192:8192]

``--beside-d B`` (issue 33: the same figure beside D, its permit waits left out; target <= 1.3): the
policy multiplexes P with D (fine-grained unless ``--set scheduler.policy=`` names another turnstile
policy); the alone rows run first (no D yet, so no epoch is gated), then B trajectories of
``--d-prompt`` random tokens decode (``ignore_eos``, ``--d-tokens`` each: they outlast the run) while
each case is measured again. Per continuation, from ``w.metrics()`` deltas: the epoch wall
(``p_epoch_s``), its permit waits (``p_wait_permit_s``), ``wall_less_waits_ms`` = wall - permit
waits, the receive-counts waits (``p_counts_wait_s``, per-layer pacing only: P's host paced by its own
device, so recorded, not subtracted, as the engine's P boundary timing does), the epochs, the permits
(0: not gated) and ``d_iters``, the D iterations meanwhile (> 0), per continuation. One more continuation per case runs
under the torch profiler: ``p_busy_ms`` is the device time of the kernels on P's CUDA streams only (its
own and its green-context lane, each named by a marker kernel's ``device_resource_id``),
``other_busy_ms`` D's. ``ratio`` = median ``wall_less_waits_ms`` / ``p_busy_ms``, ``ratio_alone`` =
the same over the alone row's ``busy_ms``. ``items`` (``p_items_ms``, median) is the union of P's
stream items' recorded device intervals (CUDA events, so P graph replays count, which the profiler's
stream split misses) and ``r_items`` the median of wall / items per continuation: the epoch's wall over
the time P's own stream had work on the device beside D (1.0: P's host never left it idle; permit
waits stay in the wall, a gated epoch's by design). The JSON keeps ``rows`` and adds ``beside_d``.
``--no-profile`` drops every profiler figure, so the engine side runs on CPU too
(``--config configs/tiny-cpu.yaml --d-prompt 256 --cases 128:256 --beside-d 4``).

    python benchmarks/p_epoch_host_bench.py --beside-d 32 --cases 512:2048,2048:4096,8192:8000 \\
        --set scheduler.policy=fine-grained --out p_epoch_beside_d.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker, SamplingParams  # noqa: E402
from ainfer_pd.tools.options import load_config  # noqa: E402
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq  # noqa: E402
from ainfer_pd.engine.loop.p_walk import GATED_LANE  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402
from ainfer_pd.sched.epoch_mode import policy_traits  # noqa: E402

EXCLUSIVE = ("backlog_exclusive", "wait_exclusive", "activation_declined")
"""The counters of epochs that ran exclusive while D rows existed (a guard declined the gating)."""
MARK = "spin_kernel"
"""``torch.cuda._sleep``'s kernel: launched on each P stream inside the profile, it names their ids."""


def _delta_sum(m: dict, m0: dict, key: str) -> tuple[float, int]:
    """(sum, count) of ``key`` samples recorded between the snapshots ``m0`` and ``m``."""
    return m.get(f"{key}_sum", 0.0) - m0.get(f"{key}_sum", 0.0), m.get(f"{key}_count", 0) - m0.get(f"{key}_count", 0)


def _prefill_fb(runner, n: int, cached: int) -> ForwardBatch:
    dev, bs = runner.device, runner.kv.block_size
    ctx = n + cached
    nb = -(-ctx // bs)
    blocks = torch.arange(nb, dtype=torch.int64) % runner.kv.alloc.num_blocks
    slots = (blocks.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb))[:ctx]
    return ForwardBatch(torch.randint(2, runner.sections.model.vocab_size, (n,), device=dev),
                        torch.arange(cached, ctx, device=dev), slots[cached:].to(dev),
                        [PrefillSeq(0, n, ctx, block_ids=blocks)], None, torch.tensor([n - 1], device=dev),
                        block_size=bs)


def device_gaps(kernels: list[tuple[str, float, float]], top: int = 5,
                host: list[tuple[str, float, float]] | None = None) -> dict:
    """Where a pass's device time is idle: ``kernels`` are (name, start_us, end_us) of one pass's
    device activity. Returns the span (first start to last end), the union of the kernels' intervals,
    the idle inside the span (``gaps_ms``), how many gaps exceed 10 us, the ``top`` longest gaps with
    the kernels around them, and the idle summed by the kernel that waited to start (its name up to
    the first ``<`` or ``(``): a gap before every launch of one kernel names what the device waits
    for (a host sync, a launch ramp, a graph's first node). ``host``: (name, start_us, end_us) of the
    host's CUDA runtime calls in the same window; each top gap then says which calls overlapped it
    most (``host_us``: a ``cudaStreamSynchronize`` there is a host waiting, launches a host that is
    late, nothing a host busy elsewhere)."""
    ks = sorted(kernels, key=lambda k: k[1])
    if not ks:
        return {"span_ms": 0.0, "union_ms": 0.0, "gaps_ms": 0.0, "gaps_over_10us": 0, "top_gaps": [], "gap_before": {}}
    union, end, prev, gaps, before = 0.0, ks[0][1], None, [], {}
    for name, a, b in ks:
        if a > end and prev is not None:
            g = a - end
            gaps.append((round(g, 1), prev, name, end, a))
            key = name.split("<")[0].split("(")[0]
            before[key] = before.get(key, 0.0) + g
        union += max(0.0, b - max(a, end))
        if b > end:
            end, prev = b, name
    span = end - ks[0][1]
    return {"span_ms": round(span / 1e3, 3), "union_ms": round(union / 1e3, 3), "gaps_ms": round((span - union) / 1e3, 3),
            "gaps_over_10us": sum(g[0] > 10 for g in gaps),
            "top_gaps": [{"us": g, "after": p[:60], "before": n[:60],
                          **({"host_us": host_during(host, a0, b0)} if host is not None else {})}
                         for g, p, n, a0, b0 in sorted(gaps, reverse=True)[:top]],
            "gap_before": {k: round(v / 1e3, 3) for k, v in sorted(before.items(), key=lambda kv: -kv[1])[:top]}}


def host_during(host: list[tuple[str, float, float]], a: float, b: float, top: int = 3) -> dict:
    """The ``top`` host calls (by name) overlapping the interval [a, b] most, with their overlap in us."""
    over: dict[str, float] = {}
    for name, s, e in host:
        o = min(e, b) - max(s, a)
        if o > 0:
            over[name] = over.get(name, 0.0) + o
    return {k: round(v, 1) for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:top]}


def _intervals(prof, device: bool, prefix: str = "") -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the profile's device activity (``device``), or of its host events
    whose name starts with ``prefix``."""
    from torch.autograd import DeviceType
    kind = DeviceType.CUDA if device else DeviceType.CPU
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == kind and e.name.startswith(prefix)]


@contextlib.contextmanager
def engine_timeline(out: dict):
    """Profile the device and the host's CUDA runtime calls while the body runs (an engine
    continuation: its epoch as the engine runs it, launcher thread and event loop included), then
    ``out["engine_gaps"]``: :func:`device_gaps` of every kernel and copy in the window, each top gap
    with the runtime calls that overlapped it."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
        torch.cuda.synchronize()
    out["engine_gaps"] = device_gaps(_intervals(prof, True), host=_intervals(prof, False, "cuda"))


def forward_figures(runner, n: int, cached: int, reps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile
    ctx = PhaseContext(Phase.PREFILL, None)
    fb = _prefill_fb(runner, n, cached)

    def step():
        fb.prefill_meta = None
        return runner.forward_fb(fb, ctx)
    with torch.inference_mode():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        gaps = device_gaps(_intervals(prof, True))
        hosts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e8))            # ~1 s of device work ahead: the launches never wait
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
    host = min(hosts)
    return {"busy_ms": round(busy, 2), "host_ms": round(host, 2),
            "host_us_per_layer": round(host * 1e3 / runner.sections.model.num_layers, 1), "device_gaps": gaps}


def host_profile(runner, n: int, cached: int, top: int) -> str:
    ctx = PhaseContext(Phase.PREFILL, None)
    fb = _prefill_fb(runner, n, cached)
    prof = cProfile.Profile()
    with torch.inference_mode():
        fb.prefill_meta = None
        runner.forward_fb(fb, ctx)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))
        prof.enable()
        fb.prefill_meta = None
        runner.forward_fb(fb, ctx)
        prof.disable()
        torch.cuda.synchronize()
    import io
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def split_busy(events, num_streams: int) -> dict:
    """Device time (ms) of the profiler ``events`` on P's CUDA streams (the streams of the ``MARK``
    kernels, one per P stream, themselves left out) and on the others (D's); kernels, memcpy, memset."""
    from torch.autograd import DeviceType
    dev = [e for e in events if e.device_type == DeviceType.CUDA
           and "annotation" not in str(getattr(e, "activity_type", "") or "")]
    marks = [e for e in dev if MARK in e.name]
    if len(marks) != num_streams:
        raise RuntimeError(f"{len(marks)} marker kernels in the profile for {num_streams} P streams")
    p_ids = {e.device_resource_id for e in marks}
    p = [e for e in dev if e.device_resource_id in p_ids and MARK not in e.name]
    rest = [e for e in dev if e.device_resource_id not in p_ids]
    ms = lambda es: round(sum(e.time_range.elapsed_us() for e in es) / 1e3, 2)
    return {"p_busy_ms": ms(p), "p_kernels": len(p), "other_busy_ms": ms(rest), "p_stream_ids": sorted(p_ids),
            "other_stream_ids": sorted({e.device_resource_id for e in rest})}


@contextlib.contextmanager
def p_stream_busy(engine, out: dict):
    """Profile the body (CUDA activity); ``out`` gets :func:`split_busy`. Each of P's CUDA streams (its
    own, its green-context lane) runs a marker kernel at the start, while P is idle: its id."""
    from torch.profiler import ProfilerActivity, profile
    name = engine.prefill_ctx.stream.name
    streams = list({s.cuda_stream: s for s in (engine.device.cuda_stream(name, lane)
                                               for lane in (None, GATED_LANE))}.values())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(1000)
            s.synchronize()
        yield
        for s in streams:
            s.synchronize()
    out.update(split_busy(prof.events(), len(streams)))


async def _continuation(w: RolloutWorker, rng: random.Random, n: int, cached: int,
                        around=contextlib.nullcontext) -> dict:
    """Prefill ``cached`` random tokens (not measured), continue them with ``n``: the metric deltas
    of the continuation (times in ms) and the D rows decoding when it ended."""
    V = w.cfg.model.vocab_size
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    o = await w.generate([rng.randrange(2, V) for _ in range(cached)], one)
    m0 = w.metrics()
    rec = w.engine.rec
    t_call = rec.now()
    with around(), _timed_launches(w.engine) as launches:
        o2 = await w.continue_(o.trajectory_id, [rng.randrange(2, V) for _ in range(n)], one)
    t_ret = rec.now()
    m = w.metrics()
    d_rows = len(w.engine.book.decoding)
    await w.release(o2.trajectory_id)
    (wall, epochs), (permit, permits) = _delta_sum(m, m0, "p_epoch_s"), _delta_sum(m, m0, "p_wait_permit_s")
    return {"wall": wall * 1e3, "epochs": epochs, "permit": permit * 1e3, "permits": permits,
            "counts": _delta_sum(m, m0, "p_counts_wait_s")[0] * 1e3, "d_iters": _delta_sum(m, m0, "d_iter_s")[1],
            "d_rows": d_rows, "exclusive": sum(m.get(k, 0) - m0.get(k, 0) for k in EXCLUSIVE),
            **p_timeline(rec, w.engine.prefill_ctx.stream.name, t_call, t_ret),
            "launch_ms": round(sum(launches) * 1e3, 2), "launches": len(launches)}


@contextlib.contextmanager
def _timed_launches(engine):
    """The host time of each P stream item's launch call (on CUDA: enqueueing its kernels) while
    the body runs, in seconds: where it is near ``span_ms`` the epoch was host-bound inside the
    engine, whatever the standalone ``host_ms`` says."""
    dev, name, out = engine.device, engine.prefill_ctx.stream.name, []
    execute = dev._execute

    def timed(stream, work, fn, args):
        t0 = time.perf_counter()
        try:
            return execute(stream, work, fn, args)
        finally:
            if stream.name == name:
                out.append(time.perf_counter() - t0)
    dev._execute = timed
    try:
        yield out
    finally:
        del dev._execute


def p_timeline(rec, stream: str, t_call: float, t_ret: float) -> dict:
    """Where a continuation's time goes, from P's own stream items (recorded intervals: CUDA events
    around each item, on the host clock): ``pickup_ms`` from the ``continue_`` call to P's first item
    starting on the device (admission, planning, the launcher hand-off), ``span_ms`` from there to
    P's last item's end (device time and any launch gaps inside it), ``p_items_ms`` the items' own
    union, ``tail_ms`` from that end to ``continue_`` returning (the completion wake, the token's
    hand-back). The decode of the turn's next token, if any, is D's and not counted."""
    ivs = [(a, b) for (_, s, a, b, _) in list(rec.intervals) if s == stream and t_call <= a and b <= t_ret]
    if not ivs:
        return {"pickup_ms": None, "span_ms": None, "p_items_ms": None, "tail_ms": None}
    first, last = min(a for a, _ in ivs), max(b for _, b in ivs)
    union, end = 0.0, first
    for a, b in sorted(ivs):
        union += max(0.0, b - max(a, end))
        end = max(end, b)
    ms = lambda x: round(x * 1e3, 2)
    return {"pickup_ms": ms(first - t_call), "span_ms": ms(last - first), "p_items_ms": ms(union),
            "tail_ms": ms(t_ret - last)}


async def engine_epochs(w: RolloutWorker, n: int, cached: int, reps: int) -> dict:
    rng = random.Random(n * 7 + cached)
    runs = [await _continuation(w, rng, n, cached) for _ in range(reps)]
    walls = [r["wall"] for r in runs]       # a continuation over the P budget takes 2 epochs
    med = lambda k: None if runs[-1][k] is None else round(statistics.median(r[k] for r in runs), 2)
    return {"epoch_wall_ms": round(statistics.median(walls), 2), "epoch_wall_all_ms": [round(x, 2) for x in walls],
            "epochs": runs[-1]["epochs"],
            **{k: med(k) for k in ("pickup_ms", "span_ms", "p_items_ms", "tail_ms", "launch_ms")}}


async def beside_epochs(w: RolloutWorker, n: int, cached: int, reps: int, profile: bool) -> dict:
    """``reps`` continuations beside the decoding rows, then (``profile``) one under the profiler."""
    rng = random.Random(n * 7 + cached + 1)
    runs = [await _continuation(w, rng, n, cached) for _ in range(reps)]
    less = [r["wall"] - r["permit"] for r in runs]
    med = lambda k: round(statistics.median(r[k] for r in runs), 2)
    row = {"n": n, "cached": cached, "epoch_wall_ms": med("wall"), "permit_wait_ms": med("permit"),
           "counts_wait_ms": med("counts"), "wall_less_waits_ms": round(statistics.median(less), 2),
           "wall_less_waits_all_ms": [round(x, 2) for x in less], "epochs": max(r["epochs"] for r in runs),
           "permits": [r["permits"] for r in runs], "exclusive": sum(r["exclusive"] for r in runs),
           "d_iters": [r["d_iters"] for r in runs], "d_rows": min(r["d_rows"] for r in runs)}
    if all(r["p_items_ms"] for r in runs):
        row.update(span_ms=med("span_ms"), p_items_ms=med("p_items_ms"),
                   r_items=round(statistics.median(r["wall"] / r["p_items_ms"] for r in runs), 3))
    if profile:
        busy: dict = {}
        r = await _continuation(w, rng, n, cached, around=lambda: p_stream_busy(w.engine, busy))
        row.update(busy, profiled_wall_less_waits_ms=round(r["wall"] - r["permit"], 2), profiled_d_iters=r["d_iters"])
    return row


async def start_d(w: RolloutWorker, b: int, prompt: int, tokens: int, timeout_s: float = 600.0) -> list:
    """``b`` long generations (``ignore_eos``) on ``prompt`` random tokens; returns once all decode."""
    rng, V = random.Random(33), w.cfg.model.vocab_size
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    tasks = [asyncio.create_task(w.generate([rng.randrange(2, V) for _ in range(prompt)], params)) for _ in range(b)]
    t0 = time.monotonic()
    while len(w.engine.book.decoding) < b:
        if any(t.done() for t in tasks) or time.monotonic() - t0 > timeout_s:
            for t in tasks:
                if t.done():
                    t.result()          # its error, if it failed
            raise RuntimeError(f"{len(w.engine.book.decoding)} of {b} D rows decoding (one finished, or the KV "
                               f"pool holds fewer than {b} x ({prompt} + {tokens}) tokens)")
        await asyncio.sleep(0.01)
    return tasks


async def stop_d(w: RolloutWorker, tasks: list) -> int:
    """Abort and release the D rows; returns how many had ended by themselves (should be 0)."""
    early = sum(t.done() for t in tasks)
    await w.abort_all()
    for o in await asyncio.gather(*tasks):
        await w.release(o.trajectory_id)
    return early


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


async def beside_rows(w: RolloutWorker, a, cases: list, alone: dict, profile: bool) -> dict:
    cfg = w.cfg
    d_tokens = min(a.d_tokens, cfg.model.max_context_len - a.d_prompt)
    # the D rows must fit the pool beside the largest case's epoch (an H100's pool beside the bf16
    # Qwen3-30B-A3B weights holds ~196K tokens, not 32 x 6,144 and a 6,144-token epoch)
    kv = w.engine.kv
    pool = kv.pool_blocks() * kv.block_size
    fit = (int(0.85 * pool) - max(n + c for n, c in cases)) // a.beside_d - a.d_prompt
    if fit < 64:
        raise SystemExit(f"--beside-d {a.beside_d} rows of {a.d_prompt} prompt tokens do not fit the KV pool "
                         f"({pool} tokens) beside the cases; give fewer rows or a shorter --d-prompt")
    if fit < d_tokens:
        print(f"D rows' new tokens capped at {fit} (asked {d_tokens}): the KV pool holds {pool} tokens", flush=True)
        d_tokens = fit
    tasks = await start_d(w, a.beside_d, a.d_prompt, d_tokens)
    rows = []
    print(f"beside D ({a.beside_d} rows, policy {cfg.scheduler.policy})\n{'n':>6} {'cached':>6} {'wall_ms':>8} "
          f"{'permit':>8} {'wall-w':>8} {'p_busy':>8} {'ratio':>6} {'r_alone':>7} {'items':>8} {'r_items':>7} "
          f"{'d_iters':>8}", flush=True)
    for n, cached in cases:
        r = await beside_epochs(w, n, cached, a.reps, profile)
        busy, busy_alone = r.get("p_busy_ms"), alone.get((n, cached))
        r["ratio"] = round(r["wall_less_waits_ms"] / busy, 3) if busy else None
        r["ratio_alone"] = round(r["wall_less_waits_ms"] / busy_alone, 3) if busy_alone else None
        rows.append(r)
        print(f"{n:>6} {cached:>6} {r['epoch_wall_ms']:>8.2f} {r['permit_wait_ms']:>8.2f} "
              f"{r['wall_less_waits_ms']:>8.2f} {_f(busy, '>8.2f')} {_f(r['ratio'], '>6.3f')} "
              f"{_f(r['ratio_alone'], '>7.3f')} {_f(r.get('p_items_ms'), '>8.2f')} {_f(r.get('r_items'), '>7.3f')} "
              f"{min(r['d_iters']):>8}", flush=True)
        if min(r["d_iters"]) <= 0 or r["d_rows"] < a.beside_d:
            print(f"  WARNING: not beside D (d_iters {r['d_iters']}, {r['d_rows']} rows at the end)", flush=True)
    early = await stop_d(w, tasks)
    return {"b": a.beside_d, "policy": cfg.scheduler.policy, "d_prompt": a.d_prompt, "d_tokens": d_tokens,
            "d_rows_ended_early": early, "profiled": profile, "rows": rows}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--cases", default="512:2048,2048:4096,8192:8000,575:1500")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, help="top N host functions of the first case")
    ap.add_argument("--beside-d", type=int, default=0, metavar="B", help="also measure beside B decoding rows")
    ap.add_argument("--d-prompt", type=int, default=2048, help="prompt tokens of each D row")
    ap.add_argument("--d-tokens", type=int, default=4096, help="new tokens of each D row (capped by the context)")
    ap.add_argument("--no-profile", action="store_true", help="no profiler figures (the engine side runs on CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    policy = "fine-grained" if a.beside_d else "normal"
    cfg = load_config(a.config, [f"scheduler.policy={policy}", *a.set])
    if a.beside_d and not policy_traits(cfg.scheduler.policy).turnstile:
        ap.error(f"--beside-d needs a policy that multiplexes P with D, not {cfg.scheduler.policy}")
    profile = not a.no_profile
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    rows, beside = [], None
    print(f"{'n':>6} {'cached':>6} {'wall_ms':>8} {'busy_ms':>8} {'host_ms':>8} {'us/layer':>8} {'wall/busy':>9} "
          f"{'pickup':>7} {'span':>7} {'items':>7} {'tail':>7} {'launch':>7}", flush=True)
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([2 + i for i in range(64)], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        await w.release(warm.trajectory_id)
        for n, cached in cases:
            r = {"n": n, "cached": cached, **await engine_epochs(w, n, cached, a.reps)}
            if profile:
                r.update(await asyncio.to_thread(forward_figures, w.engine.runner, n, cached))
                r["wall_busy"] = round(r["epoch_wall_ms"] / r["busy_ms"], 3)
            rows.append(r)
            print(f"{n:>6} {cached:>6} {r['epoch_wall_ms']:>8.2f} {_f(r.get('busy_ms'), '>8.2f')} "
                  f"{_f(r.get('host_ms'), '>8.2f')} {_f(r.get('host_us_per_layer'), '>8.1f')} "
                  f"{_f(r.get('wall_busy'), '>9.3f')} {_f(r['pickup_ms'], '>7.2f')} {_f(r['span_ms'], '>7.2f')} "
                  f"{_f(r['p_items_ms'], '>7.2f')} {_f(r['tail_ms'], '>7.2f')} {_f(r['launch_ms'], '>7.2f')}", flush=True)
            if "device_gaps" in r:
                print(f"        the pass alone: {json.dumps(r['device_gaps'])}", flush=True)
            if profile:                         # one more continuation, its whole epoch profiled in the engine
                await _continuation(w, random.Random(n + cached), n, cached, around=lambda: engine_timeline(r))
                print(f"        the epoch in the engine: {json.dumps(r['engine_gaps'])}", flush=True)
        if a.cprofile:
            print(await asyncio.to_thread(host_profile, w.engine.runner, *cases[0], a.cprofile), flush=True)
        if a.beside_d:
            beside = await beside_rows(w, a, cases, {(r["n"], r["cached"]): r.get("busy_ms") for r in rows}, profile)
    if a.out:
        out = {"config": a.config, "rows": rows,
               "machine": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        if beside is not None:
            out["beside_d"] = beside
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
