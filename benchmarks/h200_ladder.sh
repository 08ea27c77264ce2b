#!/usr/bin/env bash
# The policy ladder of record on one H200 (issue 16), in parts of under 10 minutes each:
#
#   bash benchmarks/h200_ladder.sh COMMIT PART     # PART: p1 | trace | p1-short | trace-short | spans | decode-only | lever
#                                                  #       | grpo-long-p1 | grpo-long-trace
#   (p1-short / trace-short: SHORT_POLICIES run with fifo, CP_POLICIES with critical-path;
#    lever: LEVER_POLICIES (default fine-grained+critical-path) with LEVER="KEY=VALUE[ KEY=VALUE...]" on
#    top (or joined by +, as ladder_call.sh's specs need: LEVER=model.quantization=fp8+cache.kv_dtype=fp8_e4m3),
#    rows labelled by it (spaces as +), on CELL (default P1))
#
# Each part writes $OUT/ladder_PART.json (default docs/results/ladder), with runs_PART.jsonl (per-request
# records) and PART_*.png (bench's plots: the first repeat's timeline per variant) beside it; then, here:
#   python benchmarks/ladder.py merge docs/results/ladder/ladder_*.json --out docs/results/ladder/latest.json
# (add --data-path KEY=VALUE[+...] to judge the targets a second time on a lever part's data path, or
#  --data-path default for the plain rows with fine-grained's lever rows on top; --defaults KEY=VALUE[+...]
#  drops settings that are the commit's defaults from the rows' variants; rows of one key and commit
#  from two parts are pooled)
# Workload (the issue's minimum): 64 conversations x 4 turns at token scale 1 on the Qwen3-30B-A3B
# shape, bf16, CUDA graphs, the measured span. Environment overrides: REPEATS, POLICIES,
# PRIORITIES, SPANS, CONV, TURNS, TOKEN_SCALE, CONFIG, TRACE_DIR, WORK (where bench writes runs.jsonl; default
# /tmp/ladder), SUFFIX (appended to the part's name, so two parts of one call do not overwrite),
# NO_WARMUP=1 (skip the warm-up process: an earlier part of the same call filled Triton's cache).
# grpo-long-p1 / grpo-long-trace (issue 33 item 4): the long-context agentic workload, rows grpo-long/P1 and
# grpo-long/trace: GRPO groups of GROUP (8) siblings sharing a prompt, CONV (64) trajectories of at most
# TURNS (6) turns, retained contexts on the paper's distribution (p50/p90/p99 4,716/8,828/12,507, up to
# 14.8K): graphs over the 16K context (device.graph_max_context=16384) and the config's KV pool, or GMEM of the
# memory free after the weights (every trajectory's context at once is ~330K tokens, 32 GB: 0.5 on the H200). POLICIES x
# PRIORITIES as for p1 / trace (default: all five x fifo,critical-path; plan owes the five with fifo and
# normal,fine-grained with critical-path).
# What latest.json still lacks, packed into device calls: python benchmarks/ladder.py plan [--commit HASH]
# (each call also as one benchmarks/ladder_call.sh line: its parts in order within the call's budget)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
COMMIT=${1:?commit}; PART=${2:?part}
O=${OUT:-docs/results/ladder}; mkdir -p "$O"
CONFIG=${CONFIG:-configs/qwen3-30b-a3b-shape.yaml}
ALL=normal,global-complete,global-enqueue,fine-grained,mixed-chunked
case "$PART" in grpo-long-*) dturns=6; gmax=16384 ;; *) dturns=4; gmax=8192 ;; esac
common=(--commit "$COMMIT" --part "$PART${SUFFIX:+-$SUFFIX}" --out "$O" --config "$CONFIG"
        --conversations "${CONV:-64}" --max-turns "${TURNS:-$dturns}" --token-scale "${TOKEN_SCALE:-1}"
        --repeats "${REPEATS:-3}" --work "${WORK:-/tmp/ladder}" --set mux.span=measured --set device.graph_max_context=$gmax
        ${TRACE_DIR:+--set trace_dir=$TRACE_DIR} ${NO_WARMUP:+--no-warmup})
