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
    # the decode and prefill graphs at least (so the walk cannot pass by finding nothing)
    assert {HOME, "ainfer_pd/engine/runtime/prefill_graphs.py"} <= set(sites)
