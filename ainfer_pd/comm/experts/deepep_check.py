"""The multi-GPU check of the DeepEP backend: P normal + D low-latency dispatches running
concurrently against an EP = 1 reference, then the ownership audit (needs >= 2 GPUs and
``deep_ep``). ``torchrun --standalone --nproc-per-node 8 -m ainfer_pd.comm.experts.deepep_check ...``
runs :func:`main`."""
from __future__ import annotations

from typing import Any

import torch

from ...phase import Phase
from .deepep import DeepEPConfig, deepep_shared_objects, import_deep_ep, make_deepep_dispatchers


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - needs >= 2 GPUs + deep_ep
    """``torchrun --standalone --nproc-per-node 8 -m ainfer_pd.comm.experts.deepep_check ...``"""
    import argparse
    import json
    import os
    import threading

    import torch.distributed as dist
    import torch.nn.functional as F

    from .local import LocalDispatcher

    ap = argparse.ArgumentParser(description="DeepEP P normal + D low-latency, concurrently")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--p-tokens", type=int, default=4096)
    ap.add_argument("--d-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--audit-json", default=None)
    args = ap.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, R = dist.get_rank(), dist.get_world_size()
    p_group, d_group = dist.new_group(backend="nccl"), dist.new_group(backend="nccl")
    cfg = DeepEPConfig(num_experts=args.num_experts, hidden=args.hidden, top_k=args.top_k,
                       num_ranks=R, max_decode_tokens_per_rank=args.d_tokens)
    de = import_deep_ep()
    p_stream, d_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    pd = make_deepep_dispatchers(p_group, d_group, cfg, deep_ep=de, d_stream=d_stream)
    E, H, I, K, L = cfg.num_experts, cfg.hidden, args.inter, cfg.top_k, cfg.num_local_experts
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, H, 2 * I, generator=g) * 0.02).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    lo = rank * L

    def swiglu(h, e):
        a, b = (h @ w13[e]).chunk(2, -1)
        return (F.silu(a) * b) @ w2[e]

    def grouped(first):                       # rows sorted by local expert, counts [L]
        def fn(xg, counts):
            out, s = torch.zeros_like(xg), 0
            for l, c in enumerate(counts.tolist()):
                if c:
                    out[s:s + c] = swiglu(xg[s:s + c], first + l)
                    s += c
            return out
        return fn

    def masked(xm, counts):                   # DeepEP low-latency [L, C, H]
        out = torch.zeros_like(xm)
        for l, c in enumerate(counts.tolist()):
            if c:
                out[l, :c] = swiglu(xm[l, :c], lo + l)
        return out

    def batch(T, seed):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=gg).to(dev, torch.bfloat16)
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=gg), -1), K, -1)
        return x, idx.to(dev), (w / w.sum(-1, keepdim=True)).to(dev)

    errors: dict[str, list] = {"P": [], "D": []}

    def loop(phase: Phase, T: int, stream: Any, fn: Any) -> None:
        disp = pd.get(phase)
        # the EP = 1 reference of this thread (its own buffers: the threads' streams overlap)
        ref_disp = LocalDispatcher(phase, E, hidden=H, top_k=K, max_tokens=T,
                                   dtype=torch.bfloat16, device=dev)
        try:
            with torch.cuda.stream(stream):
                for i in range(args.iters):
                    x, idx, w = batch(T, 1000 * rank + 2 * i + (phase is Phase.DECODE))
                    out = disp.run_moe(x, idx, w, fn)
                    ref = ref_disp.run_moe(x, idx, w, grouped(0))
                    ok = torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
                    errors[phase.value].append(None if ok else float((out.float() - ref.float()).abs().max()))
        except BaseException as exc:
            errors[phase.value].append(repr(exc))

    threads = [threading.Thread(target=loop, args=(Phase.PREFILL, args.p_tokens, p_stream, grouped(lo))),
               threading.Thread(target=loop, args=(Phase.DECODE, args.d_tokens, d_stream, masked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    bad = {k: [e for e in v if e is not None] for k, v in errors.items()}
    report = pd.registry(deepep_shared_objects(de)).audit()
    summary = {"rank": rank, "iters": {k: len(v) for k, v in errors.items()}, "failures": bad,
               "audit": report.to_dict()}
    gathered: list[Any] = [None] * R
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        ok = all(not s["failures"]["P"] and not s["failures"]["D"] and s["audit"]["ok"] for s in gathered)
        print(json.dumps({"ok": ok, "ranks": [{k: v for k, v in s.items() if k != "audit"}
                                               | {"audit_ok": s["audit"]["ok"]} for s in gathered]}, indent=1))
        if args.audit_json:
            with open(args.audit_json, "w") as f:
                json.dump(gathered, f, indent=1)
    pd.prefill.close()
    pd.decode.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
