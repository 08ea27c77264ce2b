#!/usr/bin/env bash
# The H200 measurements issue 3 still needs, in three device calls of < 10 min each
# (docs/history.md; the run log: git show ef9a7d7:docs/BENCHMARKS.md):
#   bash benchmarks/h200_issue3.sh ladder P1     # cuda_smoke (checks the eager-decode kernel), 5 policies x 3 repeats (~5 min)
#   bash benchmarks/h200_issue3.sh ladder trace  # the same on the trace-wait cell (~5 min)
#   bash benchmarks/h200_issue3.sh spans         # span sweep 1-4 + auto x 3, P-stream priority x 3, decode-only x 3,
#                                                # lockstep ws1 re-run (~8.5 min)
# Run the calls back to back (the machine stays warm 30 s between calls).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/out}; mkdir -p "$O"
W="--config configs/h200-bench.yaml --conversations 48 --max-turns 3 --token-scale 0.5 --no-progress"
case "${1:-}" in
  ladder)
    C=${2:-P1}
    [ "$C" = P1 ] && timeout 90 python benchmarks/cuda_smoke.py > "$O/cuda_smoke.log" 2>&1
    timeout 480 python -m ainfer_pd.tools.cli bench $W --policies normal,global-complete,global-enqueue,fine-grained,mixed-chunked \
        --cells "$C" --repeats 3 --out /tmp/ladder > "$O/ladder_$C.log" 2>&1
    for f in results.json ${C}_makespan.png ${C}_d_wait_cdf.png ${C}_ttft_cdf.png ${C}_timeline_fine-grained_zoom.png \
             ${C}_timeline_normal_zoom.png; do cp "/tmp/ladder/$f" "$O/${C}_$f" 2>/dev/null; done ;;
  spans)
    timeout 300 python -m ainfer_pd.tools.cli bench $W --policies normal,fine-grained --spans 1,2,3,4,auto --cells P1 \
        --repeats 3 > "$O/spans.log" 2>&1
    timeout 100 python -m ainfer_pd.tools.cli bench $W --policies normal,fine-grained --cells P1 --repeats 3 \
        --set device.high_priority_stream=P > "$O/p_priority.log" 2>&1     # the TTFT lever (equal priority elsewhere)
    timeout 120 python -m ainfer_pd.tools.cli bench --config configs/h200-bench.yaml --decode-only --policies normal,fine-grained \
        --cells P1 --repeats 3 --conversations 48 --no-progress > "$O/decode_only.log" 2>&1
    timeout 60 torchrun --standalone --nproc-per-node 1 -m ainfer_pd.tools.cli replay --config configs/tiny-cuda.yaml \
        --conversations 8 --max-turns 2 --policies normal,fine-grained --no-progress > "$O/lockstep_ws1.log" 2>&1
    echo "lockstep ws1 rc $?" >> "$O/lockstep_ws1.log" ;;
  *) echo "usage: $0 ladder|spans" >&2; exit 2 ;;
esac
