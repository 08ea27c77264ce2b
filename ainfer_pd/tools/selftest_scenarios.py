"""The runs the self-test (:mod:`.selftest`) and its Table 4 grid (:mod:`.selftest_grid`) are made
of: the tiny crossed config, a small paper-shaped trace, and its greedy tokens at world size 1."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

TIME_SCALE = 0.1
"""Every self-test replay's tool-wait scale."""


def crossed_config(run_dir: Path | str, **over: Any):
    """``configs/tiny-crossed-cpu.yaml`` (fine-grained, traced to ``run_dir``) with ``over``."""
    from ..config import WorkerConfig
    from ..config_files import config_path
    base = {"scheduler.policy": "fine-grained", "trace_dir": str(run_dir)}
    base.update(over)
    return WorkerConfig.from_yaml(config_path("tiny-crossed-cpu")).replace(**base)


def small_trace(n: int = 6, turns: int = 3, seed: int = 0):
    """A small paper-shaped trace for the tiny models (token scale 0.25, contexts up to 4096)."""
    from .trace import make_trace
    return make_trace(n, turns, token_scale=0.25, max_context=4096, seed=seed)


def single_rank_outputs(trace) -> dict:
    """Greedy tokens of every turn of ``trace`` at world size 1 (``configs/tiny-cpu.yaml``)."""
    from .. import RolloutWorker
    from ..config import WorkerConfig
    from ..config_files import config_path
    from .replay import replay

    async def go():
        async with RolloutWorker(WorkerConfig.from_yaml(config_path("tiny-cpu"))) as w:
            return await replay(w, trace, cell="trace", seed=0, time_scale=TIME_SCALE)
    return asyncio.run(go()).outputs