# SETS=KEY=VALUE[+KEY=VALUE...]: config settings every run of the part takes, its rows labelled with them
# (a variant, as a lever's; a grpo-long part has no lever)
# BUDGET=R (EOS_EVERY=L): each turn asks for R tokens and ends at the model's EOS, a random EOS set of
# vocab/L ids (a trainer's response budget; bench's --response-budget / --eos-every), rows labelled with it
variant=${SETS:-}
if [ -n "${SETS:-}" ]; then for kv in ${SETS//+/ }; do common+=(--set "$kv"); done; fi
if [ -n "${BUDGET:-}" ]; then
  common+=(--response-budget "$BUDGET" ${EOS_EVERY:+--eos-every $EOS_EVERY})
  variant=${variant:+$variant+}response_budget=$BUDGET${EOS_EVERY:++eos_every=$EOS_EVERY}
fi
if [ -n "$variant" ]; then common+=(--variant "$variant"); fi
# TRACE_DIR: every run writes its control trace and timeline there (the last run's stays; for
# `python -m ainfer_pd.tools timeline TRACE_DIR --split --items` on the device, which has no `ainfer-pd` script:
# run one policy, REPEATS=1)
# graph_max_context 8192: the trace's contexts reach 7.5K; above the largest graph bucket decode runs
# eagerly (host-bound: 51 ms an iteration at B~17 against ~15 ms replayed, H200 pilot)
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
case "$PART" in
  p1|trace) cell=$([ "$PART" = p1 ] && echo P1 || echo trace)
            python benchmarks/ladder.py run "${common[@]}" --cells $cell --policies "${POLICIES:-$ALL}" \
              --priorities "${PRIORITIES:-fifo,critical-path}" ;;
  p1-short|trace-short)   # the four-policy fifo ladder plus critical-path for normal and fine-grained
            cell=$([ "$PART" = p1-short ] && echo P1 || echo trace)
            python benchmarks/ladder.py run "${common[@]}" --part "$PART-fifo" --cells $cell \
              --policies ${SHORT_POLICIES:-normal,global-enqueue,fine-grained,mixed-chunked} --priorities fifo
            python benchmarks/ladder.py run "${common[@]}" --part "$PART-cp" --cells $cell --no-warmup \
              --policies ${CP_POLICIES:-normal,fine-grained} --priorities critical-path ;;
  spans)    # fine-grained at each span (its mux.span=measured point is the ladder's plain fine-grained row)
            python benchmarks/ladder.py run "${common[@]}" --cells P1 --policies "${POLICIES:-}" \
              --priorities "${PRIORITIES:-critical-path}" --spans "${SPANS:-1,2,3,4,auto}" ;;
  decode-only) python benchmarks/ladder.py run "${common[@]}" --cells P1 --policies normal,fine-grained \
              --priorities fifo --decode-only ;;
  lever)    : "${LEVER:?LEVER=KEY=VALUE[ KEY=VALUE...]}"; sets=(); for kv in ${LEVER//+/ }; do sets+=(--set "$kv"); done
            python benchmarks/ladder.py run "${common[@]}" --cells "${CELL:-P1}" --policies "${LEVER_POLICIES:-fine-grained}" \
              --priorities "${PRIORITIES:-critical-path}" "${sets[@]}" --variant "${LEVER// /+}" \
              --part "lever-${LEVER//[^A-Za-z0-9]/_}${SUFFIX:+-$SUFFIX}" ;;
  grpo-long-p1|grpo-long-trace)
            cell=$([ "$PART" = grpo-long-p1 ] && echo P1 || echo trace)
            python benchmarks/ladder.py run "${common[@]}" --cells $cell --workload grpo-long --group-size "${GROUP:-8}" \
              ${GMEM:+--set cache.gpu_memory_fraction=$GMEM} --policies "${POLICIES:-$ALL}" \
              --priorities "${PRIORITIES:-fifo,critical-path}" ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
