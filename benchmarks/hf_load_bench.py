"""Hugging Face loading on CPU: the Qwen3-30B-A3B shape from a config-only directory (seeded
random init), and the load throughput of a sharded multi-GB safetensors checkpoint written here.

    python benchmarks/hf_load_bench.py --out runs/hf_load            # every case below
    python benchmarks/hf_load_bench.py --cases meta,ep8-rank0 ...

Each case runs in a fresh subprocess (its own peak RSS, ``ru_maxrss``) and prints one JSON line:

* ``meta``: the whole model (48 layers, 128 experts) built on the meta device: exact parameter
  count and bf16 bytes, no memory touched;
* ``ep8-rank0``: what one rank of an expert-parallel-8 deployment builds: all 48 layers, attention
  and embeddings, its 16 of the 128 experts, random init (bf16);
* ``layers8``: the whole model cut to 8 of the 48 layers (all 128 experts), random init; the
  ``scaled_to_48`` fields scale its per-layer part to 48 layers;
* ``full``: all 48 layers and 128 experts (61 GB bf16: needs a host with > 64 GB memory);
* ``write``: a 4-layer cut (all experts, bf16) written as a sharded checkpoint of 1 GB shards
  (``ainfer_pd.hf.export.save_pretrained``); ``load`` / ``load-ep8-rank0``: a fresh process loads it
  (every tensor / only expert-parallel rank 0's experts), page cache warm from the write.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's ainfer_pd, not an installed one

# Qwen3-30B-A3B's config.json (the fields that shape the model)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "bos_token_id": 151643, "eos_token_id": 151645,
    "initializer_range": 0.02, "use_cache": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
    "attention_dropout": 0.0,
}
CASES = ("meta", "ep8-rank0", "layers8", "write", "load", "load-ep8-rank0")


def _config_dir(root: Path, **changes) -> Path:
    d = root / ("qwen3-30b-a3b" + "".join(f"-{k}{v}" for k, v in changes.items()))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **changes}, indent=1))
    return d


def _peak_rss_gb() -> float:
    """Peak resident set of this process (VmHWM: anonymous memory plus mapped file pages)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_case(case: str, root: Path) -> dict:
    import torch

    from ainfer_pd import WorkerConfig
    from ainfer_pd.engine.model.model import MoETransformer, build_model
    torch.set_num_threads(os.cpu_count() or 1)
    out: dict = {"case": case}
    if case == "meta":
        c = WorkerConfig.from_pretrained(_config_dir(root)).model
        with torch.device("meta"):
            m = MoETransformer(c)
        n = sum(p.numel() for p in m.parameters())
        out.update(params=n, bf16_gb=2 * n / 1e9, config_num_params=c.num_params,
                   expert_params=sum(p.numel() for nm, p in m.named_parameters() if nm.endswith((".w13", ".w2"))))
        return out
    if case in ("ep8-rank0", "layers8", "full"):
        changes = {"num_hidden_layers": 8} if case == "layers8" else {}
        c = WorkerConfig.from_pretrained(_config_dir(root, **changes)).model
        experts = (0, 16) if case == "ep8-rank0" else None
        t0 = time.perf_counter()
        m = build_model(c, "cpu", experts=experts)
        dt = time.perf_counter() - t0
        nbytes = _param_bytes(m)
        out.update(seconds=dt, param_gb=nbytes / 1e9, peak_rss_gb=_peak_rss_gb(), layers=c.num_layers,
                   experts_held=list(m.expert_range), random_init=m.load_report.random_init,
                   init_gb_per_s=nbytes / dt / 1e9)
        if case == "layers8":
            per_layer = (nbytes - 2 * c.vocab_size * c.hidden_size * 2) / c.num_layers
            full = nbytes + per_layer * (48 - c.num_layers)
            out.update(scaled_to_48_param_gb=full / 1e9, scaled_to_48_seconds=dt * full / nbytes)
        return out
    ckpt = root / "ckpt-4layers"
    if case == "write":
        c = WorkerConfig.from_pretrained(_config_dir(root, num_hidden_layers=4)).model
        from ainfer_pd.hf.export import save_pretrained
        m = build_model(c, "cpu")
        if ckpt.exists():
            shutil.rmtree(ckpt)
        t0 = time.perf_counter()
        save_pretrained(m, ckpt, max_shard_bytes=1 << 30)
        dt = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        out.update(seconds=dt, checkpoint_gb=size / 1e9, shards=len(list(ckpt.glob("*.safetensors"))),
                   write_gb_per_s=size / dt / 1e9, peak_rss_gb=_peak_rss_gb())
        return out
    if case in ("load", "load-ep8-rank0"):
        c = WorkerConfig.from_pretrained(ckpt).model
        experts = (0, 16) if case == "load-ep8-rank0" else None
        t0 = time.perf_counter()
        m = build_model(c, "cpu", experts=experts)
        dt = time.perf_counter() - t0
        r = m.load_report
        import ainfer_pd
        out.update(seconds=dt, bytes_read_gb=r.bytes_read / 1e9, read_seconds=r.seconds, gb_per_s=r.gb_per_s,
                   package=str(Path(ainfer_pd.__file__).parent),
                   tensors_read=len(r.tensors_read), tensors_skipped=len(r.tensors_skipped), shards=len(r.files),
                   param_gb=_param_bytes(m) / 1e9, peak_rss_gb=_peak_rss_gb())
        return out
    raise SystemExit(f"unknown case {case!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--root", type=Path, default=Path("/tmp/ainfer_pd_hf_bench"),
                   help="where the config-only directories and the written checkpoint go")
    p.add_argument("--out", type=Path, help="also write results.json here")
    p.add_argument("--case", help=argparse.SUPPRESS)          # one case in this process
    p.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    a = p.parse_args()
    a.root.mkdir(parents=True, exist_ok=True)
    if a.case:
        print(json.dumps(run_case(a.case, a.root)), flush=True)
        return 0
    results = []
    for case in a.cases.split(","):
        r = subprocess.run([sys.executable, __file__, "--case", case, "--root", str(a.root)],
                           capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return r.returncode
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(res), flush=True)
        results.append(res)
    if not a.keep:
        shutil.rmtree(a.root / "ckpt-4layers", ignore_errors=True)
    if a.out:
        import platform

        import torch
        a.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                            "mem_total_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9},
                "command": " ".join(sys.argv), "results": results}
        (a.out / "results.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
