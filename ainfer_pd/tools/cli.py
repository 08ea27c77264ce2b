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
from pathlib import Path
from typing import Any, Callable

from .comm.ordering import ORDERINGS
from .errors import AInferPDError

SetupFn = Callable[[argparse.ArgumentParser], None]
RunFn = Callable[[argparse.Namespace], int]

#: name -> (help, setup_fn, run_fn)
SUBCOMMANDS: dict[str, tuple[str, SetupFn, RunFn]] = {}

#: name -> (module, help): the module defines ``setup_parser(parser)`` and ``run(args) -> int``.
LAZY_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "trace-check": ("ainfer_pd.metrics.tracecheck", "check a run's cross-rank control trace (ordering contract)"),
    "selftest": ("ainfer_pd.selftest", "run the SPEC section 7 ordering-contract self-test"),
    "timeline": ("ainfer_pd.metrics.timeline_cli", "draw the P / D / rendezvous timeline of a run (failed runs too)"),
}

DEFAULT_CONFIG = "configs/tiny-cpu.yaml"

#: ``--workload`` choices (``build_trace``).
WORKLOADS = ("paper", "p-heavy", "decode-only", "grpo-long")

#: Workload presets; individual flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    # the main job: ~280 requests on the tiny CPU model, about 2 minutes for two policies on 2 cores
    "tiny": {"conversations": 48, "max_turns": 6, "token_scale": 0.25, "time_scale": 0.1, "cell": "trace"},
    # the paper's trace at full scale (SPEC section 5)
    "paper": {"conversations": 128, "max_turns": 10, "token_scale": 1.0, "time_scale": 1.0, "cell": "P1"},
}


def subcommand(name: str, help: str) -> Callable[[SetupFn], Callable[[RunFn], RunFn]]:
    """Register ``name``: ``@subcommand("x", "help")(setup)(run)`` or use as nested decorators."""
    def with_setup(setup: SetupFn) -> Callable[[RunFn], RunFn]:
        def with_run(run: RunFn) -> RunFn:
            SUBCOMMANDS[name] = (help, setup, run)
            return run
        return with_run
    return with_setup


# --------------------------------------------------------------------------- shared options
def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _add_workload_args(p: argparse.ArgumentParser, *, preset: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"worker YAML config, or a packaged config's name (e.g. tiny-crossed-cpu; default {DEFAULT_CONFIG})")
    g.add_argument("--model", metavar="DIR",
                   help="a Hugging Face model directory (config.json + safetensors): the model section comes from "
                        "its config.json instead of --config's (config-only: seeded random init of its shapes)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=preset,
                   help=f"workload defaults (default {preset}: {PRESETS[preset]})")
    g.add_argument("--workload", choices=WORKLOADS, default="paper",
                   help="paper-shaped trace (default), P-heavy trace, the decode-only control, or grpo-long: "
                        "GRPO groups of --group-size siblings sharing a prompt, retained contexts on the "
                        "paper's distribution up to 14.8K (--conversations: trajectories, default 64; "
                        "--max-turns default 6)")
    g.add_argument("--group-size", type=int, metavar="G",
                   help="grpo-long: siblings per prompt group (default 8; --samples-per-prompt N > 1 is the same)")
    g.add_argument("--decode-only", action="store_true", help="alias of --workload decode-only")
    g.add_argument("--trace", metavar="JSONL", help="load the trace from a JSONL file instead of generating it")
    g.add_argument("--save-trace", metavar="JSONL", help="write the trace used to a JSONL file")
    g.add_argument("--scale", type=float, help="conversations = round(128 * SCALE) (paper trace)")
    g.add_argument("--conversations", type=int, help="number of conversations (overrides --scale)")
    g.add_argument("--max-turns", type=int, help="turns per conversation at most")
    g.add_argument("--token-scale", type=float, help="multiply every token count (clamped to >= 1)")
    g.add_argument("--max-context", type=int, help="truncate conversations to this context (default: the model's)")
    g.add_argument("--time-scale", type=float, help="multiply every tool wait (on top of the cell factor)")
    g.add_argument("--samples-per-prompt", type=int, default=1, metavar="N",
                   help="GRPO-shaped: each conversation becomes N sharing one first prompt, sampled with "
                        "their own seeds (prefix sharing: cache.prefix_sharing)")
    g.add_argument("--seed", type=int, default=0, help="trace and prompt seed (same for every policy)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (YAML value), e.g. --set device.high_priority_stream=P; repeatable")
    g.add_argument("--span", choices=("1", "2", "3", "4", "auto"), help="turnstile span of fine-grained runs")
    g.add_argument("--ordering", choices=ORDERINGS,
                   help="parallel.ordering of a multi-rank run: none (isolation only: can stall on a crossed "
                        "topology) | global-implicit | selective (default: the config's)")
    g.add_argument("--out", metavar="DIR", help="write results.json, runs.jsonl and plots here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop even if uvloop is installed")
    g.add_argument("--json", action="store_true", help="also print the aggregated results as JSON on stdout")
    g.add_argument("--world-size", type=int, default=1,
                   help="ranks (N > 1 needs the multi-rank launcher ainfer_pd.launch)")


