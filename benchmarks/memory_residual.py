"""What a closed worker leaves allocated on the device: each policy's worker in turn on the tiny
model, then the live blocks by size, stream and pool, and what is left once torch's cuBLAS
workspaces are freed (a diagnostic; run on a GPU host: ``PYTHONPATH=. python
benchmarks/memory_residual.py``). At b6cf56b on the H100 every worker left one 32 MiB block on
each of its two streams, new streams each time; 2.8 MiB stayed once the workspaces were freed."""
import asyncio
import collections

import torch

from ainfer_pd import RolloutWorker
from ainfer_pd.engine.kv.residency import collect_device_memory
from cuda_smoke import conversations, smoke_cfg   # this script's folder is on sys.path


def live_blocks():
    c = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                c[(b["size"], seg["stream"], seg.get("segment_pool_id", (0, 0)) != (0, 0))] += 1
    return c


async def main():
    seen = set()
    for i, policy in enumerate(["normal", "fine-grained", "mixed-chunked", "normal"]):
        async with RolloutWorker(smoke_cfg(policy, True, "bfloat16")) as w:
            await conversations(w)
            streams = {k: s.cuda_stream for k, s in w.engine.device._cuda_streams.items()}
            blocks = w.metrics().get("kv_total_blocks")
        collect_device_memory()
        new = set(streams.values()) - seen
        seen |= set(streams.values())
        print(f"{i} {policy} (KV blocks {blocks}): after close allocated {torch.cuda.memory_allocated() / 2**20:.1f} "
              f"MiB, reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB; streams {len(streams)} ({len(new)} not "
              f"used before) {sorted(streams)}", flush=True)
        for (size, stream, pool), n in sorted(live_blocks().items()):
            print(f"    live: {n} x {size/2**20:.2f} MiB on stream {stream:#x} graph-pool {pool}", flush=True)
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
        collect_device_memory()
        print(f"after clearing cuBLAS workspaces: allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB",
              flush=True)


asyncio.run(main())
