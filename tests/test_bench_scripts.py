"""Benchmark scripts that run on the CPU still run against the library as it is (a bench that reaches
into the P driver rots silently when the engine is redesigned), on tiny arguments."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_p_walk_host_bench_runs_and_prints_its_figures():
    res = subprocess.run([sys.executable, "benchmarks/p_walk_host_bench.py", "--layers", "4", "--epochs", "5",
                          "--forwards", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    fig = json.loads(res.stdout.strip().splitlines()[-1])
    assert fig["layers"] == 4 and fig["segments"] == 10 and fig["epochs"] == 5
    for k in ("p_enqueue_us_min", "p_epoch_us_min", "forward_walk_us_min"):
        assert fig[k] > 0, (k, fig)
    assert fig["p_epoch_us_min"] >= fig["p_enqueue_us_min"]


def test_p_epoch_host_bench_splits_a_continuation_on_the_cpu(tmp_path):
    """The engine side of ``p_epoch_host_bench`` (no profiler): each case's continuation split into
    pickup, P's device span and the tail, from the P stream's recorded intervals."""
    out = tmp_path / "p_epoch.json"
    res = subprocess.run([sys.executable, "benchmarks/p_epoch_host_bench.py", "--config", "configs/tiny-cpu.yaml",
                          "--no-profile", "--cases", "64:128,256:512", "--reps", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["cached"]) for r in rows] == [(64, 128), (256, 512)]
    for r in rows:
        assert r["epochs"] == 1 and r["epoch_wall_ms"] > 0
        assert r["pickup_ms"] >= 0 and r["tail_ms"] >= 0 and 0 < r["p_items_ms"] <= r["span_ms"] + 1e-6, r
        assert r["span_ms"] <= r["epoch_wall_ms"] + 1.0, r          # P's items run inside its epoch
        # the CPU device's launch call runs the item: its launch time covers the item's interval
        assert r["launch_ms"] >= 0.9 * r["p_items_ms"], r


def test_device_gaps_finds_the_idle_between_kernels_and_what_waited():
    from benchmarks.p_epoch_host_bench import device_gaps
    ks = [("gemm<a>", 0, 100), ("attn(x)", 150, 200), ("gemm<b>", 180, 260),     # overlap: no gap
          ("attn(y)", 300, 310), ("norm", 310, 320)]
    g = device_gaps(ks)
    assert g["span_ms"] == 0.32 and g["union_ms"] == 0.23 and g["gaps_ms"] == 0.09
    assert g["gaps_over_10us"] == 2 and g["gap_before"] == {"attn": 0.09}
    assert g["top_gaps"][0] == {"us": 50, "after": "gemm<a>", "before": "attn(x)"}
    assert g["top_gaps"][1] == {"us": 40, "after": "gemm<b>", "before": "attn(y)"}
    assert device_gaps([])["gaps_ms"] == 0.0
    # with the host's runtime calls: each top gap says which overlapped it most
    host = [("cudaStreamSynchronize", 95, 160), ("cudaLaunchKernel", 262, 268), ("cudaLaunchKernel", 270, 290)]
    h = device_gaps(ks, host=host)["top_gaps"]
    assert h[0]["host_us"] == {"cudaStreamSynchronize": 50} and h[1]["host_us"] == {"cudaLaunchKernel": 26}


def test_p_epoch_host_bench_fits_the_d_rows_to_the_kv_pool(tmp_path):
    """Beside D, the D rows' new tokens are capped so the rows and the largest case's epoch fit the
    pool (on an H100 32 x 6,144 tokens did not: no row decoded and the run failed)."""
    out = tmp_path / "p_epoch.json"
    res = subprocess.run([sys.executable, "benchmarks/p_epoch_host_bench.py", "--config", "configs/tiny-cpu.yaml",
                          "--no-profile", "--cases", "64:128", "--reps", "1", "--beside-d", "32", "--d-prompt", "64",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "capped at 1670 (asked 4032)" in res.stdout           # (0.85 * 4,096 x 16 - 192) // 32 - 64
    beside = json.loads(out.read_text())["beside_d"]
    assert beside["d_tokens"] == 1670 and beside["d_rows_ended_early"] == 0
    assert min(beside["rows"][0]["d_iters"]) > 0


@pytest.mark.parametrize("part", ["suffix", "mtp"])
def test_gate_spec_sections_run_on_the_cpu(tmp_path, part):
    """The GPU gate's speculation sections on the CPU. suffix: drafts verified and accepted on the
    trained small model, greedy tokens equal decoding without speculation, no KV block left. mtp:
    the fitted tiny glm4_moe MTP checkpoint, every D iteration on its path (eager here), drafts as
    the eager run's, tokens plain decoding's."""
    out = tmp_path / "spec.json"
    res = subprocess.run([sys.executable, "benchmarks/_gate_spec.py", "--json", str(out), "--device", "cpu",
                          "--part", part, "--trajectories", "2", "--tokens", "32"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    checks = json.loads(out.read_text())["checks"]
    want = {"suffix": {"spec_greedy_equals_plain", "spec_drafts_accepted", "spec_kv_leak_free"},
            "mtp": {"spec_mtp_decode_graphs", "spec_mtp_greedy_equals_plain", "spec_mtp_drafts_match_eager",
                    "spec_mtp_kv_leak_free"}}[part]
    assert set(checks) == want
    assert all(ok for ok, _ in checks.values()), checks


def test_fp8_accuracy_bench_teacher_forced_on_an_hf_model():
    res = subprocess.run([sys.executable, "benchmarks/fp8_accuracy_bench.py", "--arch", "mixtral", "--prompts", "2",
                          "--tokens", "6", "--prompt-len", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    fig = dict(kv.split("=", 1) for kv in next(ln for ln in res.stdout.splitlines() if ln.startswith("FIG")).split()[2:])
    assert fig["model"] == "mixtral" and fig["teacher_forced"] == "True"
    agree, tokens = float(fig["agreement"]), int(fig["tokens"])
    assert 0.0 <= agree <= 1.0 and tokens == round(agree * 12)       # agreeing positions of 2 x 6
    assert 0.0 <= float(fig["dlogprob_p50"]) <= float(fig["dlogprob_p99"]) <= float(fig["dlogprob_max"])


def test_sampler_host_bench_prints_its_three_rows():
    res = subprocess.run([sys.executable, "benchmarks/sampler_host_bench.py", "--device", "cpu", "--rows", "4",
                          "--history", "300", "--vocab", "1024", "--reps", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    figs = [dict(kv.split("=", 1) for kv in ln.split()[2:]) for ln in res.stdout.splitlines() if ln.startswith("FIG")]
    assert [(f["repetition_penalty"], f["pool"]) for f in figs] == [("1.0", "False"), ("1.05", "False"),
                                                                     ("1.05", "True")]
    assert all(float(f["host_ms"]) > 0 for f in figs)


def test_ratio_ci_is_the_t_interval_of_the_log_ratios():
    import math

    from benchmarks._ratio_ci import ratio_ci, ratio_ci_text
    assert ratio_ci([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    g, lo, hi = ratio_ci([1.1, 0.9])                          # 1 degree of freedom: t = 12.706
    half = 12.706 * abs(math.log(1.1) - math.log(0.9)) / math.sqrt(2) / math.sqrt(2)
    assert math.isclose(g, math.sqrt(1.1 * 0.9)) and math.isclose(math.log(hi) - math.log(g), half, rel_tol=1e-9)
    assert math.isclose(math.log(g) - math.log(lo), half, rel_tol=1e-9)
    g, lo, hi = ratio_ci([1.03] * 5 + [1.05] * 5)
    assert 1.03 < lo < g < hi < 1.05
    assert math.isnan(ratio_ci([1.2])[1])
    assert ratio_ci_text([1.0, 1.0]) == "paired_geomean=1.000 paired_ci95=1.000-1.000"
    with pytest.raises(ValueError):
        ratio_ci([1.0, 0.0])


def test_fp8_speed_bench_fits_a_layer_and_projects_the_whole_model():
    from benchmarks.fp8_speed_bench import fit_rows
    t = {"bf16": {16: {64: 10.0}, 32: {64: 18.0}}, "fp8": {16: {64: 7.0}, 32: {64: 12.0}}}
    r = fit_rows(t, 16, 32, 48)
    assert r["bf16_b64"]["ms_a_layer"] == 0.5 and r["bf16_b64"]["projected_ms_at_48"] == 26.0
    assert r["fp8_b64"]["projected_ms_at_48"] == 17.0
    assert r["fp8_b64"]["over_bf16_measured_32_layers"] == 1.5
    assert r["fp8_b64"]["over_bf16_projected_48_layers"] == round(26 / 17, 3)
    assert "over_bf16_measured_32_layers" not in r["bf16_b64"]


def test_grouped_mm_probe_path_equals_the_experts_by_hand():
    """The probe's grouped-GEMM path (sort, gather, two ``torch._grouped_mm``, put back) gives each pair's
    weighted expert output in pair order: summed per token, the experts computed one token at a time."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from grouped_mm_probe import grouped_parts

    from ainfer_pd.engine.model.moe import route
    torch.manual_seed(0)
    T, D, E, I, K = 24, 64, 8, 32, 2
    x = torch.randn(T, D).to(torch.bfloat16)
    w13 = (torch.randn(E, D, 2 * I) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, I, D) * 0.1).to(torch.bfloat16)
    r = route(x, (torch.randn(E, D) * 0.1).to(torch.bfloat16), K)
    steps, _, state = grouped_parts(x, r, w13, w2)
    for name in ("sort", "gather", "gate_up", "act", "down", "put_back"):
        steps[name]()
    out = state["rows"].float().view(T, K, D).sum(1)              # the engine's moe_sum, in torch
    ref = torch.zeros(T, D)
    for t in range(T):
        for j in range(K):
            e = int(r.topk_idx[t, j])
            h = x[t].float() @ w13[e].float()
            ref[t] += float(r.topk_weights[t, j]) * ((F.silu(h[:I]) * h[I:]) @ w2[e].float())
    assert (out - ref).abs().max() / ref.abs().max() < 2e-2


