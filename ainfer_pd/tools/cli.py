"""``ainfer-pd`` command line: ``replay | bench | trace | trace-check | selftest``.

Sub-commands live in :data:`SUBCOMMANDS` (name -> (help, setup(parser), run(args) -> int)).
Add one with :func:`subcommand` or by naming a module in :data:`LAZY_SUBCOMMANDS` that
defines ``setup_parser(parser)`` and ``run(args) -> int``; such modules are imported only
when the command runs (and a missing one gives a clear message, not a traceback).

With no arguments, ``ainfer-pd`` runs ``replay``: the multi-turn agentic workload on the
embedded tiny CPU model for ``normal`` and ``fine-grained``, with a progress bar, then
prints the comparison table (ratios against ``normal``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable

from ..errors import AInferPDError
from .options import add_workload_args, build_trace, config_of, csv_list, opt

SetupFn = Callable[[argparse.ArgumentParser], None]
RunFn = Callable[[argparse.Namespace], int]

#: name -> (help, setup_fn, run_fn)
SUBCOMMANDS: dict[str, tuple[str, SetupFn, RunFn]] = {}

#: name -> (module, help): the module defines ``setup_parser(parser)`` and ``run(args) -> int``.
LAZY_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "trace-check": ("ainfer_pd.tools.tracecheck", "check a run's cross-rank control trace (ordering contract)"),
    "selftest": ("ainfer_pd.tools.selftest", "run the SPEC section 7 ordering-contract self-test"),
    "timeline": ("ainfer_pd.tools.timeline_cli", "draw the P / D / rendezvous timeline of a run (failed runs too)"),
}


def subcommand(name: str, help: str) -> Callable[[SetupFn], Callable[[RunFn], RunFn]]:
    """Register ``name``: ``@subcommand("x", "help")(setup)(run)`` or use as nested decorators."""
    def with_setup(setup: SetupFn) -> Callable[[RunFn], RunFn]:
        def with_run(run: RunFn) -> RunFn:
            SUBCOMMANDS[name] = (help, setup, run)
            return run
        return with_run
    return with_setup


# --------------------------------------------------------------------------- replay and bench
def _check_world_size(args: argparse.Namespace) -> int | None:
    """None to go on in this process; an exit code when the launcher took over or is missing."""
    from ..launch import is_torchrun
    if is_torchrun():
        from .world import run_torchrun_cli
        return int(run_torchrun_cli(args) or 0)
    if args.world_size is None or args.world_size == 1:
        return None
    if args.world_size < 1:
        print("ainfer-pd: --world-size must be >= 1", file=sys.stderr)
        return 2
    from .world import run_cli
    return int(run_cli(args) or 0)


def _run_comparison(args: argparse.Namespace, *, policies: list[str], cells: list[str], repeats: int,
                    spans: list[str] | None) -> int:
    from . import bench
    ws = _check_world_size(args)
    if ws is not None:
        return ws
    cfg = config_of(args)
    trace = build_trace(args, cfg)
    variants = bench.make_variants(policies, span=args.span, spans=spans, priorities=csv_list(args.priorities))
    time_scale = opt(args, "time_scale")
    s = trace.summary()
    print(f"workload: {s['conversations']} conversations, {s['requests']} requests "
          f"({s['continuations']} continuations), {s['input_tokens']} input / {s['output_tokens']} output "
          f"tokens, max context {s['max_context']}; cells {','.join(cells)}, time scale {time_scale}; "
          f"policies {', '.join(v.name for v in variants)}; repeats {repeats}; config {args.config}"
          + (f"; model {args.model} ({cfg.model.architecture}, {cfg.model.num_params / 1e6:.1f}M params)"
             if getattr(args, "model", None) else ""),
          file=sys.stderr, flush=True)
    res = bench.run_async(bench.run_bench(cfg, trace, variants=variants, cells=cells, repeats=repeats,
                                          seed=args.seed, time_scale=time_scale,
                                          progress=not args.no_progress, out_dir=args.out),
                          use_uvloop=not args.no_uvloop)
    for cell, table in res.tables().items():
        print(table)
        bad = {k: v for k, v in res.output_mismatches.get(cell, {}).items() if v}
        if bad:
            print(f"WARNING: greedy outputs differ from {res.baseline!r}: {bad}")
        print()
    print(f"wall time {res.wall_s:.1f} s" + (f"; results in {args.out}" if args.out else ""))
    if args.json:
        print(json.dumps(bench._finite({"aggregates": res.aggregates,
                                        "output_mismatches": res.output_mismatches}), default=str))
    failures = sum(int(s.get("failures", 0)) for cell in res.summaries.values()
                   for runs in cell.values() for s in runs)
    return 1 if failures else 0


# --------------------------------------------------------------------------- replay
def _setup_replay(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, preset="tiny")
    p.add_argument("--policy", help="run this one policy")
    p.add_argument("--policies", default="normal,fine-grained",
                   help="comma-separated policies (default normal,fine-grained)")
    p.add_argument("--priorities", default="fifo,critical-path",
                   help="scheduler.priority values, each run with every policy (default fifo,critical-path)")
    p.add_argument("--cell", choices=sorted(_cells()), help="wait-pressure cell (preset default)")
    p.add_argument("--repeats", type=int, default=1)


def _run_replay(args: argparse.Namespace) -> int:
    policies = [args.policy] if args.policy else csv_list(args.policies)
    return _run_comparison(args, policies=policies, cells=[args.cell or opt(args, "cell")],
                           repeats=args.repeats, spans=None)


# --------------------------------------------------------------------------- bench
def _setup_bench(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, preset="tiny")
    p.add_argument("--policies", default="normal,global-complete,global-enqueue,fine-grained,mixed-chunked",
                   help="comma-separated policies")
    p.add_argument("--cells", default="P1", help="comma-separated cells among P1,P2,P3,P4,trace (default P1)")
    p.add_argument("--priorities", default="fifo",
                   help="scheduler.priority values, each run with every policy (e.g. fifo,critical-path)")
    p.add_argument("--repeats", type=int, default=3, help="runs per (cell, policy); median and IQR reported")
    p.add_argument("--spans", help="fine-grained span sweep, e.g. 1,2,3,4,auto (adds fine-grained/K=.. variants)")


def _run_bench(args: argparse.Namespace) -> int:
    return _run_comparison(args, policies=csv_list(args.policies), cells=csv_list(args.cells), repeats=args.repeats,
                           spans=csv_list(args.spans) if args.spans else None)


# --------------------------------------------------------------------------- trace
def _setup_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="JSONL", help="write the trace here")
    p.add_argument("--conversations", type=int, help="conversations (trajectories); default 128 (grpo-long: 64)")
    p.add_argument("--max-turns", type=int, help="turns per conversation at most; default 10 (grpo-long: 6)")
    p.add_argument("--token-scale", type=float, default=1.0)
    p.add_argument("--wait-scale", type=float, default=1.0)
    p.add_argument("--max-context", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("paper", "grpo-long"), default="paper",
                   help="paper (default) or grpo-long (--conversations trajectories in groups of --group-size; "
                        "--max-turns 6 unless given)")
    p.add_argument("--group-size", type=int, default=8, help="grpo-long: siblings per prompt group (default 8)")


def _run_trace(args: argparse.Namespace) -> int:
    from .trace import PAPER_PERCENTILES, grpo_agentic_trace, make_trace
    if args.workload == "grpo-long":
        g, turns = args.group_size, args.max_turns or 6
        t = grpo_agentic_trace(-(-(args.conversations or 64) // g), g, turns, min_turns=min(2, turns),
                               token_scale=args.token_scale, wait_scale=args.wait_scale,
                               max_context=args.max_context, seed=args.seed)
    else:
        t = make_trace(args.conversations or 128, args.max_turns or 10, token_scale=args.token_scale,
                       wait_scale=args.wait_scale, max_context=args.max_context, seed=args.seed)
    if args.out:
        t.save_jsonl(args.out)
    s = t.summary()
    pct = s.pop("percentiles")
    print(json.dumps(s, indent=1))
    print(f"{'quantity':18s} {'p50':>10s} {'p90':>10s} {'p99':>10s}   paper p50/p90/p99")
    for k, v in pct.items():
        tgt = PAPER_PERCENTILES.get(k)
        print(f"{k:18s} " + " ".join(f"{x:10.1f}" for x in v) + (f"   {tgt}" if tgt else ""))
    return 0


def _cells() -> list[str]:
    from .trace import CELLS
    return list(CELLS)


SUBCOMMANDS["replay"] = ("replay the multi-turn agentic workload and compare policies (default command)",
                         _setup_replay, _run_replay)
SUBCOMMANDS["bench"] = ("fixed-workload benchmark: policies x cells x repeats, median/IQR, plots",
                        _setup_bench, _run_bench)
SUBCOMMANDS["trace"] = ("generate a paper-shaped trace (JSONL) and print its statistics",
                        _setup_trace, _run_trace)


# --------------------------------------------------------------------------- lazy modules
def _lazy(name: str, module: str) -> tuple[SetupFn, RunFn]:
    def setup(p: argparse.ArgumentParser) -> None:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def run(args: argparse.Namespace) -> int:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            if getattr(exc, "name", None) and not module.startswith(exc.name):
                raise
            print(f"ainfer-pd {name}: not available in this build ({module} is missing)", file=sys.stderr)
            return 2
        sub = argparse.ArgumentParser(prog=f"ainfer-pd {name}")
        mod.setup_parser(sub)
        return int(mod.run(sub.parse_args(args.rest)) or 0)

    return setup, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ainfer-pd", description=__doc__.split("\n\n")[0].replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, setup, run) in SUBCOMMANDS.items():
        sp = subs.add_parser(name, help=help_, description=help_)
        setup(sp)
        sp.set_defaults(_run=run)
    for name, (module, help_) in LAZY_SUBCOMMANDS.items():
        if name in SUBCOMMANDS:
            continue
        setup, run = _lazy(name, module)
        sp = subs.add_parser(name, help=help_, description=help_, add_help=False)
        setup(sp)
        sp.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["replay", *argv]                  # bare flags belong to the default command
    if argv[0] in LAZY_SUBCOMMANDS and argv[0] not in SUBCOMMANDS:
        # the module parses its own flags (argparse REMAINDER would not take a leading --flag)
        _, run = _lazy(argv[0], LAZY_SUBCOMMANDS[argv[0]][0])
        args = argparse.Namespace(rest=argv[1:], _run=run)
    else:
        args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except AInferPDError as exc:
        print(f"ainfer-pd: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ainfer-pd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
