import asyncio
import random
from pathlib import Path

import pytest
import torch

from ainfer_pd import RolloutWorker, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def tiny_cfg(**overrides) -> WorkerConfig:
    cfg = WorkerConfig.from_yaml(TINY)
    return cfg.replace(**overrides) if overrides else cfg


@pytest.fixture
def cfg() -> WorkerConfig:
    return tiny_cfg()


@pytest.fixture
async def worker(cfg):
    async with RolloutWorker(cfg) as w:
        yield w
        # NOTE: every test that uses the worker must leave no KV block behind.
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()
        assert w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


def rand_ids(rng: random.Random, n: int, vocab: int = 512) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long profiles of the property tests (tests/test_property_api.py)")
