"""The host time of sampling one D step's rows with a repetition penalty (issue 33: the host side).

``--rows`` rows of ``--history`` random token ids each (a turn's ids as the engine keeps them, an
``array('q')``), vocabulary ``--vocab`` (the Qwen3 shape's 151,936): the median host time of
``TurnBook.sample_row``'s snapshot and of enqueueing ``sample_on_device`` with
``pinned=True`` (as the overlapped D loop samples), against the same rows without a penalty. On
CUDA the device work is asynchronous, so the figure is host time; on the CPU the tensor work runs
inline and is counted too (read the difference between the rows). The ``pool`` row is the D loop's
way (``TurnBook.sample_row(live=True)`` and the runner's ``SeenMasks``): each row passes its live
history and length, one token is appended to every history a step, and the pool uploads only those
(its first step, every whole history, is left out as the warm-up).

    python benchmarks/sampler_host_bench.py [--device cuda] [--rows 64] [--history 10000]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import SamplingParams  # noqa: E402
from ainfer_pd.engine.model.sampler import SampleRow, sample_on_device  # noqa: E402
from ainfer_pd.engine.model.seen_masks import SeenMasks  # noqa: E402


def host_ms(logits: torch.Tensor, hists: list[array], params: SamplingParams, reps: int, pool: bool = False) -> float:
    """Median ms of building the rows (a snapshot of each history; ``pool``: the live histories, one
    token longer each step, through a :class:`SeenMasks`) and enqueueing their sampling."""
    times = []
    masks = SeenMasks() if pool else None
    hists = [array("q", h) for h in hists] if pool else hists
    for step in range(reps + 1):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if pool:
            for i, h in enumerate(hists):
                h.append((i + step) % logits.shape[1])
            rows = [SampleRow(params, 1, 0, h, f"t{i}", len(h)) for i, h in enumerate(hists)]
        else:
            rows = [SampleRow(params, 1, 0, array("q", h) if params.repetition_penalty != 1.0 else None)
                    for h in hists]
        sample_on_device(logits, rows, pinned=True, masks=masks)
        times.append(time.perf_counter() - t0)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--history", type=int, default=10000)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    hists = [array("q", [rng.randrange(args.vocab) for _ in range(args.history)]) for _ in range(args.rows)]
    logits = torch.randn(args.rows, args.vocab, device=args.device, dtype=torch.bfloat16)
    for pen, pool in ((1.0, False), (1.05, False), (1.05, True)):
        p = SamplingParams(temperature=1.0, repetition_penalty=pen, seed=3)
        ms = host_ms(logits, hists, p, args.reps, pool)
        print(f"FIG sampler_host rows={args.rows} history={args.history} vocab={args.vocab} device={args.device} "
              f"repetition_penalty={pen} pool={pool} host_ms={ms:.2f}", flush=True)


if __name__ == "__main__":
    main()
