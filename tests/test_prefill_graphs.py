"""The P graphs' host-side rules (the capture and replay themselves run on the GPU gate)."""
import torch

from ainfer_pd import WorkerConfig
from ainfer_pd.engine.runtime.cuda_graphs import graph_buckets
from ainfer_pd.engine.runtime.prefill_graphs import prefill_graph_buckets
from ainfer_pd.engine.runtime.runner import graph_captures
from ainfer_pd.phase import Phase, PhaseContext
from tests.conftest import cpu_runner


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
    r = cpu_runner(cfg)
    assert r.prefill_graphs_refusal() == "no CUDA device"
    assert r.capture_prefill_graphs(PhaseContext(Phase.PREFILL, None)) == 0 and r.pgraphs is None
    plan = r.build([], [])
    assert plan.replay is None


class _Device:
    """The device half of the engine's streams: which CUDA stream each stream name maps to."""

    def __init__(self):
        self.asked = []

    def cuda_stream(self, name, lane=None):
        self.asked.append((name, lane))
        return f"cuda:{name}"


class _Stream:
    def __init__(self, device, name):
        self.device, self.name = device, name


def test_each_phase_captures_its_graphs_on_its_own_stream(monkeypatch):
    """torch keys cuBLAS's workspace by (handle, stream): graphs of both phases captured on one stream
    would share one workspace and corrupt each other's split-K semaphores when replayed at once (the
    GPU gate's hang). The capture stream is the phase's own CUDA stream, or one the runner keeps per
    phase; never shared."""
    cfg = WorkerConfig.from_yaml("configs/tiny-cpu.yaml")
    r = cpu_runner(cfg)
    dev = _Device()
    d, p = PhaseContext(Phase.DECODE, _Stream(dev, "D")), PhaseContext(Phase.PREFILL, _Stream(dev, "P"))
    assert (r.phase_stream(d), r.phase_stream(p)) == ("cuda:D", "cuda:P")
    assert dev.asked == [("D", None), ("P", None)]
    assert [(c, f.__name__, label) for c, f, label in graph_captures(r, d, p)] == [
        (d, "capture_decode_graphs", "D.capture"), (p, "capture_prefill_graphs", "P.capture")]
    # without device streams (a runner driven by a benchmark) each phase gets a stream of its own, kept
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or f"stream{len(made)}")
    bare_d, bare_p = PhaseContext(Phase.DECODE, None), PhaseContext(Phase.PREFILL, None)
    assert r.phase_stream(bare_d) == "stream1" and r.phase_stream(bare_p) == "stream2"
    assert r.phase_stream(bare_d) == "stream1" and len(made) == 2
