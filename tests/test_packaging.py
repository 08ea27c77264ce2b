"""The package's shape: the library never imports the harness (``ainfer_pd/tools/``), its module
import graph has no cycle, and a wheel built from the checkout works on its own (the console
script, the packaged configs, the verl registration) from outside the checkout.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import pytest

# Import cycles tolerated by the no-cycle check (each entry one cycle, its modules in import order):
# none. A mixin that needs its host class's types takes a Protocol instead (comm/experts/handles.py).
KNOWN_ENGINE_CYCLES: list[tuple[str, str]] = []
ENGINE_OWNED = re.compile(r"^ainfer_pd\.(engine|sched)(\.|$)|^ainfer_pd\.worker\w*$|^ainfer_pd\.faults$")

ROOT = Path(__file__).resolve().parents[1]
PKG = "ainfer_pd"
TOOLS = "ainfer_pd.tools"
HAVE_VERL = importlib.util.find_spec("verl") is not None and importlib.util.find_spec("ray") is not None


def _can_build_wheels() -> bool:
    """setuptools here (the wheel is built without isolation: no download), with its own
    bdist_wheel (setuptools >= 70.1) or the wheel package."""
    try:
        major, minor = (int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


# ---------------------------------------------------------------------------- the import graph
def _modules() -> dict[str, Path]:
    """Every module under ``ainfer_pd/`` by dotted name (a package is its ``__init__``)."""
    out = {}
    for p in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _import_statements(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """Every import of module ``name``, anywhere in it (function-local and TYPE_CHECKING imports
    too), as ``(absolute module, names imported from it)``: ``import a.b`` -> ``("a.b", [])``,
    ``from ..x import y`` in ``ainfer_pd.p.m`` -> ``("ainfer_pd.x", ["y"])``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, [a.name for a in node.names]))
    return out


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules under ``ainfer_pd/`` it imports. ``from p import y`` is an edge to the
    submodule ``p.y`` when there is one, else to ``p`` (a package: its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for base, names in _import_statements(name, path):
            for target in [f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names] or [base]:
                if target in mods:
                    edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]`` (iterative depth-first search), or None."""
    state: dict[str, int] = {}                   # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_library_never_imports_the_tools_layer():
    """No module under ``ainfer_pd/`` outside ``ainfer_pd/tools/`` imports ``ainfer_pd.tools``, not
    even lazily in a function, nor names it as a module to import (forkserver preload, import_module)."""
    offenders = []
    for name, path in _modules().items():
        if name == TOOLS or name.startswith(TOOLS + "."):
            continue
        targets = [t for base, names in _import_statements(name, path) for t in [base] + [f"{base}.{n}" for n in names]]
        hits = [t for t in targets if t == TOOLS or t.startswith(TOOLS + ".")]
        tree = ast.parse(path.read_text())
        hits += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and re.fullmatch(r"ainfer_pd\.tools(\.\w+)*", n.value)]
        offenders += [f"{name} -> {t}" for t in hits]
    assert not offenders, "the library imports the tools layer:\n" + "\n".join(offenders)


def test_the_import_graph_of_the_package_has_no_cycle():
    mods = _modules()
    graph = _graph(mods)
    # the graph sees what it should: relative, function-local and package imports
    assert "ainfer_pd.tools.options" in graph["ainfer_pd.tools.world"]             # from .options import
    assert "ainfer_pd.tools.world" in graph["ainfer_pd.tools.cli"]                 # inside a function
    assert "ainfer_pd" in graph["ainfer_pd.tools.soak"]                            # from .. import RolloutWorker
    assert "ainfer_pd.tools.report" in graph["ainfer_pd.tools.bench"]              # from . import report
    stale = []
    for cycle in KNOWN_ENGINE_CYCLES:
        assert all(ENGINE_OWNED.match(m) for m in cycle), f"{cycle}: only engine-owned cycles may be listed"
        hops = list(zip(cycle, cycle[1:] + cycle[:1]))
        if not all(b in graph.get(a, ()) for a, b in hops):
            stale.append(cycle)
        for a, b in hops:
            graph.get(a, set()).discard(b)
    if stale:
        warnings.warn(f"KNOWN_ENGINE_CYCLES entries no longer in the graph (remove them): {stale}")
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# ---------------------------------------------------------------------------- the wheel
CHECK = r"""
import json, sys
from importlib.metadata import entry_points
import ainfer_pd
from ainfer_pd.config import WorkerConfig
from ainfer_pd.config_files import UnknownConfigError, config_names, config_path, read_config_text
out = {"file": ainfer_pd.__file__, "prefix": sys.prefix, "configs": config_names(),
       "crossed_world_size": WorkerConfig.from_yaml(config_path("tiny-crossed-cpu")).parallel.world_size,
       "tiny_text": "model" in read_config_text("tiny-cpu")}
