#!/usr/bin/env bash
# The H200 figures still owed (docs/RESULTS.md), in one device call of < 10 minutes, after the
# gate: speculation's makespan with each run's breakdown (issue 38, "never slower than off": on an
# H100 at 9edec3f fine-grained P1 was still 1.30x slower with no draft made, normal even), the
# decode attention tile sweep (issue 33), and the P epoch's pickup / span / tail / launch split and
# the pass's own device gaps, alone and beside 32 decoding rows (issue 33's 512-token 1.50: the
# launch calls took 4.9 of its 30.1 ms span on the H100, so the device idle is elsewhere). Each step
# is bounded; logs go to $OUT (tar them: a call returns at most 8 files).
#
#   OUT=$OUT/m bash benchmarks/pending_h200.sh && (cd $OUT && tar czf m.tgz m && rm -rf m)
set -u
M=${OUT:-/tmp/pending}; mkdir -p "$M"
nvidia-smi --query-gpu=name --format=csv,noheader > "$M/gpu.txt" 2>&1
( time timeout 230 python benchmarks/spec_bench.py makespan --reps 3 ) > "$M/spec_makespan.txt" 2>&1
# decode attention's tiles around split_keys 256 (issue 33's B 32 x 2K 1.72x: ~19 us fixed + 1.1x its bytes);
# with gate_queue/moe-direct, the fused MoE's direct plan against the aligned one at 1-8 tokens
( time timeout 130 python benchmarks/kernel_sweep.py --sections moedirect,decode --budget-s 110 --out "$M/sweep_decode.json" ) \
    > "$M/sweep_decode.txt" 2>&1
( time timeout 200 python benchmarks/p_epoch_host_bench.py --cases 512:2048,2048:4096 --beside-d 32 \
    --set scheduler.policy=fine-grained ) > "$M/p_epoch.txt" 2>&1
grep -h "makespan\|ms\b" "$M"/*.txt | tail -20
