#!/usr/bin/env bash
# One device call of the ladder of record: its parts in order while the call's budget lasts.
#
#   OUT=$OUT bash benchmarks/ladder_call.sh COMMIT BUDGET_S "EST_S|ENV=V ENV=V ...|PART" ...
#
# Each spec runs `ENV... bash benchmarks/h200_ladder.sh COMMIT PART` (its env must set a unique
# SUFFIX: it names the part's files) when its estimate fits the budget left, else it is skipped and
# said so. EST_S includes the warm-up process; every part after the first is run with NO_WARMUP=1 and
# its estimate less WARMUP_S (default 45, ladder.py's WARMUP_S). A part still running when the budget ends is cut
# (`timeout`): its runs so far are kept as $OUT/r/cut_SUFFIX_runs*.jsonl.gz, for
# `python benchmarks/ladder.py from-log`. Everything ends in $OUT/r.tgz (one file to bring back), packed again
# after every part from a work folder outside $OUT: a call the device cuts at its limit still brings back the
# parts done before the cut (the device returns what is under $OUT then, at most 8 files).
# The estimates: `python benchmarks/ladder.py plan` (its est_s per part).
# The device call's own limit (the run tool's timeout_s) needs ~40 s more than BUDGET_S: after a cut part come
# its cut runs, its timeline and the pack (a call given 155 s for a 150 s budget lost its timeline and r.tgz).
#
# PART `gate` runs the GPU gate instead (`bash benchmarks/gpu_gate.sh COMMIT`, its files in
# $OUT/r/SUFFIX/): a gate first, then the ladder parts of the same commit, in one device call. A
# failed gate ends the call (a ladder of a commit that failed its gate is not measured).
# A ladder part whose env sets TRACE_DIR=DIR also gets `python -m ainfer_pd.tools timeline DIR --split --items`
# (its last run: P alone by its epochs' cause, each stream's items by kind) into $OUT/r/SUFFIX_timeline.txt.
# PART `sweep` runs `python benchmarks/kernel_sweep.py --sections $SECTIONS` for its estimate less 20 s
# ($OUT/r/SUFFIX.out and .json): e.g. the gate then the kernel candidates, in one call.
# PART `script` runs `python $SCRIPT $ARGS` (ARGS with + for spaces: ARGS=--budget-s+50) into $OUT/r/SUFFIX.out,
# cut at the call's budget: a benchmark script beside the gate (fp8_dense_sweep.py, fp8_kernel_check.py --tiles).
set -u
# A part cut by the budget (or hung) is stopped with SIGABRT: PYTHONFAULTHANDLER=1 makes every Python
# process of it print each thread's stack into its .out first (a hang is told from a slow run), then
# SIGKILL 20 s later. No core files.
export PYTHONFAULTHANDLER=1
ulimit -c 0
COMMIT=${1:?commit}; BUDGET=${2:?budget seconds}; shift 2
LADDER_SH=${LADDER_SH:-benchmarks/h200_ladder.sh}
GATE_SH=${GATE_SH:-benchmarks/gpu_gate.sh}
T0=$(date +%s)
: "${OUT:?OUT}"
W=$(mktemp -d /tmp/ladder_call_out.XXXXXX); R=$W/r; mkdir -p "$R"
pack() { tar czf "$OUT/r.tgz.part" -C "$W" r && mv -f "$OUT/r.tgz.part" "$OUT/r.tgz"; }
first=1
for spec in "$@"; do
  est=${spec%%|*}; rest=${spec#*|}; envs=${rest%|*}; part=${rest##*|}
  case "$envs" in *SUFFIX=*) ;; *) echo "spec without SUFFIX: $spec" >&2; exit 2 ;; esac
  name=$(echo "$envs" | sed 's/.*SUFFIX=//; s/ .*//; s/[^A-Za-z0-9_-]/_/g')
  now=$(( $(date +%s) - T0 )); left=$(( BUDGET - now ))
  case "$part" in gate|sweep|script) ;; *) [ $first = 1 ] || est=$(( est - ${WARMUP_S:-45} )) ;; esac
  if [ "$est" -gt "$left" ]; then echo "SKIP (est $est > $left s left): $envs $part"; continue; fi
  echo "== $(date +%T) [$now s] $envs $part (est $est, $left left)"
  if [ "$part" = gate ]; then
    env $envs OUT="$R/$name" timeout -s ABRT -k 20 "$left" bash "$GATE_SH" "$COMMIT" > "$R/$name.out" 2>&1
    rc=$?; echo "gate rc $rc at $(( $(date +%s) - T0 )) s"
    if [ $rc != 0 ]; then echo "GATE FAILED: the parts after it are not run"; break; fi
    pack; continue
  fi
  if [ "$part" = sweep ]; then
    env $envs timeout -s ABRT -k 20 "$left" bash -c '"${PYTHON:-python}" "${SWEEP_PY:-benchmarks/kernel_sweep.py}" \
      --sections "${SECTIONS:?SECTIONS}" --budget-s "$1" --out "$2"' _ $(( est > 40 ? est - 20 : 20 )) "$R/$name.json" \
      > "$R/$name.out" 2>&1
    echo "sweep rc $? at $(( $(date +%s) - T0 )) s"
    pack; continue
  fi
  if [ "$part" = script ]; then
    env $envs timeout -s ABRT -k 20 "$left" bash -c '"${PYTHON:-python}" "${SCRIPT:?SCRIPT}" ${ARGS//+/ }' \
      > "$R/$name.out" 2>&1
    echo "script rc $? at $(( $(date +%s) - T0 )) s"
    pack; continue
  fi
  nw=""; [ $first = 1 ] || nw="NO_WARMUP=1"
  # 30 s before the cut, the bench process also writes its asyncio tasks' stacks (ainfer_pd/tools/stall_dump.py)
  dump_s=$(( left - 30 )); [ -n "$nw" ] || dump_s=$(( dump_s - ${WARMUP_S:-45} ))   # after the warm-up process
  [ "$dump_s" -ge 30 ] || dump_s=30
  env $envs $nw OUT="$R" WORK="/tmp/ladder_call/$name" AINFER_PD_STALL_DUMP_S=$dump_s \
    timeout -s ABRT -k 20 "$left" bash "$LADDER_SH" "$COMMIT" "$part" > "$R/$name.out" 2>&1
  rc=$?; echo "rc $rc at $(( $(date +%s) - T0 )) s"
  if [ $rc != 0 ]; then
    find "/tmp/ladder_call/$name" -name 'runs*.jsonl' 2>/dev/null | while read -r f; do
      gzip -c "$f" > "$R/cut_${name}_$(basename "$f").gz"; done
  fi
  # a part run with TRACE_DIR: its last run's timeline split (P alone by cause, each stream's items by kind), read
  # with the module (the device has no ainfer-pd script), into $R/SUFFIX_timeline.txt
  td=$(printf '%s\n' $envs | sed -n 's/^TRACE_DIR=//p' | tail -1)
  if [ -n "$td" ] && [ -d "$td" ]; then
    "${PYTHON:-python}" -m ainfer_pd.tools timeline "$td" --split --items > "$R/${name}_timeline.txt" 2>&1
    echo "timeline rc $? -> ${name}_timeline.txt"
  fi
  first=0
  pack
done
pack && rm -rf "$W"
