"""The FP8 fused MoE kernels compiled for the H200 (sm_90a) on any machine with Triton's NVIDIA
back end (no GPU needed; ``TRITON_INTERPRET`` must be unset): per plan, the registers and spill
bytes ptxas reports, the MMA instructions, and the float16 widenings of e4m3 (``cvt.rn.f16x2.
e4m3x2``: an MMA that is not an e4m3 one), for ``fp8_moe_gate_up_kernel`` and ``fp8_moe_down_kernel``.

    python benchmarks/kernel_ptx_report.py                  # the plan table's decode and prefill plans
    python benchmarks/kernel_ptx_report.py 16,64,128,1,4,4,swap 64,128,128,8,8,3
                        # block_m, block_n, block_k, group_m, warps, stages[, swap]

Constexprs the kernels do not take are dropped, so it also reports kernels from before SWAP_AB /
EVEN_K (swapped plans are then skipped). Shapes: Qwen3-30B-A3B's (D 2048, I 768, top-8), so K
is a multiple of 128 (EVEN_K). Timing is the H200's: ``fp8_kernel_check.py --tiles``.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_OPS = re.compile(r"^\s*((?:cvt|mma|wgmma|fma\.rn\.f32|mul\.f32)[\w.]*)", re.M)
_MMA = ("wgmma.mma_async", "mma.sync")
_WGMMA_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
"""A wait for all but N of the warp group's MMA groups: 0 in a K loop, each step waits on its own MMA."""
_CVT_F16 = "cvt.rn.f16x2.e4m3x2"
_D, _I, _NB_D, _NB_I = 2048, 768, 16, 6           # Qwen3-30B-A3B: hidden, expert intermediate, their 128-blocks
_LAYOUT = {"SORTED": "*i32", "BLOCK_EXPERT": "*i32", "NUM_POST": "*i32"}
_DIRECT_LAYOUT = dict.fromkeys(_LAYOUT, "*i64")   # a direct plan passes the routing's int64 expert ids
# The integer arguments' values at the launch: the runtime specializes each one divisible by 16
# (and every 16-byte aligned pointer) as such, which is what lets the loads become pipelined
# cp.async copies; a compile without it shows unpipelined loops and other register counts.
GATE_UP_INTS = {"K": _D, "I": _I, "NCNT": 0, "stride_xt": _D, "stride_xst": _NB_D, "stride_we": 2 * _I * _D,
                "stride_wn": _D, "stride_wse": 2 * _NB_I * _NB_D, "stride_wsn": _NB_D, "stride_an": _I}
DOWN_INTS = {"K": _I, "N": _D, "NCNT": 0, "stride_an": _I, "stride_asn": _NB_I, "stride_we": _D * _I,
             "stride_wn": _I, "stride_wse": _NB_D * _NB_I, "stride_wsn": _NB_I, "stride_rn": _D, "stride_ot": _D}
DOWN_PTRS = {**_LAYOUT, "A": "*fp8e4nv", "AS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "ROWS": "*bf16",
             "TOPW": "*fp32", "CNT": "*bf16", "OUT": "*bf16"}
_UNSPECIALIZED = ("num_pairs", "P")


def gate_up_args(fuse_quant: bool) -> tuple[dict, dict]:
    """gate_up's pointer types and integer values: act float8 with its scales (quantized in the
    epilogue) or float32 (quantized by a launch of its own; the scale pointer is act's)."""
    act = "*fp8e4nv" if fuse_quant else "*fp32"
    ptrs = {**_LAYOUT, "X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "ACT": act,
            "ACTS": "*fp32", "CNT": "*fp32"}
    return ptrs, {**GATE_UP_INTS, "stride_asn": _NB_I if fuse_quant else _I}


