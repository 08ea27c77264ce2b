#!/usr/bin/env bash
# One device call on the lent single H200 (see docs/RESULTS.md): the world-size-1 NCCL
# paths (issue 4), the live-RL run (issue 6), and a P1 / decode-only / trace check of the
# engine after the prefill-attention fix (issue 3). Each step has its own time limit; logs go
# to $OUT (at most 8 files come back).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/out}; mkdir -p "$O"
X=$O/extra.log
nvidia-smi -L > "$X"
python - >> "$X" 2>&1 <<'PY'
import torch, torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
q = torch.randn(1, 20, 300, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(1, 20, 900, 128, device="cuda", dtype=torch.bfloat16)
o = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, is_causal=True, return_debug_mask=False)[0]
r = F.scaled_dot_product_attention(q.float(), k.float(), k.float(), attn_mask=causal_lower_right(300, 900))
print("flash lower-right check: max |diff| vs fp32 reference", (o.float() - r).abs().max().item())
PY
{ timeout 90 torchrun --standalone --nproc-per-node 1 -m benchmarks.nccl_harness --backend nccl \
    --ordering none,selective,global-implicit --register-pairs --rendezvous gloo --out /tmp/nccl-ws1; echo "harness rc $?"
  python -m ainfer_pd.tools.cli trace-check /tmp/nccl-ws1/selective; python -m ainfer_pd.tools.cli trace-check /tmp/nccl-ws1/global-implicit
  timeout 90 torchrun --standalone --nproc-per-node 1 -m ainfer_pd.tools.cli replay --config configs/tiny-cuda.yaml \
    --conversations 8 --max-turns 2 --policies normal,fine-grained --no-progress; echo "replay rc $?"
} > "$O/nccl_ws1.log" 2>&1
timeout 200 python -m trainer_examples.live_rl.run --config configs/live-rl-h200.yaml --steps 32 --policy both \
    --prompts 8 --group 8 --action-tokens 16 --prompt-filler 32 256 --obs-filler 16 64 \
    --tool-latency-ms 5 30 --lr 1e-3 --out /tmp/lrl > "$O/live_rl.log" 2>&1; echo "live-rl rc $?" >> "$O/live_rl.log"
cp /tmp/lrl/*.json /tmp/lrl/*.png "$O/" 2>/dev/null
B="python -m ainfer_pd.tools.cli bench --config configs/h200-bench.yaml --no-progress --conversations 48 --max-turns 3 --token-scale 0.5 --repeats 1"
{ timeout 100 $B --policies normal,fine-grained,mixed-chunked --cells P1
  timeout 60 $B --policies normal,fine-grained --decode-only --cells P1
  timeout 70 $B --policies normal,fine-grained --cells trace
} > "$O/bench_check.log" 2>&1
echo done >> "$X"
