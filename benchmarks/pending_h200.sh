#!/usr/bin/env bash
# The device figures still owed (docs/RESULTS.md, "Not measured yet"), in one device call of < 10
# minutes: the verify-cost curves with the experts and the turn groups against each row alone (after
# gate_queue/measure-slots; on an 80 GB card drop B 128 at 2K and B 32 at 8K); speculation's makespan
# on / off at 4 interleaved pairs on both shapes with spec-rest (issue 38's "never slower": on 66cc5f3's H100 the 24 pairs of both shapes pooled 1.031, 95% CI 1.006-1.055);
# the P epoch alone and beside decoding rows (issue 33: r_items 1.056 / 1.012 on the
# H100 with 16 rows; the H200 fits 32 rows of 2,048 beside the bf16 weights); the FP8 decode
# iteration's kernels at B 64 (issue 37: H200 1.39x its bound before the relaxed router atomics, the
# H100 1.23x since); the FP8 / bf16 tokens/s at B 64 / 128 (fp8_speed_bench.py: two layer counts, the
# whole model projected; the only way on an 80 GB card) and the decode tiles with swap_fold. On an H100 use --beside-d 16 --d-prompt 1024. Each step is bounded; logs go to
# $OUT (tar them: a call returns at most 8 files). The FP8 ladder is a call of its own
# (docs/BENCHMARKS.md).
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
( time timeout 120 python benchmarks/fp8_kernel_check.py --tiles --budget-s 80 ) > "$M/fp8_tiles.txt" 2>&1
grep -h "spec_makespan_ratio\|ratio\|replay" "$M"/*.txt | tail -20
