"""The sampler's cost per D iteration on a real vocabulary (GPU host, or CPU).

Times ``engine.sampler.sample`` on float32 logits [B, V] already on the device, as ``finish_decode``
calls it, for greedy rows and for RL-style rows (temperature 1, seeded; and with top-k 50 /
top-p 0.9): wall ms per call, median of ``--reps``. Every call ends with its host lists, so each
time includes the device sync the engine pays.

    python benchmarks/sampler_bench.py [--vocab 151936] [--batches 1,16,64,128] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ainfer_pd.engine.model.sampler import SampleRow, sample, sample_seed
from ainfer_pd.request import SamplingParams

KINDS = {
    "greedy": SamplingParams(temperature=0.0),
    "temp1": SamplingParams(temperature=1.0, seed=7),
    "temp1_topk50_topp0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7),
    "temp1_reppen1.1": SamplingParams(temperature=1.0, repetition_penalty=1.1, seed=7),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device(a.device)
    print(f"sampler on {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}), vocab {a.vocab}")
    print(f"{'kind':>22} " + " ".join(f"{'B' + b:>9}" for b in a.batches.split(",")) + "   (ms per call)")
    for kind, p in KINDS.items():
        cells = []
        for B in (int(b) for b in a.batches.split(",")):
            logits = torch.randn(B, a.vocab, device=dev) * 3
            hist = list(range(0, min(4000, a.vocab), 7))
            rows = [SampleRow(p, sample_seed(p, i), 0, hist if p.repetition_penalty != 1.0 else None) for i in range(B)]
            ts = []
            for step in range(a.reps + 2):
                for r in rows:
                    r.step = step
                t0 = time.perf_counter()
                sample(logits, rows)
                ts.append(time.perf_counter() - t0)
            cells.append(statistics.median(ts[2:]) * 1e3)
        print(f"{kind:>22} " + " ".join(f"{c:>9.3f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
