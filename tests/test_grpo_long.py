"""The GRPO long-context agentic workload (issue 33 item 4): the retained-context fit up to the
paper's p99, siblings that share their prompt ids and diverge after, determinism, truncation and
scaling, the CLI building it, and a tiny CPU replay of it."""
import argparse
import subprocess
import sys

import numpy as np
import pytest

from ainfer_pd.tools.cli import build_parser
from ainfer_pd.tools.options import build_trace, load_config
from ainfer_pd.errors import InvalidRequestError
from ainfer_pd.tools.replay import conversation_token_ids, turn_params
from ainfer_pd.tools.trace import (CONTEXT_KNOTS, PAPER_PERCENTILES, Trace, check_percentiles,
                                      grpo_agentic_trace, grpo_percentile_targets)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retained_context_follows_the_paper_up_to_its_p99(seed):
    t = grpo_agentic_trace(seed=seed)                       # 8 groups x 8 siblings, 2-6 turns
    s = t.summary()
    assert s["conversations"] == 64 and t.samples_per_prompt == 8
    assert 2 <= min(c.num_turns for c in t.conversations) and s["max_turns"] <= 6
    for key, rtol in (("retained_context", 0.03), ("gen_tokens", 0.06), ("tool_wait_s", 0.06)):
        for got, want, ok in check_percentiles(t, rtol=rtol, targets=grpo_percentile_targets(), keys=[key])[key]:
            assert ok, (key, got, want)
    ctx = t.arrays()["retained_context"][t.arrays()["turn"] > 0]
    assert ctx.max() >= 12_500                              # the long tail is there
    assert s["max_context"] <= 16_384                       # and fits a 16K model
    assert t.percentiles()["retained_context"][0] == pytest.approx(PAPER_PERCENTILES["retained_context"][0], rel=0.03)


def test_siblings_share_their_prompt_ids_and_diverge_after():
    t = grpo_agentic_trace(3, 4, 5, seed=7)
    assert [c.conv_id for c in t.conversations] == list(range(12))
    ids = [conversation_token_ids(t, i, seed=0, vocab_size=1000) for i in range(12)]
    for g in range(3):
        convs = t.conversations[4 * g:4 * g + 4]
        group = ids[4 * g:4 * g + 4]
        assert len({c.turns[0].new_tokens for c in convs}) == 1
        assert all(m[0] == group[0][0] for m in group)                          # one prompt, same ids
        assert len({tuple(c.turns) for c in convs}) == 4                        # each its own turns
        assert len({c.turns[0].gen_tokens for c in convs}) > 1                   # own first generation
        later = [tuple(m[1]) for m, c in zip(group, convs) if c.num_turns > 1]
        assert len(set(later)) == len(later)                                     # own observations
        waits = [c.turns[1].tool_wait_s for c in convs if c.num_turns > 1]
        assert len(set(waits)) == len(waits)                                     # own tool waits
    assert ids[0][0] != ids[4][0]
    seeds = {turn_params(t, i, 0, 8, seed=0).seed for i in range(4)}
    assert len(seeds) == 4                                  # seeded sampling of its own: tokens diverge


def test_seeded_and_deterministic():
    a, b, c = grpo_agentic_trace(seed=3), grpo_agentic_trace(seed=3), grpo_agentic_trace(seed=4)
    assert [x.turns for x in a.conversations] == [x.turns for x in b.conversations]
    assert [x.turns for x in a.conversations] != [x.turns for x in c.conversations]
    assert a.meta == b.meta and a.meta["kind"] == "grpo-long"


