"""Run a Triton compile for sm_90 in a child process without ``TRITON_INTERPRET`` (the suite sets it;
Triton's NVIDIA back end and ptxas run on this CPU machine) and read the JSON its last line prints.
A child that could not run ptxas prints ``{"skip": why}``: the test is skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def compile_in_child(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"Triton cannot compile for sm_90 here: {out['skip']}")
    return out
