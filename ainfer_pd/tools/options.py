"""What the ``ainfer-pd`` commands share: the workload flags and their presets, the config they
load (``--config``, ``--model``, ``--set``, ``--ordering``) and the trace they build. The command
line (:mod:`.cli`) and the multi-rank replay (:mod:`.world`) both import it.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..comm.ordering import ORDERINGS
from ..config_files import resolve_config

#: ``--config`` default: the packaged tiny CPU model (:mod:`ainfer_pd.config_files`; also a file of a checkout).
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


def csv_list(text: str) -> list[str]:
    """``a, b,c`` -> ``['a', 'b', 'c']``."""
    return [t.strip() for t in text.split(",") if t.strip()]


def add_workload_args(p: argparse.ArgumentParser, *, preset: str) -> None:
    """The workload flags of ``replay`` and ``bench`` (``preset``: their default preset)."""
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
    g.add_argument("--response-budget", type=int, metavar="R",
                   help="each turn asks for R tokens (clamped to its context's room) and ends at the model's EOS, "
                        "sampled at temperature 1 with a seed a turn: a trainer's response budget, the turn's "
                        "length unknown to the engine (default: each turn asks for exactly its trace length)")
    g.add_argument("--eos-every", type=int, metavar="L",
                   help="give the (random-weight) model an EOS set of vocab/L random ids (model.stop_token_ids), "
                        "so a sampled turn ends after about L tokens; with --response-budget")
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
    return resolve_config(path)


def load_config(path: str, overrides: list[str] | None = None, model: str | None = None,
                ordering: str | None = None):
    """The YAML config at ``path`` with ``KEY=VALUE`` overrides (values parsed as YAML); with
    ``model`` (a Hugging Face directory) its model section is that directory's ``config.json``;
    ``ordering``: ``parallel.ordering`` (the ``--ordering`` switch; ``--set`` still wins)."""
    import yaml

    from ..config import WorkerConfig
    from ..errors import ConfigError
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


def config_of(args: argparse.Namespace):
    """The worker config the flags describe: ``--config`` / ``--model`` / ``--set`` /
    ``--ordering``, and ``--eos-every``'s EOS set (added to the model's stop ids)."""
    cfg = load_config(args.config, getattr(args, "set", None), getattr(args, "model", None),
                      getattr(args, "ordering", None))
    every = getattr(args, "eos_every", None)
    if every:
        from .replay import synthetic_eos_ids
        ids = synthetic_eos_ids(cfg.model.vocab_size, every, seed=args.seed)
        cfg = cfg.replace(**{"model.stop_token_ids": tuple(sorted(set(cfg.model.stop_token_ids) | set(ids)))})
    return cfg


def opt(args: argparse.Namespace, name: str) -> Any:
    """The flag ``name`` of ``args``, else the preset's value of it (``--preset``)."""
    v = getattr(args, name, None)
    return PRESETS[args.preset][name] if v is None and name in PRESETS[args.preset] else v


def build_trace(args: argparse.Namespace, cfg: Any):
    """The trace the flags describe (same seed -> same trace for every policy)."""
    from . import trace as tr
    max_ctx = args.max_context or cfg.model.max_context_len
    workload = "decode-only" if args.decode_only else args.workload
    convs = args.conversations
    if convs is None and args.scale is not None:
        convs = max(1, round(tr.PAPER_CONVERSATIONS * args.scale))
    if convs is None:
        convs = opt(args, "conversations")
    if args.trace:
        trace = tr.Trace.load_jsonl(args.trace)
    elif workload == "decode-only":
        ts = opt(args, "token_scale")
        trace = tr.decode_only_trace(convs, gen_tokens=max(1, min(round(1024 * ts), max_ctx // 2)),
                                     seed=args.seed)
    elif workload == "p-heavy":
        ts = opt(args, "token_scale")
        trace = tr.p_heavy_trace(convs, args.max_turns or 3, prompt_tokens=max(1, round(7680 * ts)),
                                 observation_tokens=max(1, round(3840 * ts)), gen_tokens=max(1, round(120 * ts)),
                                 seed=args.seed, max_context=max_ctx)
    elif workload == "grpo-long":
        trace = grpo_long_trace(args, max_ctx)
    else:
        trace = tr.make_trace(convs, opt(args, "max_turns"), token_scale=opt(args, "token_scale"),
                              max_context=max_ctx, seed=args.seed)
    n = getattr(args, "samples_per_prompt", 1) or 1
    if n > 1 and trace.samples_per_prompt == 1:
        trace = trace.with_samples_per_prompt(n)
    budget = getattr(args, "response_budget", None)
    if budget:
        trace = trace.with_response_budget(budget)
    if args.save_trace:
        trace.save_jsonl(args.save_trace)
    return trace


def grpo_long_trace(args: argparse.Namespace, max_context: int | None):
    """``--workload grpo-long``: ``--conversations`` trajectories (default 64; ``--scale``: of 128)
    in groups of ``--group-size`` (rounded up to whole groups), ``--max-turns`` (default 6) turns at
    most, the preset's token scale unless ``--token-scale``."""
    from ..errors import InvalidRequestError
    from . import trace_gen as tg
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
                                 token_scale=opt(args, "token_scale"), max_context=max_context, seed=args.seed)
