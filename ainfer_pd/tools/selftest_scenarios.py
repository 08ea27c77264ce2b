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


def twin_trace(trace):
    """``trace`` with every conversation twice in a row (ids ``2i``, ``2i + 1``). Conversation ``j``
    is served by replica ``j % ADP``, so at ADP 2 the twins run on different replicas, and both
    replicas prefill in the same epochs while their other conversations decode (sibling conversations
    of one prompt group split across the replicas): P's attention all-reduces on both replicas meet
    D's DP-attention collectives, which is what the crossed cycle of SPEC 2 needs."""
    from .trace_schema import Conversation, Trace
    convs = [Conversation(turns=list(c.turns), conv_id=2 * i + k) for i, c in enumerate(trace.conversations)
             for k in (0, 1)]
    return Trace(conversations=convs, meta={**trace.meta, "twins": True})


def table4_trace():
    """The Table 4 grid's trace: :func:`twin_trace` of a 3-conversation, 2-turn :func:`small_trace`
    (12 requests; under isolation only the crossed world stalls at its first multiplexed epoch)."""
    return twin_trace(small_trace(3, 2, seed=8))


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
