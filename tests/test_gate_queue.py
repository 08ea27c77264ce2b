"""The changes waiting for the GPU gate (``gate_queue/``) still apply to this tree: each series in
``ORDER`` exists, and ``git am -3`` of all of them, in order, on a scratch worktree of HEAD
succeeds (a change on main that breaks the queue shows here, not in the next GPU session). A
series HEAD already holds (the gate's branch, the queue applied: every patch's subject among
HEAD's commits) is not applied again."""
from __future__ import annotations

import email
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUEUE = ROOT / "gate_queue"


def _git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=gate-queue-check", "-c", "user.email=check@localhost", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def _series() -> list[str]:
    return [ln.strip() for ln in (QUEUE / "ORDER").read_text().splitlines() if ln.strip()]


def _subject(patch: Path) -> str:
    """A patch's commit subject (its folded ``Subject:`` header, ``[PATCH n/m]`` dropped)."""
    raw = email.message_from_string(patch.read_text())["Subject"] or ""
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(raw.split()))


@pytest.mark.skipif(not (QUEUE / "ORDER").exists(), reason="no changes wait for the gate")
def test_every_series_in_order_exists_and_holds_patches():
    names = _series()
    assert len(names) == len(set(names)), names
    on_disk = {p.name for p in QUEUE.iterdir() if p.is_dir()}
    assert set(names) == on_disk, (names, sorted(on_disk))
    for name in names:
        patches = sorted((QUEUE / name).glob("*.patch"))
        assert patches, name
        assert all(p.read_text().startswith("From ") for p in patches), name


@pytest.mark.skipif(not (QUEUE / "ORDER").exists(), reason="no changes wait for the gate")
def test_the_queue_applies_to_head_in_order(tmp_path):
    if shutil.which("git") is None or _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    held = set(_git("log", "--format=%s", "-n", "500").stdout.splitlines())
    todo = [n for n in _series() if not all(_subject(p) in held for p in (QUEUE / n).glob("*.patch"))]
    if not todo:
        pytest.skip("HEAD holds every series already")
    wt = tmp_path / "wt"
    assert _git("worktree", "add", "--detach", str(wt), "HEAD").returncode == 0
    try:
        for name in todo:
            patches = [str(p) for p in sorted((QUEUE / name).glob("*.patch"))]
            r = _git("am", "-3", *patches, cwd=wt)
            assert r.returncode == 0, f"gate_queue/{name} no longer applies: {r.stdout[-800:]}{r.stderr[-800:]}"
    finally:
        _git("worktree", "remove", "--force", str(wt))
