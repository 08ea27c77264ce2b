"""Routing replay (issue 15, verl's R3): ``SamplingParams(return_routed_experts=True)`` returns, for
every token a forward pass fed, every MoE layer's top-k expert ids; they equal the router's top-k
of one full recompute of the whole sequence - transformers' own router (hooks on its gates), and
the torch reference forward of this engine's tiny model - across multi-turn KV reuse, GRPO
siblings sharing a prefix, aborted turns and every policy. Off by default: nothing allocated."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import InvalidRequestError
from tests import _hf_models
from tests.conftest import hf_worker_cfg, rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True, return_routed_experts=True)


class _Recorder:
    """A routing sink for the reference forward: layer -> the top-k ids of every token."""

    def __init__(self) -> None:
        self.ids: dict[int, torch.Tensor] = {}

    def record(self, layer: int, slots: torch.Tensor, topk_idx: torch.Tensor) -> None:
        self.ids[layer] = topk_idx.clone()


def reference_routing(model, cfg, seq: list[int]) -> torch.Tensor:
    """[len(seq), moe_layers, top_k]: one forward of the whole sequence on a fresh cache."""
    mc = cfg.model
    T = len(seq)
    kv = torch.zeros(mc.num_layers, 2, T, mc.num_kv_heads, mc.head_dim)
    slots = torch.arange(T)
    fb = ForwardBatch(torch.tensor(seq), torch.arange(T), slots, [PrefillSeq(0, T, T, slots)], None,
                      torch.tensor([T - 1]))
    rec = _Recorder()
    model.routing_sink = rec
    try:
        with torch.inference_mode():
            model.forward_batch(fb, kv)
    finally:
        model.routing_sink = None
    layers = [i for i in range(mc.num_layers) if mc.is_moe_layer(i)]
    return torch.stack([rec.ids[i] for i in layers], dim=1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal top-k sets per token and layer (the order within k is the router's sort, not a choice)."""
    return a.shape == b.shape and torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


@pytest.mark.parametrize("policy", ["normal", "fine-grained", "mixed-chunked"])
async def test_routed_experts_equal_a_full_recompute_across_turns_siblings_and_aborts(policy):
    cfg = tiny_cfg(**{"scheduler.policy": policy, "cache.routed_experts": True})
    model = build_model(cfg.model)
    rng = random.Random(31)
    prompt = rand_ids(rng, 75)
    checks: list[tuple[list[int], object]] = []
    async with RolloutWorker(cfg) as w:
        # GRPO siblings: one prefills the prompt, the others share its blocks (and their routing)
        sib = await asyncio.gather(*[w.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=i,
                                                                      ignore_eos=True, return_routed_experts=True))
                                     for i in range(4)])
        assert sum(o.num_cached_tokens > 0 for o in sib) == 3
        checks += [(prompt + o.token_ids, o) for o in sib]
        # the next turn of one sibling reuses its own KV; a new request id for that context too
        a = sib[0]
        obs = rand_ids(rng, 9)
        b = await w.continue_(a.trajectory_id, obs, SamplingParams(max_new_tokens=5, **GREEDY))
        ctx = prompt + a.token_ids + obs
        assert b.num_cached_tokens == len(prompt) + len(a.token_ids) - 1
        checks.append((ctx + b.token_ids, b))
        c = await w.generate(ctx, SamplingParams(max_new_tokens=5, **GREEDY))
        assert c.num_cached_tokens == len(ctx) - 1
        checks.append((ctx + c.token_ids, c))
        # an aborted turn returns the rows its completed passes computed
        task = asyncio.ensure_future(w.generate(rand_ids(rng, 40), SamplingParams(max_new_tokens=200, **GREEDY),
                                                trajectory_id="ab"))
        while "ab" not in w.trajectories or len(w.trajectories["ab"].turn.out_tokens if w.trajectories["ab"].turn
                                                    else []) < 3:
            await asyncio.sleep(0.002)
        await w.abort("ab")
        d = await task
        assert d.finish_reason == "abort" and 3 <= len(d.token_ids) < 200
        assert d.routed_experts.shape[0] == d.num_prompt_tokens + len(d.token_ids) - 1
        checks.append((w.trajectories["ab"].tokens, d))
        off = await w.generate(prompt, SamplingParams(max_new_tokens=3, temperature=0.0))
        assert off.routed_experts is None                       # not asked for
        for tid in list(w.trajectories):
            await w.release(tid)
        assert w.kv_leak_free()
    moe = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    for seq, o in checks:
        re = o.routed_experts
        assert re.dtype == torch.int16 and re.shape == (len(seq) - 1, moe, cfg.model.top_k), re.shape
        ref = reference_routing(model, cfg, seq)[:len(seq) - 1]
        assert _same(re, ref), (o.trajectory_id, (re.long() != ref.long()).nonzero()[:4])


