"""Printing, summarising and plotting the live-RL runs (per-step records from ``PolicyRun.step``)."""
from __future__ import annotations

import statistics
from pathlib import Path


def print_step(policy: str, r: dict) -> None:
    print(f"[{policy:>12}] step {r['step']:3d}  rollout {r['rollout_s']:6.3f}s (cum {r['cum_rollout_s']:7.2f}s)  "
          f"train {r['train_s']:5.2f}s  sync {r['sync_s']:5.3f}s  "
          f"reward {r['reward_mean']:.3f} (fmt {r['format_mean']:.3f} hit {r['hit_mean']:.3f})  "
          f"tokens {r['tokens_generated']:5d}  loss {r['loss']:+.4f}  |dlogp| {r['logprob_mismatch_max']:.1e}",
          flush=True)


def summarize(results: dict[str, dict], window: int) -> dict:
    out: dict = {}
    for pol, res in results.items():
        st = res["steps"]
        w = max(1, min(window, len(st) // 2 or 1))
        out[pol] = {
            "cum_rollout_s": res["cum_rollout_s"],
            "reward_first": statistics.fmean(s["reward_mean"] for s in st[:w]),
            "reward_last": statistics.fmean(s["reward_mean"] for s in st[-w:]),
            "format_first": statistics.fmean(s["format_mean"] for s in st[:w]),
            "format_last": statistics.fmean(s["format_mean"] for s in st[-w:]),
            "hit_first": statistics.fmean(s["hit_mean"] for s in st[:w]),
            "hit_last": statistics.fmean(s["hit_mean"] for s in st[-w:]),
            "window": w,
            "tokens_generated": sum(s["tokens_generated"] for s in st),
            "logprob_mismatch_max": max(s["logprob_mismatch_max"] for s in st),
            "logprob_mismatch_mean": statistics.fmean(s["logprob_mismatch_mean"] for s in st),
        }
    if "normal" in results and "fine-grained" in results:
        n, f = results["normal"]["cum_rollout_s"], results["fine-grained"]["cum_rollout_s"]
        out["fine_over_normal"] = f / n
        out["rollout_change_pct"] = 100.0 * (f - n) / n
        rn = [s["reward_mean"] for s in results["normal"]["steps"]]
        rf = [s["reward_mean"] for s in results["fine-grained"]["steps"]]
        out["same_rewards_both_policies"] = rn == rf
        out["first_divergent_step"] = next((i for i, (a, b) in enumerate(zip(rn, rf)) if a != b), None)
        pn = [s["rollout_s"] for s in results["normal"]["steps"]]
        pf = [s["rollout_s"] for s in results["fine-grained"]["steps"]]
        out["per_step_ratio_median"] = statistics.median(b / a for a, b in zip(pn, pf))
        out["per_step_rollout_median_s"] = {"normal": statistics.median(pn), "fine-grained": statistics.median(pf)}
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for pol, res in results.items():
        st = res["steps"]
        x = [s["step"] for s in st]
        ax[0].plot(x, [s["reward_mean"] for s in st], marker=".", label=pol)
        ax[1].plot(x, [s["rollout_s"] for s in st], marker=".", label=pol)
        cum, acc = [], 0.0
        for s in st:
            acc += s["rollout_s"]
            cum.append(acc)
        ax[2].plot(x, cum, label=f"{pol} ({acc:.1f} s)")
    ax[0].set(title="reward mean per step", xlabel="step", ylabel="reward")
    ax[1].set(title="rollout time per step", xlabel="step", ylabel="s")
    ax[2].set(title="cumulative rollout time", xlabel="step", ylabel="s")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(results: dict[str, dict], summ: dict) -> None:
    for pol in results:
        s = summ[pol]
        print(f"{pol:>12}: cumulative rollout {s['cum_rollout_s']:.2f} s over {len(results[pol]['steps'])} steps; "
              f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (first/last {s['window']} steps; "
              f"format {s['format_first']:.3f} -> {s['format_last']:.3f}, hit {s['hit_first']:.3f} -> {s['hit_last']:.3f})")
    if "fine_over_normal" in summ:
        print(f"fine-grained / normal cumulative rollout time: {summ['fine_over_normal']:.3f} "
              f"({summ['rollout_change_pct']:+.1f}%); identical rewards under both policies: "
              f"{summ['same_rewards_both_policies']} (first divergent step: {summ['first_divergent_step']}); "
              f"median per-step ratio {summ['per_step_ratio_median']:.3f}")
