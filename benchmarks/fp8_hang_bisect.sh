#!/usr/bin/env bash
# The open FP8 fine-grained device hang (docs/RESULTS.md, Reliability): the gate's FP8 P1 bench,
# fine-grained, plain D loop, repeated per variant, each run bounded; a run that makes no progress
# for AINFER_PD_STALL_DUMP_S seconds writes every thread's and task's stack and each device
# stream's oldest unfinished items (ainfer_pd/tools/stall_dump.py) into its log, then is ended.
#
#   OUT=/path RUNS=3 bash benchmarks/fp8_hang_bisect.sh [variant ...]
#
# Variants (each a config override beside the bench's own): base, no-green (P beside D on the
# whole device, device.p_stream_sms=0), no-pgraphs (device.prefill_graphs=false), bf16 (no
# quantization: the control). Prints, per variant, how many runs hung and the makespans of the
# others; the logs stay in $OUT/<variant>_<i>.log. A run takes ~30 s (H200), so a 10-minute device
# call holds about two variants at RUNS=3 when some hang: name them. CONFIG overrides the model
# config (a CPU smoke run: CONFIG=ainfer_pd/configs/tiny-cpu.yaml ... bf16). A run still going at
# PROBE_AT s is probed (GPU utilisation, and the resident kernels through cuda-gdb) into
# $OUT/<variant>_<i>_probe.txt; STOP_AFTER_HANG=1 ends a variant at its first hang. EXTRA_SETS: more
# overrides for every run (a tree with the device watchdog fails a hung run after
# parallel.stall_timeout_s: "--set parallel.stall_timeout_s=1000" keeps it hung for the probe).
set -u
OUT=${OUT:-/tmp/fp8_hang}; RUNS=${RUNS:-3}; LIMIT=${LIMIT:-90}
CONFIG=${CONFIG:-configs/qwen3-30b-a3b-shape.yaml}
PROBE_AT=${PROBE_AT:-$((LIMIT / 2 + 5))}; STOP_AFTER_HANG=${STOP_AFTER_HANG:-0}
mkdir -p "$OUT"

# A run still going at PROBE_AT s (one that completes takes ~30 s) is probed from outside: the
# GPU's utilisation and power (a spinning kernel keeps it busy, a wait on a dependency does not)
# and, through cuda-gdb attached to the process, the kernels resident on the device at that moment.
probe() {
  local tpid=$1 out=$2 t=0 pid
  while kill -0 "$tpid" 2>/dev/null && [ $t -lt "$PROBE_AT" ]; do sleep 1; t=$((t + 1)); done
  kill -0 "$tpid" 2>/dev/null || return 0
  pid=$(pgrep -f -n "ainfer_pd.tools.cli bench") || return 0
  { echo "still running at ${PROBE_AT} s: pid $pid"
    for _ in 1 2 3; do nvidia-smi --query-gpu=utilization.gpu,power.draw,memory.used --format=csv,noheader; sleep 1; done
    timeout 60 cuda-gdb -p "$pid" --batch -ex "info cuda kernels" -ex "info cuda blocks" -ex "info cuda contexts" \
      -ex "detach" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | head -120
  } > "$out" 2>&1
}
declare -A SETS=(
  [base]="--set model.quantization=fp8"
  [no-green]="--set model.quantization=fp8 --set device.p_stream_sms=0"
  [no-pgraphs]="--set model.quantization=fp8 --set device.prefill_graphs=false"
  [bf16]=""
)
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(base no-green no-pgraphs bf16)
for v in "${variants[@]}"; do
  [ -n "${SETS[$v]+x}" ] || { echo "unknown variant $v (base no-green no-pgraphs bf16)"; exit 2; }
  hung=0; spans=""
  for i in $(seq 1 "$RUNS"); do
    log="$OUT/${v}_$i.log"
    # shellcheck disable=SC2086
    AINFER_PD_STALL_DUMP_S=$((LIMIT - 20)) PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "$LIMIT" \
      python -m ainfer_pd.tools.cli bench --config "$CONFIG" --policies fine-grained \
      --cells P1 --repeats 1 --conversations 24 --max-turns 3 --token-scale 0.5 --no-progress \
      --out "/tmp/fp8_hang_bench_${v}_$i" --set "device.graph_batch_sizes=[1,4,16,32,64]" \
      --set scheduler.overlap_decode=false ${SETS[$v]} ${EXTRA_SETS:-} > "$log" 2>&1 &
    tpid=$!
    probe "$tpid" "$OUT/${v}_${i}_probe.txt"
    wait "$tpid"; rc=$?
    if [ $rc -eq 0 ]; then
      spans="$spans $(grep -o 'makespan [0-9.]* s' "$log" | head -1 | awk '{print $2}')"
    else
      hung=$((hung + 1))
      [ "$STOP_AFTER_HANG" = 1 ] && break
    fi
  done
  echo "variant $v: $hung of $RUNS runs did not finish in ${LIMIT} s; makespans of the others (s):${spans:- none}"
done
