"""Routing replay on a device (issue 15): ``cache.routed_experts`` on vs off - the decode time per
token of a batch of concurrent turns (CUDA-graph decode records the ids inside the graph), and how
the returned ids agree with the router's top-k of one full recompute of each sequence (the engine's
reference forward on the same device; bf16 can flip near-ties between a cached decode and a full
prefill, so the agreement is printed, not asserted).

    python benchmarks/routed_experts_bench.py --config configs/live-rl-h200.yaml --rows 32 --tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq  # noqa: E402


class _Recorder:
    def __init__(self) -> None:
        self.ids: dict[int, torch.Tensor] = {}

    def record(self, layer: int, slots: torch.Tensor, topk_idx: torch.Tensor) -> None:
        self.ids[layer] = topk_idx.clone()


def reference(model, mc, seq: list[int], device) -> torch.Tensor:
    T, bs = len(seq), 16
    S = -(-T // bs) * bs                   # whole blocks: the paged prefill kernel reads them by block id
    kv = torch.zeros(mc.num_layers, 2, S, mc.num_kv_heads, mc.head_dim, dtype=mc.torch_dtype, device=device)
    slots = torch.arange(T, device=device)
    fb = ForwardBatch(torch.tensor(seq, device=device), torch.arange(T, device=device), slots,
                      [PrefillSeq(0, T, T, slots.cpu())], None, torch.tensor([T - 1], device=device),
                      block_size=bs)
    rec, keep = _Recorder(), model.routing_sink
    model.routing_sink = rec
    try:
        with torch.inference_mode():
            model.forward_batch(fb, kv)
    finally:
        model.routing_sink = keep
    return torch.stack([rec.ids[i] for i in sorted(rec.ids)], 1).cpu()


async def run(cfg: WorkerConfig, args, routed: bool) -> dict:
    cfg = cfg.replace(**{"cache.routed_experts": routed})
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(2, cfg.model.vocab_size) for _ in range(args.prompt)] for _ in range(args.rows)]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True, return_routed_experts=routed)
    async with RolloutWorker(cfg) as w:
        times = []
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[w.generate(p, params) for p in prompts])
            dt = time.perf_counter() - t0
            if rep:
                times.append(dt)                           # rep 0: warm-up
            for o in outs:
                await w.release(o.trajectory_id)
        res = {"routed": routed, "s_per_round": statistics.median(times),
               "ms_per_decode_token": 1e3 * statistics.median(times) / args.tokens,
               "graph_replays": getattr(w.engine.runner.graphs, "num_replays", None)}
        if routed:
            agree = total = 0
            model, dev = w.engine.runner.model, w.engine.runner.device
            for p, o in list(zip(prompts, outs))[:args.check]:
                seq = p + o.token_ids
                ref = reference(model, cfg.model, seq, dev)[:len(seq) - 1]
                got = o.routed_experts.long().sort(-1).values
                agree += int((got == ref.long().sort(-1).values).all(-1).sum())
                total += got.shape[0] * got.shape[1]
                assert tuple(o.routed_experts.shape) == (len(seq) - 1, ref.shape[1], cfg.model.top_k)
            res["agreement"] = agree / total
            res["checked_rows"] = total
            res["buffer_MiB"] = w.engine.runner.routed.nbytes / 2 ** 20
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "live-rl-h200.yaml"))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", type=int, default=8, help="sequences compared with a recompute")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = WorkerConfig.from_yaml(args.config)
    out = {}
    for routed in (False, True, False, True):
        r = asyncio.run(run(cfg, args, routed))
        print(json.dumps(r), flush=True)
        out.setdefault(routed, []).append(r)
    off = statistics.median(r["ms_per_decode_token"] for r in out[False])
    on = statistics.median(r["ms_per_decode_token"] for r in out[True])
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{dev}, {args.rows} rows x {args.tokens} tokens: {off:.3f} ms per decode step off, {on:.3f} on "
          f"({100 * (on / off - 1):+.1f}%); ids agree with a full recompute on "
          f"{100 * out[True][-1]['agreement']:.2f}% of {out[True][-1]['checked_rows']} (token, layer) rows; "
          f"buffer {out[True][-1]['buffer_MiB']:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
