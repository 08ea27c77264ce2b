#!/usr/bin/env bash
H=b2691de2a6a95c4d5c2c282a82a9002b9cad0e66
timeout 165 bash -c "REPEATS=1 POLICIES=fine-grained SPANS=auto SUFFIX=sp3 WORK=/tmp/lw9 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H spans" > /tmp/l.out 2>&1; echo "spans rc $?" >> /tmp/l.out
mkdir -p /tmp/l; for d in /tmp/lw9; do cp $d/runs.jsonl /tmp/l/runs_$(basename $d).jsonl 2>/dev/null; done
tar czf $OUT/all.tgz -C /tmp l l.out
grep -E "^\[|rc " /tmp/l.out | tail -4
