"""`torchrun --nproc-per-node 2 -m ainfer_pd.tools.cli replay`: one worker per rank process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_replay_under_torchrun_with_two_ranks():
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "ainfer_pd.tools.cli", "replay",
           "--conversations", "4", "--max-turns", "2", "--token-scale", "0.1", "--policies", "normal,fine-grained",
           "--no-progress"]           # token scale 0.1 (the tiny preset: 0.25): the launch, not the workload, is under test
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "world size 2 (torchrun)" in p.stdout
    assert "fine-grained" in p.stdout
