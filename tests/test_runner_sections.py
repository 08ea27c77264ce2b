"""The model runner takes its own config sections (issue 35, item 5): ``RunnerSections.from_config``
picks them, a whole WorkerConfig is refused by name, and the engine's runner exposes
``runner.sections`` (no ``runner.cfg``; nothing in the library or benchmarks reads one)."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from ainfer_pd import RolloutWorker
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
from ainfer_pd.errors import ConfigError
from tests.conftest import tiny_cfg

ROOT = Path(__file__).resolve().parents[1]


def test_the_sections_are_the_configs_own():
    cfg = tiny_cfg()
    s = RunnerSections.from_config(cfg)
    assert {f.name for f in dataclasses.fields(s)} == {"model", "cache", "device", "scheduler", "spec", "parallel"}
    assert all(getattr(s, f.name) is getattr(cfg, f.name) for f in dataclasses.fields(s))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model = cfg.model


def test_a_whole_worker_config_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"RunnerSections\.from_config\(cfg\).*got WorkerConfig"):
        ModelRunner(tiny_cfg(), torch.device("cpu"), KVCacheManager(16, 16))


def test_the_engines_runner_exposes_its_sections_not_the_config():
    async def go():
        cfg = tiny_cfg()
        async with RolloutWorker(cfg) as w:
            r = w.engine.runner
            assert r.sections == RunnerSections.from_config(cfg) and not hasattr(r, "cfg")
    asyncio.run(go())
    readers = [f"{p.relative_to(ROOT)}" for d in ("ainfer_pd", "benchmarks") for p in (ROOT / d).rglob("*.py")
               if "runner.cfg" in p.read_text()]
    assert not readers, readers
