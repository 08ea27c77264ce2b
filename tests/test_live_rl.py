"""Live-RL example (issue 6 item 2): differentiable forward == inference forward, 3 GRPO steps
against a running worker with weight sync, and the entry point's outputs."""
import json
import math
import random

import torch

from ainfer_pd.engine.model import build_model
from trainer_examples.live_rl.env import EnvConfig, Episode, Task, ToolEnv
from trainer_examples.live_rl.grpo import group_advantages, pack
from trainer_examples.live_rl.run import PolicyRun, main, parse_args
from trainer_examples.live_rl.train_forward import (forward_logits, inference_logits, make_trainable,
                                                    token_logprobs)

from .conftest import tiny_cfg

SMALL = ["--steps", "3", "--prompts", "2", "--group", "4", "--action-tokens", "4",
         "--max-turns", "3", "--prompt-filler", "4", "16", "--obs-filler", "1", "4",
         "--tool-latency-ms", "1", "5", "--lr", "3e-3"]


def test_train_forward_matches_inference_forward():
    model = build_model(tiny_cfg().model)
    rng = random.Random(0)
    seqs = [[rng.randrange(2, 512) for _ in range(n)] for n in (37, 20, 5)]
    L = max(map(len, seqs))
    tok = torch.zeros(len(seqs), L, dtype=torch.int64)            # right padded batch
    for i, s in enumerate(seqs):
        tok[i, :len(s)] = torch.tensor(s)
    train = make_trainable(model)
    got = forward_logits(train, tok)
    for i, s in enumerate(seqs):
        ref = inference_logits(model, s)                          # engine forward_batch, paged KV
        assert torch.allclose(got[i, :len(s)], ref, atol=1e-4, rtol=1e-4), (got[i, :len(s)] - ref).abs().max()
    # and it is differentiable down to the router and the routed experts
    token_logprobs(train, tok).sum().backward()
    lyr = train.layers[0]
    for p in (lyr.router, lyr.w13, lyr.w2, lyr.wqkv, train.embed, train.lm_head):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_env_reward_is_verifiable():
    env = ToolEnv(EnvConfig())
    task = Task(prompt_id=0, key=70, num_turns=2, prompt_ids=[2, 3, 70])
    r0 = env.call_tool(task, 0, [100, 65, 300])                    # lookup(65)
    assert r0 == env.table[65]
    ep = Episode(task=task, actions=[[65, 300], [r0, 66]], results=[r0, 0])
    env.score(ep)
    assert ep.format_score == 0.75 and ep.hit_score == 1.0 and ep.reward == 0.875
    assert [round(a, 4) for a in group_advantages([1.0, 0.0, 0.5, 0.5], 2)] == [1.0, -1.0, 0.0, 0.0]


async def test_three_grpo_steps_sync_weights_into_the_worker():
    args = parse_args(SMALL + ["--policy", "fine-grained"])
    async with PolicyRun("fine-grained", args) as run:
        initial = {n: p.detach().clone() for n, p in run.worker.model.named_parameters()}
        for step in range(3):
            rec = await run.step(step)
            # the worker now holds exactly the trainer's weights
            for (n, p), (n2, q) in zip(run.trainable.named_parameters(), run.worker.model.named_parameters()):
                assert n == n2 and torch.equal(p.detach(), q), n
            # the rollout logprobs (continuation prefill + decode, paged KV) are the trainer's
            # differentiable forward on the same tokens and weights: the sync is exact
            assert rec["logprob_mismatch_max"] < 1e-3
            assert rec["rollout_s"] > 0 and rec["tokens_generated"] > 0
            assert 0.0 <= rec["reward_mean"] <= 1.0 and math.isfinite(rec["loss"])
            assert rec["cached_tokens"] > 0                     # continue_ reused the trajectory's KV
        changed = [n for n, p in run.worker.model.named_parameters() if not torch.equal(p, initial[n])]
        assert len(changed) == len(initial)                     # Adam moved every parameter
        res = run.result()
        assert res["kv_leak_free"] and res["worker"]["failures"] == 0
        assert len(res["steps"]) == 3 and res["cum_rollout_s"] > 0


def test_pack_aligns_actions_with_their_logprobs():
    ep = Episode(task=Task(0, 64, 1, [2, 3]), tokens=[2, 3, 10, 11, 4], action_mask=[False, False, True, True, False],
                 old_logprobs=[0.0, 0.0, -1.0, -2.0, 0.0])
    tok, mask, old = pack([ep])
    assert mask[0].tolist() == [False, True, True, False]       # position t scores token t+1
    assert old[0, mask[0]].tolist() == [-1.0, -2.0]


def test_entry_point_writes_json_and_plot(tmp_path):
    out = tmp_path / "run"
    assert main(SMALL[:1] + ["1"] + SMALL[2:] + ["--policy", "both", "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "live_rl.json").read_text())
    assert set(doc["results"]) == {"normal", "fine-grained"}
    assert doc["summary"]["fine_over_normal"] > 0
    assert doc["summary"]["same_rewards_both_policies"] is True  # same seeds -> same rollouts under both policies
    assert (out / "live_rl.png").stat().st_size > 0