def resolve_config_path(path: str) -> Path:
    """``--config``: a YAML file, or a packaged config's name (``tiny-cpu``, ``configs/tiny-cpu.yaml``
    from any directory); :class:`~ainfer_pd.config_files.UnknownConfigError` otherwise."""
    from .config_files import resolve_config
    return resolve_config(path)


def load_config(path: str, overrides: list[str] | None = None, model: str | None = None,
                ordering: str | None = None):
    """The YAML config at ``path`` with ``KEY=VALUE`` overrides (values parsed as YAML); with
    ``model`` (a Hugging Face directory) its model section is that directory's ``config.json``;
    ``ordering``: ``parallel.ordering`` (the ``--ordering`` switch; ``--set`` still wins)."""
    import yaml

    from .config import WorkerConfig
    from .errors import ConfigError
    cfg = WorkerConfig.from_yaml(resolve_config_path(path))
    if ordering:
        cfg = cfg.replace(**{"parallel.ordering": ordering})
    if model:
        data = cfg.to_dict()
        data["model"] = {"path": str(model)}
        cfg = WorkerConfig.from_dict(data)
    kv = {}
    for item in overrides or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. device.high_priority_stream=P")
        kv[key.strip()] = yaml.safe_load(value)
    return cfg.replace(**kv) if kv else cfg


def _opt(args: argparse.Namespace, name: str) -> Any:
    v = getattr(args, name, None)
    return PRESETS[args.preset][name] if v is None and name in PRESETS[args.preset] else v


