#!/usr/bin/env bash
# The device figures still owed on an H200 (docs/RESULTS.md, "Not measured yet"), in one device call of
# < 10 minutes: the verify-cost curves with the experts, B 128 at 2K and B 32 at 8K included (an H100 at
# 4fc67a2 measured the rest; those do not fit 80 GB beside the bf16 weights); speculation's makespan on / off
# at 4 interleaved pairs on both shapes (issue 38's "never slower": the H100's 24 pairs at 4fc67a2 pooled
# 1.037, 95% CI 0.996-1.080); the P epoch alone and beside decoding rows (issue 33: r_items 1.056 / 1.012 on
# the H100 with 16 rows; the H200 fits 32 rows of 2,048 beside the bf16 weights); the FP8 decode iteration's
# kernels at B 64 (issue 37: H200 1.39x its bound before the relaxed router atomics, the H100 1.255x at
# 4fc67a2); the FP8 / bf16 tokens/s at B 64 / 128 (fp8_speed_bench.py at two layer counts: the H100's
# figure is projected from them; on the H200 the 48-layer model fits too). The swap_fold tiles were
# measured at 4fc67a2 (slower: not taken). On an H100 use --beside-d 16 --d-prompt 1024 and drop the
# batches above. Each step is bounded; logs go to $OUT (tar them: a call returns at most 8 files). The
# FP8 ladder is a call of its own (docs/BENCHMARKS.md).
#
#   OUT=$OUT/m bash benchmarks/pending_h200.sh && (cd $OUT && tar czf m.tgz m && rm -rf m)
set -u
M=${OUT:-/tmp/pending}; mkdir -p "$M"
nvidia-smi --query-gpu=name --format=csv,noheader > "$M/gpu.txt" 2>&1
( time timeout 90 python benchmarks/spec_bench.py verify-costs --compare-alone --batches 1,16,32,64,128 ) \
    > "$M/verify_costs_2k.txt" 2>&1
( time timeout 90 python benchmarks/spec_bench.py verify-costs --compare-alone --batches 1,8,16,32 --context 8192 ) \
    > "$M/verify_costs_8k.txt" 2>&1
( time timeout 240 python benchmarks/spec_bench.py makespan --reps 4 ) > "$M/spec_makespan.txt" 2>&1
( time timeout 200 python benchmarks/p_epoch_host_bench.py --cases 512:2048,2048:4096 --beside-d 32 --d-prompt 2048 \
    --set scheduler.policy=fine-grained ) > "$M/p_epoch.txt" 2>&1
( timeout 90 python benchmarks/decode_profile.py --batches 64 --ctx 2048 --set model.quantization=fp8 ) \
    > "$M/fp8_decode_profile.txt" 2>&1
( time timeout 200 python benchmarks/fp8_speed_bench.py --layers 16,32 --batches 64,128 ) > "$M/fp8_speed.txt" 2>&1
grep -h "spec_makespan_ratio\|ratio\|replay" "$M"/*.txt | tail -20
