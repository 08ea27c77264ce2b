"""``python -m benchmarks.nccl_harness``: the crossed-order stall and its fix from the
command line, on CPU ranks (gloo) or on GPUs (NCCL, one process per GPU).

Two ways to start the ranks, same flags:

* ``torchrun --standalone --nproc-per-node N -m benchmarks.nccl_harness --backend nccl ...``:
  this process is one rank (``cuda:LOCAL_RANK`` with NCCL; the world size comes from torchrun);
* ``python -m benchmarks.nccl_harness --world-size N ...``: starts N local rank processes
  (:func:`ainfer_pd.launch.spawn`, gloo default group; ``--backend nccl`` needs N GPUs).

``--ordering`` takes a comma list; the runs share one set of process groups and run in order.
A stalled run ends the launch (its NCCL kernels never finish: the communicators are aborted
and the process exits), so run the stall and the fix as two launches.

Each run's outcome is compared with the expectation (``--expect auto``: ``none`` on a crossed
topology with a residency gate must stall, everything else must complete; with
``--residency-slots 0`` on CUDA, or on CUDA without ``--skew-mode crossed``, the ``none`` outcome
is only reported). Completed turnstile runs
are trace-checked. Output: one line per rank (torchrun), then from rank 0 (or the parent) one
block per run and ``RESULT: OK`` / ``RESULT: UNEXPECTED``; ``OUT/summary.json``. Exit code 0
when every run behaved as expected, 1 otherwise, 124 when the hard deadline passed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ainfer_pd.comm.backend import check_backend, data_backend_for
from ainfer_pd.comm.ordering import ORDERINGS
from ainfer_pd.errors import AInferPDError, ConfigError, PeerLostError, StallError

from .ranks import rank_main, summarize_error
from .spec import SKEW_MODES, HarnessSpec, expected_rounds, registry_for

__all__ = ["build_parser", "build_specs", "cli_rank", "expectation", "main", "rank_summary", "report"]

_KEY = "ainfer_pd/mrcli"
MESSAGE_CHARS = 8000


# ====================================================================== specs
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nccl_harness",
                                description="Crossed-order hazard (SPEC 2) and selective ordering (SPEC 3.3) "
                                            "on real ranks: gloo (CPU stand-in) or NCCL (one GPU per rank).")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="data backend of the attention collectives (auto: nccl when CUDA is available)")
    p.add_argument("--ordering", default="none",
                   help=f"comma list of {', '.join(ORDERINGS)} (run in order over one set of groups)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to spawn when not under torchrun (under torchrun: its WORLD_SIZE)")
    p.add_argument("--attn-dp", type=int, default=None,
                   help="attention-DP replicas d (ATP = g / d); default 2 when g >= 4 (crossed), else 1")
    p.add_argument("--residency-slots", type=int, default=1,
                   help="collectives resident per device at once (CPU: every work item; CUDA: the residency "
                        "gate of the collectives, 0 = no gate)")
    p.add_argument("--register-pairs", action="store_true",
                   help="register the conflicting pairs even where nothing crosses (one rank, ATP1 or ADP1)")
    p.add_argument("--rendezvous", choices=("auto", "gloo"), default="auto",
                   help="turnstile rendezvous: auto (shared memory on one host; in-process at g=1) or gloo "
                        "(over the gloo control group, also at g=1)")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--segments", type=int, default=6)
    p.add_argument("--d-iters", type=int, default=200)
    p.add_argument("--span", type=int, default=1)
    p.add_argument("--matmul", type=int, default=48, help="compute items: [m, m] matmuls")
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--phase-offset-ms", type=float, default=3.0)
    p.add_argument("--skew-ms", type=float, default=0.0)
    p.add_argument("--skew-mode", choices=SKEW_MODES, default="random",
                   help="crossed: opposite first-phase orders on neighbouring ranks (deterministic stall "
                        "under --ordering none; see HarnessSpec.skew_mode)")
    p.add_argument("--p-delay-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-s", type=float, default=2.0, help="watchdog: no progress for this long -> StallError")
    p.add_argument("--rendezvous-timeout-s", type=float, default=10.0)
    p.add_argument("--coll-timeout-s", type=float, default=60.0, help="process-group timeout of the data groups")
    p.add_argument("--out", default=None, help="traces, frontiers and summary.json (default runs/nccl_harness/<name>)")
    p.add_argument("--expect", choices=("auto", "stall", "complete", "any"), default="auto")
    p.add_argument("--no-trace-check", action="store_true", help="skip trace-check of completed runs")
    p.add_argument("--deadline-s", type=float, default=300.0,
                   help="hard limit of the whole launch: a rank still running is ended (exit code 124)")
    p.add_argument("--cuda-max-connections", type=int, default=None,
                   help="set CUDA_DEVICE_MAX_CONNECTIONS for the ranks (an experiment knob; the repro's "
                        "determinism comes from the residency gate)")
    return p


def default_attn_dp(world_size: int) -> int:
    return 2 if world_size >= 4 and world_size % 2 == 0 else 1


def build_specs(args: argparse.Namespace, world_size: int, backend: str) -> list[HarnessSpec]:
    """One :class:`HarnessSpec` per ``--ordering`` entry (validated, not needing the runtime)."""
    orderings = [o.strip() for o in args.ordering.split(",") if o.strip()]
    if not orderings:
        raise ConfigError("--ordering is empty")
    d = args.attn_dp if args.attn_dp is not None else default_attn_dp(world_size)
    out = Path(args.out) if args.out else Path("runs/nccl_harness") / f"{backend}-g{world_size}-d{d}"
    specs = []
    for i, o in enumerate(orderings):
        s = HarnessSpec(world_size=world_size, attn_dp=d, ordering=o, backend=backend,
                        residency_slots=args.residency_slots, register_pairs=args.register_pairs,
                        rendezvous=args.rendezvous, epochs=args.epochs, segments=args.segments,
                        d_iters=args.d_iters, span=args.span, matmul=args.matmul, jitter_ms=args.jitter_ms,
                        phase_offset_ms=args.phase_offset_ms, skew_ms=args.skew_ms, skew_mode=args.skew_mode,
                        p_delay_ms=args.p_delay_ms, seed=args.seed, stall_s=args.stall_s,
                        rendezvous_timeout_s=args.rendezvous_timeout_s, coll_timeout_s=args.coll_timeout_s,
                        run_dir=str(out / o), tag=f"cli{i}-{o}")
        s.validate(need_runtime=False)
        specs.append(s)
    if len(set(orderings)) != len(orderings):
        raise ConfigError(f"--ordering lists an ordering twice: {orderings}")
    stalls = [s.ordering for s in specs[:-1] if expectation(s, args.expect) == "stall"]
    if stalls:
        raise ConfigError(f"--ordering {args.ordering}: {stalls[0]!r} is expected to stall, which ends the launch; "
                          f"run it last or in its own launch")
    return specs


def expectation(spec: HarnessSpec, expect: str = "auto") -> str:
    """``stall``, ``complete`` or ``any`` for this run."""
    if expect != "auto":
        return expect
    from ainfer_pd.comm.topology import Topology
    crossed = Topology(spec.world_size, spec.attn_dp, 1, 0).crossed
    if spec.ordering == "none" and crossed:
        if spec.residency_slots < 1:
            return "any"
        # CPU: every work item holds the slot, jitter alone closes the cycle within ~50 D iterations;
        # CUDA: only collectives hold it, so the cycle is certain only with the adversarial start
        if spec.backend == "nccl" and spec.skew_mode != "crossed":
            return "any"
        return "stall"
    return "complete"


# ====================================================================== one rank
def rank_summary(rank: int, specs: list[HarnessSpec], results: list[dict], error: BaseException | None) -> list[dict]:
    """JSON-able outcome of every spec on this rank (``not-run`` after a failure)."""
    out = []
    for i, s in enumerate(specs):
        row: dict[str, Any] = {"rank": rank, "index": i, "ordering": s.ordering}
        if i < len(results):
            row.update(status="completed", result=results[i])
        elif i == len(results) and error is not None:
            status = ("stalled" if isinstance(error, StallError) else
                      "peer-lost" if isinstance(error, PeerLostError) else "failed")
            fr = getattr(error, "frontier", None) or {}
            row.update(status=status, error_type=type(error).__name__, error=summarize_error(error),
                       message=str(error)[:MESSAGE_CHARS], cycle=list(getattr(error, "cycle", None) or []),
                       frontier_d_p={str(r): [f.get("d_done"), f.get("p_done")] for r, f in sorted(fr.items())})
        else:
            row.update(status="not-run")
        out.append(row)
    return out


def _run_rank(rank: int, world_size: int, specs: list[HarnessSpec]) -> tuple[list[dict], BaseException | None]:
    results: list[dict] = []
    error = None
    try:
        asyncio.run(rank_main(rank, world_size, specs, results=results))
    except Exception as exc:  # noqa: BLE001 - the outcome is data here: reported, compared with the expectation
        error = exc
    return rank_summary(rank, specs, results, error), error


def cli_rank(rank: int, world_size: int, specs: list[HarnessSpec]) -> list[dict]:
    """Spawned rank of the launcher: never raises, returns :func:`rank_summary`."""
    return _run_rank(rank, world_size, specs)[0]


# ====================================================================== report
def _verdict(spec: HarnessSpec, rows: list[dict], expect: str, check: dict | None) -> tuple[bool, list[str]]:
    n = len(rows)
    done = [r for r in rows if r["status"] == "completed"]
    stalled = [r for r in rows if r["status"] == "stalled"]
    cyc = next((r["cycle"] for r in rows if r.get("cycle")), None)
    lines = []
    if len(done) == n:
        res = [r["result"] for r in done]
        rounds = sorted({x["rounds"] for x in res})
        exp_rounds = expected_rounds(spec)
        ov = res[0]["overlap"] or {}
        what = (f"COMPLETED on {n}/{n} ranks: {res[0]['d_done']} D iterations, {res[0]['p_done']} P segments per rank"
                f" in {max(x['wall_s'] for x in res):.2f} s")
        if spec.ordering != "none":
            what += f"; turnstile rounds {rounds} (expected {exp_rounds}), rendezvous {res[0]['rendezvous_kind']}"
        what += (f"; registered-pair overlap {1e3 * ov.get('registered_pair_overlap_s', 0.0):.3f} ms, "
                 f"other P work vs D {1e3 * ov.get('other_p_vs_d_overlap_s', 0.0):.3f} ms")
        ok_rounds = spec.ordering == "none" or rounds == [exp_rounds]
        ok_check = True
        if check is not None:
            if spec.ordering == "none":
                lines.append(f"  trace-check: {len(check['violations'])} violations (no device order under "
                             f"isolation only; informational)")
            else:
                ok_check = check["ok"] and check["registered_pair_overlap_ms"] == 0.0
                lines.append(f"  trace-check: {'OK' if check['ok'] else 'VIOLATIONS'}: "
                             f"{len(check['violations'])} violations, {check['pairs_checked']} registered P "
                             f"collectives checked, {check['rendezvous_per_rank']} rendezvous per rank, "
                             f"registered-pair overlap {check['registered_pair_overlap_ms']:.3f} ms")
                lines.extend(f"    {v}" for v in check["violations"][:10])
        ok = expect in ("complete", "any") and ok_rounds and ok_check
    else:
        kinds = {}
        for r in rows:
            kinds[r["status"]] = kinds.get(r["status"], 0) + 1
        what = ("STALLED: " if stalled else "FAILED: ") + ", ".join(f"{k} on {v}/{n} ranks" for k, v in sorted(kinds.items()))
        if cyc:
            what += "; wait cycle " + " -> ".join(str(x) for x in cyc)
        fr = next((r["frontier_d_p"] for r in rows if r.get("frontier_d_p")), None)
        if fr:
            what += "; frontier (D iterations, P segments): " + ", ".join(f"{k}: {tuple(v)}" for k, v in fr.items())
        for r in rows:
            if r["status"] not in ("completed", "not-run"):
                lines.append(f"  rank {r['rank']}: {r['error']}")
        first = next((r for r in rows if r.get("cycle")), None) or next((r for r in rows if r.get("message")), None)
        if first is not None:
            lines.append(f"  --- rank {first['rank']} report ---")
            lines.extend("  " + x for x in first["message"].splitlines())
        ok = expect == "any" or (expect == "stall" and not done and bool(stalled) and bool(cyc))
    return ok, [f"[{spec.ordering}] {what} (expected: {expect}) -> {'OK' if ok else 'UNEXPECTED'}"] + lines


def report(specs: list[HarnessSpec], per_rank: list[list[dict]], *, expect: str = "auto",
           trace_check: bool = True) -> tuple[bool, str, list[dict]]:
    """Compare every run with its expectation; returns (ok, text, JSON rows)."""
    from ainfer_pd.comm.topology import Topology
    from ainfer_pd.tools.tracecheck import check_run_dir

    s0 = specs[0]
    topo = Topology(s0.world_size, s0.attn_dp, 1, 0)
    head = (f"== ainfer-pd NCCL harness: backend {s0.backend} "
            f"({'cuda:LOCAL_RANK per rank' if s0.backend == 'nccl' else 'CPU stand-in'}), {topo.describe().split(';')[0]}, "
            f"residency slots {s0.residency_slots}, registered pairs: "
            f"{', '.join(registry_for(topo, s0).describe()) or 'none'}")
    lines = [head]
    rows_json = []
    all_ok = True
    for i, s in enumerate(specs):
        rows = [pr[i] for pr in per_rank]
        if all(r["status"] == "not-run" for r in rows):
            lines.append(f"[{s.ordering}] not run (an earlier run of this launch failed)")
            all_ok = False
            continue
        check = None
        if trace_check and s.run_dir and all(r["status"] == "completed" for r in rows):
            check = check_run_dir(s.run_dir)
        ok, text = _verdict(s, rows, expectation(s, expect), check)
        all_ok &= ok
        lines.extend(text)
        rows_json.append({"ordering": s.ordering, "run_dir": s.run_dir, "expect": expectation(s, expect), "ok": ok,
                          "ranks": rows, "trace_check": None if check is None else
                          {k: check[k] for k in ("ok", "violations", "pairs_checked", "rendezvous_per_rank",
                                                 "registered_pair_overlap_ms", "other_p_vs_d_overlap_ms")}})
    lines.append(f"RESULT: {'OK (every run as expected)' if all_ok else 'UNEXPECTED (see above)'}")
    return all_ok, "\n".join(lines), rows_json


def _write_summary(specs: list[HarnessSpec], rows: list[dict], ok: bool) -> None:
    if not specs[0].run_dir:
        return
    out = Path(specs[0].run_dir).parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"ok": ok, "runs": rows}, indent=1, default=str))


# ====================================================================== drivers
def _arm_deadline(seconds: float, rank: int) -> None:
    """A rank still alive after ``seconds`` prints why and exits 124 (nothing hangs)."""
    def fire() -> None:
        print(f"[rank {rank}] deadline of {seconds:g} s passed: exiting (124)", file=sys.stderr, flush=True)
        os._exit(124)
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)      # no interpreter teardown: a stream thread or NCCL kernel may still be stuck


def _torchrun_main(args: argparse.Namespace, backend: str) -> int:
    from ainfer_pd.launch import get_store, init_distributed

    ctx = init_distributed(timeout_s=max(60.0, args.rendezvous_timeout_s))
    rank, ws = ctx.rank, ctx.world_size
    _arm_deadline(args.deadline_s, rank)
    if args.world_size is not None and args.world_size != ws:
        raise ConfigError(f"--world-size {args.world_size} but torchrun started {ws} ranks")
    specs = build_specs(args, ws, backend)
    rows, _ = _run_rank(rank, ws, specs)
    for r in rows:
        if r["status"] != "not-run":
            res = r.get("result") or {}
            what = (f"completed: {res.get('d_done')} D iterations, {res.get('p_done')} P segments, "
                    f"{res.get('rounds')} rounds" if r["status"] == "completed" else r.get("error", ""))
            print(f"[rank {rank}] {r['ordering']}: {what}", flush=True)
    store = get_store()
    store.set(f"{_KEY}/rows/{rank}", json.dumps(rows, default=str))
    if rank != 0:
        return 0
    per_rank: list[list[dict] | None] = [None] * ws
    end = time.monotonic() + args.stall_s + 30.0
    while time.monotonic() < end and any(p is None for p in per_rank):
        for r in range(ws):
            if per_rank[r] is None and store.check([f"{_KEY}/rows/{r}"]):
                per_rank[r] = json.loads(store.get(f"{_KEY}/rows/{r}").decode())
        time.sleep(0.05)
    missing = [r for r, p in enumerate(per_rank) if p is None]
    for r in missing:
        per_rank[r] = [{"rank": r, "index": i, "ordering": s.ordering, "status": "failed",
                        "error": f"rank {r} reported nothing (died or still stuck)", "error_type": "missing"}
                       for i, s in enumerate(specs)]
    ok, text, json_rows = report(specs, per_rank, expect=args.expect, trace_check=not args.no_trace_check)
    print(text, flush=True)
    _write_summary(specs, json_rows, ok)
    return 0 if ok else 1


def _spawn_main(args: argparse.Namespace, backend: str) -> int:
    from ainfer_pd.errors import RankFailedError
    from ainfer_pd.launch import spawn

    ws = args.world_size or 1
    specs = build_specs(args, ws, backend)
    if backend == "nccl":
        import torch
        if torch.cuda.device_count() < ws:
            from ainfer_pd.errors import BackendUnavailableError
            raise BackendUnavailableError(f"--world-size {ws} with nccl needs {ws} GPUs, "
                                          f"{torch.cuda.device_count()} visible")
    env = {}
    if args.cuda_max_connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(args.cuda_max_connections)
    try:
        results = spawn(cli_rank, ws, (specs,), args.deadline_s, return_exceptions=True,
                        fail_grace_s=args.stall_s + 20.0, env=env)
    except RankFailedError as exc:
        results = exc.results or [exc] * ws
    per_rank = []
    for r, v in enumerate(results):
        if isinstance(v, BaseException) or v is None:
            per_rank.append([{"rank": r, "index": i, "ordering": s.ordering, "status": "failed",
                              "error": summarize_error(v) if v is not None else "no result",
                              "error_type": type(v).__name__} for i, s in enumerate(specs)])
        else:
            per_rank.append(v)
    ok, text, json_rows = report(specs, per_rank, expect=args.expect, trace_check=not args.no_trace_check)
    print(text, flush=True)
    _write_summary(specs, json_rows, ok)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from ainfer_pd.launch import is_torchrun

    args = build_parser().parse_args(argv)
    if args.cuda_max_connections is not None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(args.cuda_max_connections)   # before CUDA starts
    torchrun = is_torchrun() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)
    try:
        backend = data_backend_for("auto") if args.backend == "auto" else args.backend
        check_backend(backend)            # typed refusal (e.g. nccl without CUDA) before any rank starts
        code = _torchrun_main(args, backend) if torchrun else _spawn_main(args, backend)
    except AInferPDError as exc:
        print(f"ainfer-pd NCCL harness: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 2
    if torchrun:
        _exit(code)
    return code
