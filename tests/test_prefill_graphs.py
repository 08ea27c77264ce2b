"""The P graphs' host-side rules (the capture and replay themselves run on the GPU gate)."""
from ainfer_pd import WorkerConfig
from ainfer_pd.engine.runtime.cuda_graphs import graph_buckets
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.runtime.prefill_graphs import prefill_graph_buckets
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections


def test_prefill_graph_buckets_stop_at_the_prefill_budget():
    assert prefill_graph_buckets((16, 32, 512, 2048), 1024) == (16, 32, 512)
    assert prefill_graph_buckets((64, 16, 16), 4096) == (16, 64)
    assert prefill_graph_buckets((), 4096) == ()


def test_decode_graph_buckets_cover_the_whole_context_by_default():
    sizes, ctxs = graph_buckets((1, 4, 16, 64, 256), 64, (2048, 8192), 0, 16384)
    assert sizes == (1, 4, 16, 64) and ctxs == (2048, 8192, 16384)
    assert graph_buckets((1,), 8, (2048, 8192), 0, 40960)[1][-1] == 40960       # max_position_embeddings
    assert graph_buckets((1,), 8, (2048, 8192), 4096, 16384)[1] == (2048, 4096)  # an explicit, smaller cover
    assert graph_buckets((1,), 8, (2048, 8192), 0, 1024)[1] == (1024,)


def test_a_cpu_runner_refuses_prefill_graphs_and_says_why():
    cfg = WorkerConfig.from_yaml("configs/tiny-cpu.yaml")
    r = ModelRunner(RunnerSections.from_config(cfg), __import__("torch").device("cpu"), KVCacheManager(64, cfg.cache.block_size))
    assert r.prefill_graphs_refusal() == "no CUDA device"
    assert r.capture_prefill_graphs() == 0 and r.pgraphs is None
    plan = r.build([], [])
    assert plan.replay is None
