#!/usr/bin/env bash
# The device figures still owed (docs/RESULTS.md), in one device call of < 10 minutes, after the
# gate: the P epoch's pickup / span / tail / launch split and the pass's own device gaps, alone and
# beside 16 decoding rows (issue 33's 512-token 1.50: the launch calls took 4.9 of its 30.1 ms span
# on the H100, so the device idle is elsewhere; 16 rows of 1,024 fit an H100's pool beside the
# bf16 weights, 32 of 2,048 did not; "the epoch in the engine": one continuation profiled as the engine
# runs it, each long device gap with the host's runtime calls during it: at 1dcd601 ~6.5 ms of the
# 512-token epoch lay between its items), then speculation's makespan at 5 repetitions (issue 38: at
# n = 3 on the H100 normal's spread, 0.86-1.19 s, was wider than its gap; off and on interleaved
# now), then the sampler's host time with a repetition penalty (its `pool` row: gate_queue/seen-masks,
# 11.3 ms a step before at 10K-token histories). Each step is bounded; logs go to $OUT (tar them: a
# call returns at most 8 files).
#
#   OUT=$OUT/m bash benchmarks/pending_h200.sh && (cd $OUT && tar czf m.tgz m && rm -rf m)
set -u
M=${OUT:-/tmp/pending}; mkdir -p "$M"
nvidia-smi --query-gpu=name --format=csv,noheader > "$M/gpu.txt" 2>&1
( time timeout 200 python benchmarks/p_epoch_host_bench.py --cases 512:2048,2048:4096 --beside-d 16 --d-prompt 1024 \
    --set scheduler.policy=fine-grained ) > "$M/p_epoch.txt" 2>&1
( time timeout 340 python benchmarks/spec_bench.py makespan --reps 5 ) > "$M/spec_makespan.txt" 2>&1
( timeout 60 python benchmarks/sampler_host_bench.py --history 10000 --reps 9 ) > "$M/sampler_host.txt" 2>&1
grep -h "makespan\|ms\b" "$M"/*.txt | tail -20