def test_spec_projection_of_a_ladder_run_shortens_its_d_work_by_the_interpolated_gain():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from spec_projection import best_gain, gain_at, project_run
    assert best_gain({1: 1.0, 2: 1.3, 4: 1.5}, {1: 1.6, 3: 2.4}) == (pytest.approx(1.6), 3)  # 2.4 / 1.5 beats 1.6 / 1.3
    assert best_gain({1: 1.0, 2: 1.9}, {1: 1.5}) == (1.0, 0)                       # nothing pays: plain decoding
    gains = {16: 1.5, 32: 1.7}
    assert gain_at(gains, 8) == 1.5 and gain_at(gains, 64) == 1.7 and abs(gain_at(gains, 24) - 1.6) < 1e-12
    p = project_run({"d_work_s": 30.0, "d_iter_mean_s": 0.03, "output_tokens": 24000, "makespan_s": 40.0}, gains)
    assert p["mean_batch"] == 24.0 and abs(p["projected_s"] - (40.0 - 30.0 * (1 - 1 / 1.6))) < 1e-9


def test_kv_pressure_reprefill_prints_both_policies_and_output_modes_on_the_cpu():
    res = subprocess.run([sys.executable, "benchmarks/kv_pressure_reprefill.py", "--blocks", "200", "--conversations",
                          "8", "--modes", "all,estimate", "--reserve", "256"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    figs = [dict(kv.split("=") for kv in line.split()[2:]) for line in res.stdout.splitlines()
            if line.startswith("FIG kv_pressure_reprefill")]
    assert [(f["mode"], f["policy"]) for f in figs] == [("all", "normal"), ("all", "fine-grained"),
                                                        ("estimate", "normal"), ("estimate", "fine-grained")]
    for f in figs:
        assert int(f["prefill_tokens"]) > 0 and f["failures"] == "0" and int(f["again_continuation"]) >= 0
    assert all(f["preemptions"] == "0" for f in figs[:2])


def test_host_sync_probe_counts_sync_warnings_by_thread_and_the_librarys_frames(capsys):
    import threading

    from benchmarks.host_sync_probe import SyncLog

    log = SyncLog(frames=2)

    def warn(msg):                      # as warnings.showwarning is called on the syncing thread
        log.show(UserWarning(msg), UserWarning, "x.py", 1)
    for _ in range(3):
        warn("called a synchronizing CUDA operation")
    t = threading.Thread(target=warn, args=("called a synchronizing CUDA operation",), name="Dlaunch_0")
    t.start()
    t.join()
    log.show(UserWarning("something else"), UserWarning, "x.py", 1)
    assert "warning: UserWarning: something else" in capsys.readouterr().out
    assert sum(log.by_stack.values()) == 4 and len(log.by_stack) == 2
    lines = log.report(top=5)
    assert lines[0] == "synchronizing calls: 4 in 2 places"
    assert any(ln.strip().startswith("3 x thread MainThread") for ln in lines)
    assert any("thread Dlaunch" in ln for ln in lines)


async def test_host_sync_probe_times_the_d_builds_of_a_run_and_puts_the_runner_back():
    from benchmarks.host_sync_probe import BuildTimer
    from ainfer_pd import RolloutWorker, SamplingParams
    from ainfer_pd.engine.loop import d_driver
    from ainfer_pd.engine.runtime.runner import ModelRunner
    from tests.conftest import tiny_cfg

    build, feed = ModelRunner.build, d_driver.feed_of
    timer = BuildTimer()
    with timer.installed():
        async with RolloutWorker(tiny_cfg(**{"scheduler.policy": "fine-grained"})) as w:
            out = await w.generate([5] * 12, SamplingParams(max_new_tokens=6, temperature=0.0))
            await w.release(out.trajectory_id)
    assert ModelRunner.build is build and d_driver.feed_of is feed
    assert len(timer.calls["build"]) >= 5 and len(timer.calls["feed_of"]) >= 4   # decode builds only
    lines = timer.report(top=5)
    assert lines[0].startswith(f"D build: {len(timer.calls['build'])} calls, p50")
    assert any("cumulative" in ln or "cumtime" in ln for ln in lines)


def test_gil_convoy_probe_prints_the_release_alone_and_beside_a_launching_thread():
    out = subprocess.run([sys.executable, "benchmarks/gil_convoy_probe.py", "--reps", "20"], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("alone: one GIL release p50") and len(lines) == 4
    assert all("beside a launching thread, switch interval" in ln for ln in lines[1:])


def test_host_path_profile_profiles_the_d_builds_and_bookings_of_a_tiny_run():
    """The script wraps ``runner.build`` and ``book.finish_decode``: the wrappers pass every argument
    on (the overlapped loop's ``ahead``, the device sample by keyword), so the run completes and the
    profile holds both."""
    res = subprocess.run([sys.executable, "benchmarks/host_path_profile.py", "--rows", "4", "--ctx", "32", "--tokens",
                          "6", "--top", "40"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "finish_decode" in res.stdout and "_decode_rows" in res.stdout, res.stdout[-2000:]
