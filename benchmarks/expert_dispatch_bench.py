"""Expert dispatch latency: P path and D path, alone and with the other phase active.

CPU (default): 2 gloo ranks (processes), ``TorchAllToAllDispatcher`` per phase, each on its
own process group. Measures, per phase, dispatch (notify + counts wait + data all-to-all
+ regroup) and combine (reverse all-to-all + weighted top-k sum) with an identity expert
(communication + routing only), first alone, then while the other phase runs back-to-back
in a second thread.

    python benchmarks/expert_dispatch_bench.py                       # CPU, 2 ranks
    python benchmarks/expert_dispatch_bench.py --device cuda         # GPU, world size 1

GPU mode (world size 1): local routing overhead of ``LocalDispatcher`` vs a plain expert
loop, eager and CUDA-graph captured, bf16, with ``torch._grouped_mm`` experts; ``--nccl``
adds the torch all-to-all dispatcher over a world-size-1 NCCL group.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ainfer_pd.comm.experts.local import LocalDispatcher  # noqa: E402
from ainfer_pd.engine.runtime.cuda_graphs import CAPTURE_MODE  # noqa: E402
from ainfer_pd.phase import Phase  # noqa: E402


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": round(1e3 * statistics.median(xs), 3),
            "p90_ms": round(1e3 * xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3),
            "mean_ms": round(1e3 * statistics.fmean(xs), 3)}


def _batch(num_tokens: int, hidden: int, num_experts: int, top_k: int, seed: int, device="cpu",
           dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(device=device, dtype=dtype)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    w, idx = torch.topk(torch.softmax(scores, -1), top_k, -1)
    return x, idx.to(device), (w / w.sum(-1, keepdim=True)).to(device)


# ---- CPU: 2 gloo ranks ----------------------------------------------------------------------
def _one(disp, x, idx, w):
    t0 = time.perf_counter()
    n = disp.notify(idx)
    n.wait_sync()
    d = disp.dispatch(n, x, idx, w)
    t1 = time.perf_counter()
    disp.combine(d, d.x)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _measure(disp, batch, iters):
    disp_t, comb_t = [], []
    ends = []
    for _ in range(iters):
        a, b = _one(disp, *batch)
        disp_t.append(a)
        comb_t.append(b)
        ends.append(time.perf_counter())
    return disp_t, comb_t, ends


def _cpu_rank(rank, world, port, args, q):
    import torch.distributed as dist
    from ainfer_pd.comm.experts.torch_a2a import TorchAllToAllDispatcher, new_phase_groups
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    groups = new_phase_groups()
    H, E, K = args.hidden, args.num_experts, args.top_k
    sizes = {Phase.PREFILL: args.p_tokens, Phase.DECODE: args.d_tokens}
    disp = {ph: TorchAllToAllDispatcher(ph, groups[ph], rank, world, E, hidden=H, top_k=K,
                                        max_tokens=sizes[ph]) for ph in Phase}
    batch = {ph: _batch(sizes[ph], H, E, K, 17 * rank + (ph is Phase.DECODE)) for ph in Phase}
    iters = {Phase.PREFILL: args.p_iters, Phase.DECODE: args.d_iters}
    out = {}
    for ph in Phase:                                                   # warm-up + alone
        _measure(disp[ph], batch[ph], 3)
        dist.barrier()
        d_t, c_t, _ = _measure(disp[ph], batch[ph], iters[ph])
        out[f"{ph.value}.alone"] = {"dispatch": _stats(d_t), "combine": _stats(c_t)}
    # with the other phase active: the background phase runs a fixed count (same on all
    # ranks, sized from rank 0's alone timings to outlast the foreground); only foreground
    # iterations that finished while the background was still running are kept
    for fg in Phase:
        bg = fg.other
        per = torch.tensor([out[f"{p.value}.alone"]["dispatch"]["mean_ms"]
                            + out[f"{p.value}.alone"]["combine"]["mean_ms"] for p in (fg, bg)])
        dist.broadcast(per, 0)
        bg_iters = int(math.ceil(2.0 * iters[fg] * float(per[0]) / float(per[1]))) + 5
        bg_end = [math.inf]

        def background():
            _measure(disp[bg], batch[bg], bg_iters)
            bg_end[0] = time.perf_counter()

        dist.barrier()
        th = threading.Thread(target=background)
        th.start()
        d_t, c_t, ends = _measure(disp[fg], batch[fg], iters[fg])
        th.join()
        keep = [i for i, e in enumerate(ends) if e <= bg_end[0]]
        out[f"{fg.value}.with_{bg.value}"] = {"dispatch": _stats([d_t[i] for i in keep]),
                                             "combine": _stats([c_t[i] for i in keep]),
                                             "background_iters": bg_iters}
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run_cpu(args) -> dict:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_cpu_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return {"mode": "cpu-gloo", "world": args.world, "hidden": args.hidden,
            "num_experts": args.num_experts, "top_k": args.top_k, "p_tokens": args.p_tokens,
            "d_tokens": args.d_tokens, "per_rank": res}


# ---- GPU: world size 1 ------------------------------------------------------------------------
def _cuda_time(fn, iters: int) -> float:
    from _cuda_timing import cuda_time_s   # benchmarks/ is on sys.path when run as a script
    return cuda_time_s(fn, iters) * 1e3    # ms


def run_cuda(args) -> dict:  # pragma: no cover - GPU host only
    import torch.nn.functional as F
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, E, K, I = args.hidden, args.num_experts, args.top_k, args.inter
    g = torch.Generator(device="cpu").manual_seed(0)
    w13 = (torch.randn(E, H, 2 * I, generator=g) * 0.02).to(dev, dt)
    w2 = (torch.randn(E, I, H, generator=g) * 0.02).to(dev, dt)

    def experts(xg, counts):                       # grouped SwiGLU over expert-sorted rows
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xg, w13, offs=offs)
        gg, u = h.chunk(2, -1)
        return torch._grouped_mm(F.silu(gg) * u, w2, offs=offs)

    def plain_loop(x, idx, w):                     # per-expert mask / gather / scatter (host syncs)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                h = x[tok] @ w13[e]
                gg, u = h.chunk(2, -1)
                y = (F.silu(gg) * u) @ w2[e]
                out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1).to(dt))
        return out

    res = {"mode": "cuda-ws1", "device": torch.cuda.get_device_name(), "hidden": H,
           "num_experts": E, "top_k": K, "inter": I, "dtype": "bfloat16", "rows": []}
    for T in args.cuda_tokens:
        x, idx, w = _batch(T, H, E, K, 1, device=dev, dtype=dt)
        row = {"tokens": T}
        for ph in Phase:
            disp = LocalDispatcher(ph, E, hidden=H, top_k=K, max_tokens=T, dtype=dt, device=dev)

            def routed():
                return disp.run_moe(x, idx, w, experts)

            def routing_only():
                return disp.run_moe(x, idx, w, lambda xg, c: xg)

            row[f"{ph.value}.run_moe_ms"] = round(_cuda_time(routed, args.cuda_iters), 4)
            row[f"{ph.value}.routing_only_ms"] = round(_cuda_time(routing_only, args.cuda_iters), 4)
            if ph is Phase.DECODE:
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    routed()
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
                    routed()
                row["D.graph_run_moe_ms"] = round(_cuda_time(graph.replay, args.cuda_iters), 4)
        n = LocalDispatcher(Phase.PREFILL, E, hidden=H, top_k=K, max_tokens=T, dtype=dt, device=dev)
        nt = n.notify(idx)
        d = n.dispatch(nt, x, idx, w)
        xg, counts = d.x.clone(), d.counts.clone()
        n.combine(d, d.x)
        row["experts_only_ms"] = round(_cuda_time(lambda: experts(xg, counts), args.cuda_iters), 4)
        row["plain_loop_ms"] = round(_cuda_time(lambda: plain_loop(x, idx, w), max(5, args.cuda_iters // 10)), 4)
        row["routing_overhead_ms"] = round(row["P.run_moe_ms"] - row["experts_only_ms"], 4)
        res["rows"].append(row)
    if args.nccl:
        import torch.distributed as dist
        from ainfer_pd.comm.experts.torch_a2a import TorchAllToAllDispatcher, new_phase_groups
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        groups = new_phase_groups()
        for T in args.cuda_tokens:
            x, idx, w = _batch(T, H, E, K, 1, device=dev, dtype=dt)
            disp = TorchAllToAllDispatcher(Phase.PREFILL, groups[Phase.PREFILL], 0, 1, E, hidden=H,
                                           top_k=K, max_tokens=T, dtype=dt, device=dev)
            res.setdefault("nccl_ws1", []).append({"tokens": T, "torch_a2a_run_moe_ms": round(_cuda_time(
                lambda: disp.run_moe(x, idx, w, experts), args.cuda_iters), 4)})
        dist.destroy_process_group()
    return res


def cpu_table(res: dict) -> str:
    """Markdown table: p50 / p90 ms per case, rank 0 and rank 1."""
    lines = ["| case | tokens/rank | dispatch p50 / p90 ms | combine p50 / p90 ms |",
             "|---|---|---|---|"]
    for case in ("P.alone", "P.with_D", "D.alone", "D.with_P"):
        tok = res["p_tokens"] if case.startswith("P") else res["d_tokens"]
        cells = []
        for what in ("dispatch", "combine"):
            per = [res["per_rank"][r][case][what] for r in sorted(res["per_rank"])]
            cells.append(" ; ".join(f"{s['p50_ms']:.2f} / {s['p90_ms']:.2f}" for s in per))
        lines.append(f"| {case} | {tok} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--num-experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--p-tokens", type=int, default=2048)
    ap.add_argument("--d-tokens", type=int, default=64)
    ap.add_argument("--p-iters", type=int, default=20)
    ap.add_argument("--d-iters", type=int, default=100)
    ap.add_argument("--cuda-tokens", type=int, nargs="+", default=[8, 64, 256, 2048, 8192])
    ap.add_argument("--cuda-iters", type=int, default=100)
    ap.add_argument("--nccl", action="store_true", help="GPU: also the torch a2a dispatcher (NCCL ws 1)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        args.hidden, args.num_experts, args.top_k = args.hidden or 256, args.num_experts or 16, args.top_k or 2
        res = run_cpu(args)
    else:
        args.hidden, args.num_experts, args.top_k = args.hidden or 2560, args.num_experts or 64, args.top_k or 8
        res = run_cuda(args)
    res["machine"] = f"{platform.node()} ({os.cpu_count()} cores, torch {torch.__version__})"
    text = json.dumps(res, indent=1)
    print(text)
    if args.device == "cpu":
        print(cpu_table(res))
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