def test_token_scale_max_context_and_waits():
    full = grpo_agentic_trace(4, 4, 6, seed=1)
    tiny = grpo_agentic_trace(4, 4, 6, seed=1, token_scale=0.02, wait_scale=0.5)
    assert tiny.samples_per_prompt == 4 and tiny.meta["token_scale"] == 0.02
    for f, s in zip(full.conversations, tiny.conversations):
        assert [max(1, round(x.new_tokens * 0.02)) for x in f.turns] == [x.new_tokens for x in s.turns]
        assert [x.tool_wait_s * 0.5 for x in f.turns] == pytest.approx([x.tool_wait_s for x in s.turns])
    lo = grpo_percentile_targets(0.02)["retained_context"]
    assert lo == pytest.approx(tuple(x * 0.02 for x in PAPER_PERCENTILES["retained_context"]))
    # truncated to a smaller model: every sibling fits, the group keeps one prompt length
    cut = grpo_agentic_trace(4, 4, 6, seed=1, max_context=6000)
    for g in range(4):
        members = cut.conversations[4 * g:4 * g + 4]
        assert len({c.turns[0].new_tokens for c in members}) == 1
        assert all(c.total_context <= 6000 and c.num_turns >= 1 for c in members)
    small = grpo_agentic_trace(2, 3, 3, seed=0, max_context=64)     # even the prompt shrinks, alike
    for g in range(2):
        assert len({c.turns[0].new_tokens for c in small.conversations[3 * g:3 * g + 3]}) == 1
    assert all(c.total_context <= 64 for c in small.conversations)
    # cells scale the waits as for the paper trace
    assert all(w == 0 for ws in full.waits("P1") for w in ws)
    w3 = full.waits("P3")
    assert w3[0][1:] == pytest.approx([x.tool_wait_s * 0.03 for x in full.conversations[0].turns[1:]])
    with pytest.raises(InvalidRequestError):
        grpo_agentic_trace(0, 8)
    with pytest.raises(InvalidRequestError):
        grpo_agentic_trace(2, 2, 3, min_turns=4)
    with pytest.raises(InvalidRequestError):
        grpo_agentic_trace(2, 2, context_limit=int(CONTEXT_KNOTS[-1][1]))


def test_jsonl_round_trip_keeps_the_groups(tmp_path):
    t = grpo_agentic_trace(2, 3, 4, seed=2, token_scale=0.1)
    t.save_jsonl(tmp_path / "g.jsonl")
    back = Trace.load_jsonl(tmp_path / "g.jsonl")
    assert back.samples_per_prompt == 3 and [c.turns for c in back.conversations] == [c.turns for c in t.conversations]


def _args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_the_cli_builds_it():
    cfg = load_config("configs/tiny-cpu.yaml")
    t = build_trace(_args("--workload", "grpo-long", "--token-scale", "1", "--max-context", "16384"), cfg)
    assert t.meta["kind"] == "grpo-long" and len(t.conversations) == 64 and t.samples_per_prompt == 8
    assert [c.turns for c in t.conversations] == [c.turns for c in grpo_agentic_trace().conversations]
    t = build_trace(_args("--workload", "grpo-long", "--group-size", "4", "--conversations", "10",
                          "--max-turns", "3", "--token-scale", "0.05", "--seed", "5"), cfg)
    assert len(t.conversations) == 12 and t.samples_per_prompt == 4                  # whole groups
    assert max(c.num_turns for c in t.conversations) <= 3 and t.meta["seed"] == 5
    assert t.max_context() <= cfg.model.max_context_len
    # --samples-per-prompt names the group size too; a disagreement is refused
    t = build_trace(_args("--workload", "grpo-long", "--samples-per-prompt", "2", "--conversations", "4"), cfg)
    assert t.samples_per_prompt == 2 and len(t.conversations) == 4
    with pytest.raises(InvalidRequestError):
        build_trace(_args("--workload", "grpo-long", "--samples-per-prompt", "2", "--group-size", "4"), cfg)
    assert isinstance(_args("--workload", "grpo-long", "--cells", "P1,trace"), argparse.Namespace)


def test_a_tiny_cpu_replay_of_it_through_the_cli(tmp_path):
    """``ainfer-pd replay --workload grpo-long`` at a tiny size on the tiny CPU model: every request
    completes, siblings reuse their shared prompt's KV, outputs agree across the two policies."""
    import json
    out = tmp_path / "r"
    cmd = [sys.executable, "-m", "ainfer_pd.tools.cli", "replay", "--workload", "grpo-long", "--group-size", "2",
           "--conversations", "4", "--max-turns", "3", "--token-scale", "0.02", "--time-scale", "0.01",
           "--cell", "trace", "--policies", "normal,fine-grained", "--priorities", "fifo", "--no-progress",
           "--out", str(out), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "workload: 4 conversations" in res.stderr
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert not any(data["output_mismatches"].get("trace", {}).values())
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert {r["variant"] for r in runs} == {"normal", "fine-grained"}
    for r in runs:
        assert r["summary"]["failures"] == 0 and r["planned_requests"] == len(r["records"])
        first = [x for x in r["records"] if x["turn"] == 0]
        assert len(first) == 4 and any(x["num_cached_tokens"] > 0 for x in first)   # a sibling's prompt reused