try:
    config_path("no-such-config")
except UnknownConfigError as exc:
    out["unknown"] = type(exc).__mro__[1].__name__
if sys.argv[1] == "verl":
    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "ainfer_pd"]
    out["entry_point_dirs"] = [str(ep.dist.locate_file("")) for ep in eps]
    eps[0].load()                                    # ainfer_pd.integrations.verl.register
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from ainfer_pd.integrations.verl.settings import build_worker_config, default_config_path
    out["replica"] = RolloutReplicaRegistry.get("ainfer_pd").__name__
    out["adapter"] = get_rollout_class("ainfer_pd", "async").__name__
    out["default_config"] = default_config_path()
    out["default_model"] = build_worker_config({}).model.num_layers
    out["two_rank_world_size"] = build_worker_config({"config": "tiny-2rank-cpu"}).parallel.world_size
print(json.dumps(out))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _build_wheel(tmp: Path) -> Path:
    """A wheel of the checkout, built from a copy of it (no build/ or egg-info in the checkout)."""
    src = tmp / "src"
    shutil.copytree(ROOT / PKG, src / PKG, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(src)], env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = (tmp / "dist").glob("ainfer_pd-*.whl")
    return wheel


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv (``--system-site-packages``) with the wheel installed; this environment's
    site-packages are on its path after its own (torch, verl ...: a .pth file, so that none of
    their .pth files, e.g. the checkout's editable install, runs there)."""
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (purelib / "_outer_env.pth").write_text("".join(f"{p}\n" for p in ours if Path(p).is_dir()))
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return venv


@pytest.mark.slow
@pytest.mark.skipif(not _can_build_wheels(), reason="needs setuptools >= 70.1 (or wheel) to build without isolation")
def test_a_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    """The wheel carries the harness and the configs: from a directory outside the checkout, with
    PYTHONPATH unset, ``ainfer-pd replay`` runs on the packaged tiny config, the packaged configs
    load by name, and verl finds the rollout through the wheel's entry point."""
    t0 = time.perf_counter()
    venv = _fresh_venv(tmp_path, _build_wheel(tmp_path))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    replay = subprocess.Popen([str(venv / "bin" / "ainfer-pd"), "replay", "--conversations", "2", "--max-turns", "1",
                               "--token-scale", "0.02", "--policy", "normal", "--priorities", "fifo", "--no-progress"],
                              cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    check = _run([str(venv / "bin" / "python"), "-c", CHECK, "verl" if HAVE_VERL else "-"], cwd=work, env=env)
    out, err = replay.communicate(timeout=240)
    assert replay.returncode == 0, f"ainfer-pd replay -> {replay.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert "makespan" in out and "configs/tiny-cpu.yaml" in err, (out, err)
    got = json.loads(check.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).resolve().is_relative_to(venv.resolve()), got["file"]
    assert not Path(got["file"]).resolve().is_relative_to(ROOT.resolve())
    assert {"tiny-cpu", "tiny-crossed-cpu", "tiny-2rank-cpu", "h200-bench"} <= set(got["configs"])
    assert got["crossed_world_size"] == 4 and got["tiny_text"] and got["unknown"] == "ConfigError"
    if HAVE_VERL:
        assert any(Path(d).resolve().is_relative_to(venv.resolve()) for d in got["entry_point_dirs"]), got
        assert (got["replica"], got["adapter"]) == ("AInferPDReplica", "AInferPDServerAdapter")
        assert Path(got["default_config"]).resolve().is_relative_to(venv.resolve()), got["default_config"]
        assert got["default_model"] > 0 and got["two_rank_world_size"] == 2
    print(f"wheel build + install + replay + checks: {time.perf_counter() - t0:.1f} s")