async def test_routed_experts_need_the_config_and_are_absent_by_default():
    cfg = tiny_cfg()
    async with RolloutWorker(cfg) as w:
        assert w.engine.runner.routed is None and w.engine.runner.model.routing_sink is None
        with pytest.raises(InvalidRequestError, match="cache.routed_experts"):
            await w.generate([5, 6, 7], SamplingParams(max_new_tokens=2, return_routed_experts=True))
        assert not w.trajectories                                 # nothing registered
        out = await w.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
        assert out.routed_experts is None
        await w.release(out.trajectory_id)
    with pytest.raises(InvalidRequestError):
        SamplingParams(return_routed_experts=1)


class _HFGates:
    """transformers' router choices: forward hooks on every MoE layer's gate."""

    def __init__(self, model, name: str) -> None:
        self.ids: list[torch.Tensor] = []
        self.handles = []
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "weight") or gate.weight.shape[0] == 1:
                continue            # a dense MLP (its gate_proj is a projection, not a router)
            if name == "glm4_moe":  # the router returns logits; the MoE block chooses (bias, groups)
                mlp = layer.mlp
                self.handles.append(gate.register_forward_hook(
                    lambda m, i, o, mlp=mlp: self.ids.append(mlp.route_tokens_to_experts(o)[0])))
            else:
                self.handles.append(gate.register_forward_hook(lambda m, i, o: self.ids.append(o[2])))

    def __call__(self, model, seq: list[int]) -> torch.Tensor:
        self.ids.clear()
        with torch.no_grad():
            model(torch.tensor([seq]))
        return torch.stack([x.reshape(len(seq), -1) for x in self.ids], dim=1)


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe"])
async def test_routed_experts_equal_transformers_router_topk(name, hf_model_dir):
    """qwen3_moe (softmax top-k, a dense layer in the middle) and glm4_moe (sigmoid router with the
    correction bias, group-limited choice, first layer dense): two turns (the second reuses the
    first's KV); the rows equal transformers' gates over the whole sequence."""
    from transformers import AutoModelForCausalLM
    path = hf_model_dir(name)
    cfg = hf_worker_cfg(path, "fine-grained", cache={"routed_experts": True})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gates = _HFGates(hf, name)
    rng = random.Random(32)
    prompt = [rng.randrange(2, _hf_models.VOCAB) for _ in range(37)]
    async with RolloutWorker(cfg) as w:
        a = await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        obs = [rng.randrange(2, _hf_models.VOCAB) for _ in range(5)]
        b = await w.continue_(a.trajectory_id, obs, SamplingParams(max_new_tokens=6, **GREEDY))
        assert b.num_cached_tokens > 0
        await w.release(a.trajectory_id)
    moe = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers))
    assert moe < cfg.model.num_layers                     # a dense layer is left out
    for seq, o in ((prompt + a.token_ids, a), (prompt + a.token_ids + obs + b.token_ids, b)):
        ref = gates(hf, seq)[:len(seq) - 1]
        assert ref.shape == (len(seq) - 1, moe, cfg.model.top_k)
        assert _same(o.routed_experts, ref), (name, (o.routed_experts.long().sort(-1).values
                                                     != ref.long().sort(-1).values).nonzero()[:4])
