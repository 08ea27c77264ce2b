"""The multi-GPU check of the DeepEP backend: P normal + D low-latency dispatches running
concurrently against an EP = 1 reference, then the ownership audit (needs >= 2 GPUs and
``deep_ep``). ``torchrun --standalone --nproc-per-node 8 -m ainfer_pd.comm.experts.deepep_check ...``
runs :func:`main`."""
from __future__ import annotations

from typing import Any

import torch

from ...phase import Phase
from .deepep import DeepEPConfig, deepep_shared_objects, import_deep_ep, make_deepep_dispatchers


def _parse_args(argv: list[str] | None) -> Any:
    import argparse

    ap = argparse.ArgumentParser(description="DeepEP P normal + D low-latency, concurrently")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--p-tokens", type=int, default=4096)
    ap.add_argument("--d-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--audit-json", default=None)
    return ap.parse_args(argv)


class _Experts:  # pragma: no cover - needs a GPU
    """The check's SwiGLU experts (all ``E`` of them, bf16 on ``dev``), the expert functions of the
    two dispatch layouts and the random batches."""

    def __init__(self, cfg: DeepEPConfig, inter: int, rank: int, dev: Any) -> None:
        self.E, self.H, self.K, self.L = cfg.num_experts, cfg.hidden, cfg.top_k, cfg.num_local_experts
        self.dev = dev
        E, H, I = self.E, self.H, inter
        g = torch.Generator().manual_seed(0)
        self.w13 = (torch.randn(E, H, 2 * I, generator=g) * 0.02).to(dev, torch.bfloat16)
        self.w2 = (torch.randn(E, I, H, generator=g) * 0.02).to(dev, torch.bfloat16)
        self.lo = rank * self.L

    def swiglu(self, h, e):
        import torch.nn.functional as F

        a, b = (h @ self.w13[e]).chunk(2, -1)
        return (F.silu(a) * b) @ self.w2[e]

    def grouped(self, first):                 # rows sorted by local expert, counts [L]
        def fn(xg, counts):
            out, s = torch.zeros_like(xg), 0
            for l, c in enumerate(counts.tolist()):
                if c:
                    out[s:s + c] = self.swiglu(xg[s:s + c], first + l)
                    s += c
            return out
        return fn

    def masked(self, xm, counts):             # DeepEP low-latency [L, C, H]
        out = torch.zeros_like(xm)
        for l, c in enumerate(counts.tolist()):
            if c:
                out[l, :c] = self.swiglu(xm[l, :c], self.lo + l)
        return out

    def batch(self, T, seed):
        gg = torch.Generator().manual_seed(seed)
        x = torch.randn(T, self.H, generator=gg).to(self.dev, torch.bfloat16)
        w, idx = torch.topk(torch.softmax(torch.randn(T, self.E, generator=gg), -1), self.K, -1)
        return x, idx.to(self.dev), (w / w.sum(-1, keepdim=True)).to(self.dev)


def _run_concurrently(pd: Any, ex: _Experts, args: Any, rank: int, p_stream: Any,
                      d_stream: Any) -> dict[str, list]:  # pragma: no cover - needs >= 2 GPUs + deep_ep
    """P and D dispatch loops on two threads (their own streams), each checked against an EP = 1
    reference every iteration; per phase: None (match), the max error, or the exception's repr."""
    import threading

    from .local import LocalDispatcher

    errors: dict[str, list] = {"P": [], "D": []}

    def loop(phase: Phase, T: int, stream: Any, fn: Any) -> None:
        disp = pd.get(phase)
        # the EP = 1 reference of this thread (its own buffers: the threads' streams overlap)
        ref_disp = LocalDispatcher(phase, ex.E, hidden=ex.H, top_k=ex.K, max_tokens=T,
                                   dtype=torch.bfloat16, device=ex.dev)
        try:
            with torch.cuda.stream(stream):
                for i in range(args.iters):
                    x, idx, w = ex.batch(T, 1000 * rank + 2 * i + (phase is Phase.DECODE))
                    out = disp.run_moe(x, idx, w, fn)
                    ref = ref_disp.run_moe(x, idx, w, ex.grouped(0))
                    ok = torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
                    errors[phase.value].append(None if ok else float((out.float() - ref.float()).abs().max()))
        except BaseException as exc:
            errors[phase.value].append(repr(exc))

    threads = [threading.Thread(target=loop, args=(Phase.PREFILL, args.p_tokens, p_stream, ex.grouped(ex.lo))),
               threading.Thread(target=loop, args=(Phase.DECODE, args.d_tokens, d_stream, ex.masked))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _report(pd: Any, de: Any, errors: dict[str, list], rank: int, R: int,
            audit_json: str | None) -> None:  # pragma: no cover - needs >= 2 GPUs + deep_ep
    """Every rank's failures and ownership audit, gathered; rank 0 prints them (and writes
    ``audit_json``)."""
    import json

    import torch.distributed as dist

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
        if audit_json:
            with open(audit_json, "w") as f:
                json.dump(gathered, f, indent=1)


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - needs >= 2 GPUs + deep_ep
    """``torchrun --standalone --nproc-per-node 8 -m ainfer_pd.comm.experts.deepep_check ...``"""
    import os

    import torch.distributed as dist

    args = _parse_args(argv)
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
    ex = _Experts(cfg, args.inter, rank, dev)
    errors = _run_concurrently(pd, ex, args, rank, p_stream, d_stream)
    torch.cuda.synchronize()
    _report(pd, de, errors, rank, R, args.audit_json)
    pd.prefill.close()
    pd.decode.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover
    main()
