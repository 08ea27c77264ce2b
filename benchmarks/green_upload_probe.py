"""Does a blocking host-to-device upload on the host's default stream wait for work queued on another
stream? The D build's ``torch.tensor(..., device=cuda)`` uploads run on the event loop thread, and
inside turnstile rounds (where gated P runs on a green context's stream) its launch came ~1 ms after
the device drained. For each kind of stream: queue ~``--busy-ms`` of matmuls on it, then time one
such upload at once on the default stream, and one under a side pool stream.

    python benchmarks/green_upload_probe.py [--sms 96] [--busy-ms 50]
"""
from __future__ import annotations

import argparse
import time

import torch


def queue_busy(stream, x, n: int) -> None:
    with torch.cuda.stream(stream):
        for _ in range(n):
            torch.mm(x, x)


def upload_ms(vals, side=None) -> float:
    t0 = time.perf_counter()
    if side is None:
        torch.tensor(vals, dtype=torch.int64, device="cuda")
    else:
        with torch.cuda.stream(side):
            torch.tensor(vals, dtype=torch.int64, device="cuda")
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=96)
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("green_upload_probe: needs a CUDA device")
    x = torch.randn(4096, 4096, device="cuda")
    torch.mm(x, x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.mm(x, x)
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    n = max(1, int(a.busy_ms / max(one, 1e-3)))
    streams = {"pool": torch.cuda.Stream()}
    try:
        from torch.cuda.green_contexts import GreenContext
        g = GreenContext.create(num_sms=a.sms, device_id=0)
        streams[f"green{a.sms}"] = g.Stream()
    except Exception as e:  # noqa: BLE001 - reported, the pool stream still measured
        print(f"no green context: {e!r}")
    side = torch.cuda.Stream()
    vals = list(range(64))
    print(f"one mm {one:.2f} ms; {n} queued a case (~{n * one:.0f} ms)")
    for name, s in streams.items():
        for where, sd in (("default stream", None), ("side pool stream", side)):
            ts = []
            for _ in range(a.reps):
                queue_busy(s, x, n)
                ts.append(upload_ms(vals, sd))
                torch.cuda.synchronize()
            print(f"{name:8s} busy, upload on the {where}: " + " / ".join(f"{t:.2f}" for t in ts) + " ms")
    ts = [upload_ms(vals) for _ in range(a.reps)]
    print("idle device, upload on the default stream: " + " / ".join(f"{t:.2f}" for t in ts) + " ms")


if __name__ == "__main__":
    main()
