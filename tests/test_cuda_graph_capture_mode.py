"""Every CUDA-graph capture in the library and its benchmarks passes ``capture_error_mode`` from the
one constant ``CAPTURE_MODE`` (engine/runtime/cuda_graphs.py, ``"thread_local"``): graphs are
captured on a stream's launcher thread while other threads make CUDA calls, which in torch's
default ``"global"`` mode invalidate the capture (cudaErrorStreamCaptureInvalidated at the GPU
gate). Read from the source (the capture itself needs a GPU)."""
from __future__ import annotations

import ast
from pathlib import Path

from ainfer_pd.engine.runtime.cuda_graphs import CAPTURE_MODE

ROOT = Path(__file__).resolve().parents[1]
HOME = "ainfer_pd/engine/runtime/cuda_graphs.py"


def _sources():
    for d in ("ainfer_pd", "benchmarks"):
        for p in sorted((ROOT / d).rglob("*.py")):
            yield str(p.relative_to(ROOT)), ast.parse(p.read_text())


def _is_capture(call: ast.Call) -> bool:
    """``torch.cuda.graph(...)`` (or ``cuda.graph`` / ``graph`` imported from torch.cuda) or a
    ``CUDAGraph.capture_begin(...)``."""
    f = call.func
    name = ast.unparse(f)
    return name in ("torch.cuda.graph", "cuda.graph") or (isinstance(f, ast.Attribute) and f.attr == "capture_begin")


def test_every_capture_site_passes_the_one_capture_mode():
    sites, bad, defined = [], [], []
    for rel, tree in _sources():
        imported = any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("cuda_graphs")
                       and any(a.name == "CAPTURE_MODE" for a in n.names) for n in ast.walk(tree))
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CAPTURE_MODE" for t in n.targets):
                defined.append(rel)
            if isinstance(n, ast.ImportFrom) and n.module == "torch.cuda" and any(a.name == "graph" for a in n.names):
                bad.append(f"{rel}:{n.lineno}: imports torch.cuda.graph by name (call it as torch.cuda.graph)")
            if not (isinstance(n, ast.Call) and _is_capture(n)):
                continue
            sites.append(rel)
            mode = {k.arg: k.value for k in n.keywords}.get("capture_error_mode")
            if not (isinstance(mode, ast.Name) and mode.id == "CAPTURE_MODE"):
                bad.append(f"{rel}:{n.lineno}: {ast.unparse(n)} does not pass capture_error_mode=CAPTURE_MODE")
            elif rel != HOME and not imported:
                bad.append(f"{rel}:{n.lineno}: CAPTURE_MODE is not imported from {HOME}")
    assert not bad, "\n".join(bad)
    assert defined == [HOME] and CAPTURE_MODE == "thread_local"
    # the library captures in one place, phase_capture (so the walk cannot pass by finding nothing):
    # the decode, MTP and prefill graph sets all go through it, each on its phase's stream
    assert [s for s in sites if s.startswith("ainfer_pd/")] == [HOME]


def test_the_library_captures_only_on_a_phase_stream():
    """``phase_capture`` passes ``stream=``: a capture on torch's one default capture stream would give
    the D and P graphs one cuBLAS workspace (the overlap / FP8 fine-grained hang), and the graph sets
    call ``phase_capture``, never ``torch.cuda.graph`` themselves."""
    tree = ast.parse((ROOT / HOME).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "phase_capture")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _is_capture(n)]
    assert len(calls) == 1 and "stream" in {k.arg for k in calls[0].keywords}
    for rel in (HOME, "ainfer_pd/engine/runtime/prefill_graphs.py"):
        src = (ROOT / rel).read_text()
        assert "phase_capture(fn, self.stream, self.pool)" in src, rel


class _Stale:
    """Stands for a released worker's graph set: a reference cycle whose finalizer would destroy
    CUDA graphs; it must run before the captures, never inside one."""

    freed_during_capture = False
    freed = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        _Stale.freed += 1
        if _CAPTURING[0]:
            _Stale.freed_during_capture = True


_CAPTURING = [False]


def test_graph_sets_capture_with_the_collector_off_after_collecting_stale_cycles(monkeypatch):
    """Both graph sets' ``capture_all`` (CUDA calls replaced: the loop and the session are what is
    tested) collect first and capture with the cyclic collector off, restored afterwards, even when
    a capture fails; a collection forced by allocations inside the loop would have freed the stale
    cycle mid-capture."""
    import gc

    import pytest
    import torch

    from ainfer_pd.engine.runtime import cuda_graphs, prefill_graphs

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    seen = []

    def capture(*args):
        _CAPTURING[0] = True
        try:
            seen.append(gc.isenabled())
            for _ in range(3000):          # allocations that would trigger a generation-0 collection
                [[] for _ in range(5)]
            if len(seen) == 3:
                raise RuntimeError("capture failed")
        finally:
            _CAPTURING[0] = False

    decode = cuda_graphs.DecodeGraphs.__new__(cuda_graphs.DecodeGraphs)
    decode.runner = type("R", (), {"device": "cpu"})()
    decode.batch_sizes, decode.ctx_buckets, decode.graphs, decode.verify_graphs = (1, 2), (16,), {}, {}
    decode.width = 1
    decode._capture = capture
    prefill = prefill_graphs.PrefillGraphs.__new__(prefill_graphs.PrefillGraphs)
    prefill.device, prefill.buckets, prefill.graphs = "cpu", (8, 16), {}
    prefill._capture = capture
    assert gc.isenabled()
    _Stale.freed = 0
    _Stale()
    decode.capture_all()
    assert _Stale.freed == 1 and not _Stale.freed_during_capture
    _Stale()
    with pytest.raises(RuntimeError, match="capture failed"):
        prefill.capture_all()
    assert seen == [False, False, False] and gc.isenabled()
    assert _Stale.freed == 2 and not _Stale.freed_during_capture
