#!/usr/bin/env bash
H=b2691de2a6a95c4d5c2c282a82a9002b9cad0e66
timeout 150 bash -c "REPEATS=1 POLICIES=fine-grained SPANS=4,auto SUFFIX=sp2 WORK=/tmp/lw8 OUT=/tmp/l bash benchmarks/h200_ladder.sh $H spans" > /tmp/l.out 2>&1; echo "spans rc $?" >> /tmp/l.out
timeout 170 python -m trainer_examples.live_rl.run --config configs/live-rl-h200.yaml --steps 32 --policy both --prompts 8 --group 8 --action-tokens 16 --prompt-filler 32 256 --obs-filler 16 64 --tool-latency-ms 5 30 --lr 1e-3 --set mux.activation_cost=measured --out /tmp/lrl/s8 --quiet > /tmp/lrl.out 2>&1; echo "lrl rc $?" >> /tmp/lrl.out
mkdir -p /tmp/l; for d in /tmp/lw*; do cp $d/runs.jsonl /tmp/l/runs_$(basename $d).jsonl 2>/dev/null; done
tar czf $OUT/all.tgz -C /tmp l l.out lrl lrl.out
grep -E "^\[|rc " /tmp/l.out | tail -6; tail -8 /tmp/lrl.out
