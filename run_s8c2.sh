#!/usr/bin/env bash
# session 8 call 2 (untracked, deleted after)
H=b2691de2a6a95c4d5c2c282a82a9002b9cad0e66
W="scheduler.short_prefill_tokens=256 mux.exclusive_backlog_tokens=16384 mux.exclusive_wait_s=1.0"
timeout 540 bash -c "
REPEATS=1 SUFFIX=do WORK=/tmp/lw4 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H decode-only
REPEATS=2 CELL=trace LEVER_POLICIES=normal PRIORITIES=fifo LEVER=scheduler.overlap_decode=auto SUFFIX=nf2 WORK=/tmp/lw5 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H lever
REPEATS=1 CELL=trace LEVER='$W' SUFFIX=w1b WORK=/tmp/lw6 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H lever
REPEATS=1 POLICIES=fine-grained SPANS=3,4,auto SUFFIX=sp WORK=/tmp/lw7 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H spans
" > /tmp/l.out 2>&1; echo "ladder rc $?" >> /tmp/l.out
mkdir -p /tmp/l; for d in /tmp/lw*; do cp $d/runs.jsonl /tmp/l/runs_$(basename $d).jsonl 2>/dev/null; done
tar czf $OUT/all.tgz -C /tmp l l.out
grep -E "^\[|rc " /tmp/l.out | grep -v "warm" | tail -14
