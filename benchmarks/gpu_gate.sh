#!/usr/bin/env bash
# The GPU gate: every change to GPU-path code (attention, MoE, runner, CUDA graphs, device, engine
# loops) is followed by this run on the H200, and its latest.json is committed with it
# (docs/results/gpu_gate/latest.json). At most 8 minutes; one PASS / FAIL line per check.
#
#   bash benchmarks/gpu_gate.sh COMMIT            # on the GPU host (the device tool sends no .git:
#                                                 # pass the commit hash the tree is at)
# Writes $OUT/latest.json and the logs there (default docs/results/gpu_gate).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# past GATE_TIMEOUT: SIGABRT, so every thread's stack is printed (PYTHONFAULTHANDLER), then SIGKILL
export PYTHONFAULTHANDLER=1
ulimit -c 0
COMMIT=${1:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
O=${OUT:-docs/results/gpu_gate}; mkdir -p "$O"
shift || true
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
timeout -s ABRT -k 20 ${GATE_TIMEOUT:-480} python benchmarks/gpu_gate.py --commit "$COMMIT" --out "$O" "$@" 2>&1 | tee "$O/gate.log"
exit "${PIPESTATUS[0]}"