def build_trace(args: argparse.Namespace, cfg: Any):
    """The trace the flags describe (same seed -> same trace for every policy)."""
    from .workload import trace as tr
    max_ctx = args.max_context or cfg.model.max_context_len
    workload = "decode-only" if args.decode_only else args.workload
    convs = args.conversations
    if convs is None and args.scale is not None:
        convs = max(1, round(tr.PAPER_CONVERSATIONS * args.scale))
    if convs is None:
        convs = _opt(args, "conversations")
    if args.trace:
        trace = tr.Trace.load_jsonl(args.trace)
    elif workload == "decode-only":
        ts = _opt(args, "token_scale")
        trace = tr.decode_only_trace(convs, gen_tokens=max(1, min(round(1024 * ts), max_ctx // 2)),
                                     seed=args.seed)
    elif workload == "p-heavy":
        ts = _opt(args, "token_scale")
        trace = tr.p_heavy_trace(convs, args.max_turns or 3, prompt_tokens=max(1, round(7680 * ts)),
                                 observation_tokens=max(1, round(3840 * ts)), gen_tokens=max(1, round(120 * ts)),
                                 seed=args.seed, max_context=max_ctx)
    elif workload == "grpo-long":
        trace = grpo_long_trace(args, max_ctx)
    else:
        trace = tr.make_trace(convs, _opt(args, "max_turns"), token_scale=_opt(args, "token_scale"),
                              max_context=max_ctx, seed=args.seed)
    n = getattr(args, "samples_per_prompt", 1) or 1
    if n > 1 and trace.samples_per_prompt == 1:
        trace = trace.with_samples_per_prompt(n)
    if args.save_trace:
        trace.save_jsonl(args.save_trace)
    return trace


def grpo_long_trace(args: argparse.Namespace, max_context: int | None):
    """``--workload grpo-long``: ``--conversations`` trajectories (default 64; ``--scale``: of 128)
    in groups of ``--group-size`` (rounded up to whole groups), ``--max-turns`` (default 6) turns at
    most, the preset's token scale unless ``--token-scale``."""
    from .errors import InvalidRequestError
    from .workload import trace_gen as tg
    g = getattr(args, "group_size", None)
    n = getattr(args, "samples_per_prompt", 1) or 1
    if g is None:
        g = n if n > 1 else tg.GRPO_GROUP_SIZE
    elif n > 1 and n != g:
        raise InvalidRequestError(f"--group-size {g} and --samples-per-prompt {n} disagree")
    if g < 1:
        raise InvalidRequestError(f"--group-size must be >= 1, got {g}")
    convs = args.conversations
    if convs is None and args.scale is not None:
        convs = max(1, round(128 * args.scale))
    convs = convs or tg.GRPO_GROUPS * tg.GRPO_GROUP_SIZE
    turns = args.max_turns or tg.GRPO_MAX_TURNS
    return tg.grpo_agentic_trace(-(-convs // g), g, turns, min_turns=min(tg.GRPO_MIN_TURNS, turns),
                                 token_scale=_opt(args, "token_scale"), max_context=max_context, seed=args.seed)


def _check_world_size(args: argparse.Namespace) -> int | None:
    """None to go on in this process; an exit code when the launcher took over or is missing."""
    from .launch import is_torchrun
    if is_torchrun():
        from .workload.world import run_torchrun_cli
        return int(run_torchrun_cli(args) or 0)
    if args.world_size is None or args.world_size == 1:
        return None
    if args.world_size < 1:
        print("ainfer-pd: --world-size must be >= 1", file=sys.stderr)
        return 2
    from .workload.world import run_cli
    return int(run_cli(args) or 0)


def _run_comparison(args: argparse.Namespace, *, policies: list[str], cells: list[str], repeats: int,
                    spans: list[str] | None) -> int:
    from . import bench
    ws = _check_world_size(args)
    if ws is not None:
        return ws
    cfg = load_config(args.config, getattr(args, "set", None), getattr(args, "model", None),
                      getattr(args, "ordering", None))
    trace = build_trace(args, cfg)
    variants = bench.make_variants(policies, span=args.span, spans=spans, priorities=_csv(args.priorities))
    time_scale = _opt(args, "time_scale")
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
    _add_workload_args(p, preset="tiny")
    p.add_argument("--policy", help="run this one policy")
    p.add_argument("--policies", default="normal,fine-grained",
                   help="comma-separated policies (default normal,fine-grained)")
    p.add_argument("--priorities", default="fifo,critical-path",
                   help="scheduler.priority values, each run with every policy (default fifo,critical-path)")
    p.add_argument("--cell", choices=sorted(_cells()), help="wait-pressure cell (preset default)")
    p.add_argument("--repeats", type=int, default=1)


def _run_replay(args: argparse.Namespace) -> int:
    policies = [args.policy] if args.policy else _csv(args.policies)
    return _run_comparison(args, policies=policies, cells=[args.cell or _opt(args, "cell")],
                           repeats=args.repeats, spans=None)


# --------------------------------------------------------------------------- bench
def _setup_bench(p: argparse.ArgumentParser) -> None:
    _add_workload_args(p, preset="tiny")
    p.add_argument("--policies", default="normal,global-complete,global-enqueue,fine-grained,mixed-chunked",
                   help="comma-separated policies")
    p.add_argument("--cells", default="P1", help="comma-separated cells among P1,P2,P3,P4,trace (default P1)")
    p.add_argument("--priorities", default="fifo",
                   help="scheduler.priority values, each run with every policy (e.g. fifo,critical-path)")
    p.add_argument("--repeats", type=int, default=3, help="runs per (cell, policy); median and IQR reported")
    p.add_argument("--spans", help="fine-grained span sweep, e.g. 1,2,3,4,auto (adds fine-grained/K=.. variants)")


def _run_bench(args: argparse.Namespace) -> int:
    return _run_comparison(args, policies=_csv(args.policies), cells=_csv(args.cells), repeats=args.repeats,
                           spans=_csv(args.spans) if args.spans else None)


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
    from .workload.trace import PAPER_PERCENTILES, grpo_agentic_trace, make_trace
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
    from .workload.trace import CELLS
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
