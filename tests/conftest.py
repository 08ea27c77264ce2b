import asyncio
import gc
import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter (set before any kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Rank processes fork from one pre-imported server instead of each importing torch (~8 s a 4-rank
# world on the 2-core VM); test_dist_rendezvous covers the library's default, spawn, too.
os.environ.setdefault("AINFER_PD_START_METHOD", "forkserver")

from ainfer_pd import RolloutWorker, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def tiny_cfg(**overrides) -> WorkerConfig:
    cfg = WorkerConfig.from_yaml(TINY)
    return cfg.replace(**overrides) if overrides else cfg


def cpu_runner(cfg: WorkerConfig, num_blocks: int = 64):
    """A model runner of ``cfg`` on the CPU over a KV cache of ``num_blocks`` blocks of the config's size."""
    from ainfer_pd.engine.kv.kv_cache import KVCacheManager
    from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
    return ModelRunner(RunnerSections.from_config(cfg), torch.device("cpu"), KVCacheManager(num_blocks, cfg.cache.block_size))


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


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """name -> directory of a tiny sharded Hugging Face model (tests/_hf_models.py), built on
    first use and kept for the session."""
    from tests import _hf_models
    root = tmp_path_factory.mktemp("hf")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _hf_models.build(name, root)
        return built[name]
    return get


def hf_worker_cfg(path, policy: str = "normal", **sections) -> WorkerConfig:
    """A CPU float32 worker config for a Hugging Face directory (small KV cache; multiplexing
    switches on for any concurrent prefill, so fine-grained really segments)."""
    over = {"model": {"dtype": "float32"}, "device": {"device": "cpu"},
            "cache": {"block_size": 16, "num_blocks": 256},
            "scheduler": {"policy": policy, "max_prefill_tokens": 512, "max_decode_batch": 16},
            "mux": {"activation_threshold": 1}}
    for k, v in sections.items():
        over.setdefault(k, {}).update(v)
    return WorkerConfig.from_pretrained(path, over)


# ---------------------------------------------------------------------------- Ray (the verl tests)
HAVE_VERL = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("ray") is not None
_RAY_LAST_USER: list[str] = []


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the verl tests (tests/test_verl_*.py): started by the first test that
    needs it and shut down right after the last one (``pytest_runtest_teardown`` below), instead of a
    start (~4 s on the 2-core VM) and a shutdown per module."""
    if not HAVE_VERL:
        pytest.skip("verl/ray not installed: pip install -e '.[verl]'")
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def _verl_shared(ray_cluster, hf_model_dir):
    """The verl tests' shared replicas, launched together (a launch is ~5 s on the 2-core VM, mostly
    the server process's imports): ``launch_replica(routing_replay=True)`` (the tiny config) with
    verl's default router over it, and one of the tiny qwen3_moe Hugging Face directory."""
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.router import get_router_handle

    from tests.test_verl_integration import kill, launch_replica
    path = hf_model_dir("qwen3_moe")

    async def launch():
        return await asyncio.gather(
            launch_replica("shared", routing_replay=True),
            launch_replica("shared_hf", model_config=HFModelConfig(path=str(path), load_tokenizer=False),
                           overrides={"cache.num_blocks": 256}))
    default, hf = asyncio.run(launch())
    router = get_router_handle(servers={default.server_address: default.server_handle})   # starts meanwhile
    yield {"default": default, "router": router, "hf": (hf, path)}
    import ray
    if ray.is_initialized():          # else Ray is down already (after the last verl test), its actors too
        ray.kill(router)
        for replica in (default, hf):
            asyncio.run(kill(replica))


@pytest.fixture(scope="session")
def _verl_llm_servers(ray_cluster, tmp_path_factory):
    from verl.workers.rollout.llm_server import LLMServerManager

    from tests.test_verl_contract import _ppo_config
    from tests.test_verl_integration import kill
    from trainer_examples.verl.make_tiny_cpu import build_model
    model_dir = tmp_path_factory.mktemp("verl_ppo") / "model"
    build_model(str(model_dir))
    cfg = _ppo_config(str(model_dir))

    async def create():
        return await LLMServerManager.create(cfg)   # worker_group=None -> init_standalone (CPU: no GPU pool)
    servers = asyncio.run(create())
    yield servers, cfg
    import ray
    if ray.is_initialized():
        for replica in servers.get_replicas():
            asyncio.run(kill(replica))


async def _as_launched(replica) -> None:
    """Nothing in flight, the prefix cache dropped (abort_all_requests' default) and no retained
    trajectory: what the next test sees is a launched replica's state (its counters aside)."""
    await replica.abort_all_requests()
    await replica.resume_generation()
    await replica.clear_kv_cache()
    assert (await replica.server_handle.metrics.remote())["server"]["retained"] == 0


@pytest.fixture
async def verl_replica(_verl_shared):
    """A replica of ``launch_replica(routing_replay=True)`` (tests/test_verl_integration.py: the tiny
    config, verl's ``enable_rollout_routing_replay`` on, so the routing-replay test shares it; the
    replicas of the other verl tests keep it off), one for the session: each test gets it as
    launched, with the launch weights (a test that syncs others puts them back); its server
    counters are cumulative, so a test reads them as differences."""
    await _as_launched(_verl_shared["default"])
    return _verl_shared["default"]


@pytest.fixture
def verl_router(verl_replica, _verl_shared):
    """verl's default router (``get_router_handle``: a Ray actor, ~5 s to start on the 2-core VM) over
    :func:`verl_replica`'s one server, one for the session."""
    return _verl_shared["router"]


@pytest.fixture
async def verl_llm_servers(_verl_llm_servers):
    """(verl's LLMServerManager, its config): the replica and router it launches for verl's own
    ``ppo_trainer`` config (hydra compose, as ``main_ppo`` builds it: ``_ppo_config`` in
    tests/test_verl_contract.py) on a tiny Qwen3-MoE directory, one for the session (~10 s to launch
    on the 2-core VM); each test gets its replica as launched (:func:`verl_replica`)."""
    for replica in _verl_llm_servers[0].get_replicas():
        await _as_launched(replica)
    return _verl_llm_servers


@pytest.fixture
async def verl_hf_replica(_verl_shared):
    """(replica, model directory): a replica of verl's ``actor_rollout_ref.model.path`` = the tiny
    qwen3_moe Hugging Face directory (``cache.num_blocks: 256``), one for the session, as
    :func:`verl_replica`."""
    await _as_launched(_verl_shared["hf"][0])
    return _verl_shared["hf"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    users = [it.nodeid for it in items if "ray_cluster" in getattr(it, "fixturenames", ())]
    _RAY_LAST_USER[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _RAY_LAST_USER and item.nodeid == _RAY_LAST_USER[0] and "ray" in sys.modules:
        import ray
        ray.shutdown()             # no Ray processes beside the tests after the last verl one


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (the README's command) the verl test files are one work unit: they share
    the session's Ray instance and replicas (``ray_cluster``, ``_verl_shared``, ``_verl_llm_servers``:
    ~45 s to start on the 2-core VM), which two workers would each start. The unit goes out first: it is the
    suite's longest (~2 min), and handed out late it would leave the other worker idle at the end. Every
    other file is its own unit, as under plain ``loadfile``."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    verl = "tests/test_verl_*.py"

    class VerlTogetherFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return verl if Path(path).name.startswith("test_verl_") else path

        def _assign_work_unit(self, node) -> None:
            if verl in self.workqueue:
                self.workqueue.move_to_end(verl, last=False)
            super()._assign_work_unit(node)
    return VerlTogetherFirst(config, log)


# --------------------------------------------------------------------------- garbage collection
_FROZEN_AT: list = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At each test module's first test: collect, then freeze what survived (imported modules,
    session fixtures, caches) out of the collector's reach. A full collection then walks only what
    the tests made since, instead of the whole session's heap (torch, verl, hypothesis: 0.3-0.5 s a
    collection late in the suite, 37 s of the suite's 13 min, 9 s inside one property test that
    sleeps a worker, whose ``gc.collect()`` is a full collection). What a test allocates is collected
    as before; only an object alive at a module's start that later ends in a reference cycle is never
    freed (memory, not behaviour: the tests see the same objects)."""
    if item.path != _FROZEN_AT[0]:
        _FROZEN_AT[0] = item.path
        gc.collect()
        gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long profiles of the property tests (tests/test_property_api.py)")