def _ptxas_info(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas
    p = get_ptxas(90)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([getattr(p, "path", p), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def compile_stats(kernel, ptr_types: dict, ints: dict, const: dict, warps: int, stages: int) -> dict:
    """regs, spill bytes, MMA instruction counts, e4m3 -> float16 widenings, every conversion /
    MMA / float32 multiply and FMA mnemonic's count (``ops``), the TMA bulk copies (``tma_loads``) and the
    wgmma waits by the MMA groups they leave in flight (``wgmma_waits``: {N: count}) of one compile,
    specialized as the runtime would for ``ints`` (every pointer 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(kernel.fn).parameters)
    const = {k: v for k, v in const.items() if k in params}
    sig = {p: "constexpr" if p in const else ptr_types.get(p, "i32") for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if ptr_types.get(p, "").startswith("*") or (p in ints and p not in _UNSPECIALIZED and ints[p] % 16 == 0)}
    k = triton.compile(ASTSource(kernel, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    regs, spill = _ptxas_info(ptx)
    ops = Counter(_OPS.findall(ptx))
    return {"regs": regs, "spill": spill, "mma": {op: n for op, n in ops.items() if op.startswith(_MMA)},
            "cvt_f16": sum(n for op, n in ops.items() if op.startswith(_CVT_F16)), "ops": dict(ops),
            "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "wgmma_waits": dict(Counter(int(n) for n in _WGMMA_WAIT.findall(ptx)))}


def plan_stats(bm: int, bn: int, bk: int, gm: int, warps: int, stages: int, swap: bool = False,
               fuse_quant: bool | None = None, kernels: tuple[str, ...] = ("gate_up", "down"),
               direct: bool = False) -> dict:
    """``kernels`` of one tile plan, separate-launch path (act quantized in gate_up's epilogue
    when block_n is 128); ``direct``: each pair its own row block (a token alone)."""
    from ainfer_pd.engine.quant.fp8_kernels import fp8_moe_down_kernel, fp8_moe_gate_up_kernel
    common = dict(TOPK=8, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, GROUP=128, ON_LOAD=False, FOLD=False,
                  SWAP_AB=swap, EVEN_K=True, EXACT=False, DIRECT=direct)
    fq = bn == 128 if fuse_quant is None else fuse_quant
    layout = _DIRECT_LAYOUT if direct else _LAYOUT
    out = {}
    if "gate_up" in kernels:
        ptrs, ints = gate_up_args(fq)
        out["gate_up"] = compile_stats(fp8_moe_gate_up_kernel, {**ptrs, **layout}, ints,
                                       dict(common, FUSE_QUANT=fq, NCNT_PAD=1), warps, stages)
    if "down" in kernels:
        out["down"] = compile_stats(fp8_moe_down_kernel, {**DOWN_PTRS, **layout}, DOWN_INTS, common, warps, stages)
    return out


def _fmt(s: dict) -> str:
    kinds = ",".join(sorted({m.split(".")[0] + ("/e4m3" if "e4m3" in m else "/f16" if "f16" in m else "")
                             for m in s["mma"]}))
    return f"{s['regs']:>4} {s['spill']:>6} {kinds:<22} {s['cvt_f16']:>5}"


def main(argv: list[str]) -> None:
    from ainfer_pd.engine.fused_moe.plan import GemmPlan
    from ainfer_pd.engine.quant.fp8_kernels import fp8_moe_gate_up_kernel
    has_swap = "SWAP_AB" in inspect.signature(fp8_moe_gate_up_kernel.fn).parameters
    plans = []                                   # (tiles, swapped, kernels)
    for a in argv:
        f = a.split(",")
        plans.append((GemmPlan(*map(int, f[:6])), len(f) > 6 and f[6] == "swap", ("gate_up", "down")))
    if not plans:
        from ainfer_pd.engine.quant.fp8_plan import fp8_moe_plan
        for n in (8, 8 * 8192):                  # decode, prefill (128 experts)
            p = fp8_moe_plan(n, 128)
            swap = getattr(p, "swap_ab", False)
            plans += [(p.gate_up, swap, ("gate_up",)), (p.down, swap, ("down",))]
    print(f"{'plan (bm,bn,bk,gm,warps,stages)':<36} {'kernel':<8} regs  spill mma                    cvt16")
    for g, swap, kernels in plans:
        tiles = (g.block_m, g.block_n, g.block_k, g.group_m, g.num_warps, g.num_stages)
        name = f"{tiles}{' swap' if swap else ''}"
        if swap and not has_swap:
            print(f"{name:<36} not in these kernels")
            continue
        s = plan_stats(*tiles, swap, kernels=kernels)
        for kern in kernels:
            print(f"{name:<36} {kern:<8} {_fmt(s[kern])}", flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the report compiles for sm_90")
    main(sys.argv[1:])
