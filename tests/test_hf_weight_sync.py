"""Weight sync in Hugging Face names: a perturbed transformers model's named_parameters(), the
checkpoint's own safetensors names, bucketed generators; one sync is all-or-nothing."""
import random

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.errors import WeightUpdateError
from tests import _hf_models
from tests.conftest import hf_worker_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(seed: int, n: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, _hf_models.VOCAB) for _ in range(rng.randrange(6, 30))] for _ in range(n)]


async def _greedy(w: RolloutWorker, prompts, n: int = 6) -> list[list[int]]:
    outs = []
    for p in prompts:
        o = await w.generate(p, SamplingParams(max_new_tokens=n, **GREEDY))
        outs.append(o.token_ids)
        await w.release(o.trajectory_id)
    return outs


def _buckets(named, size: int):
    """A generator over buckets of ``size`` tensors, flattened (as a trainer streams them)."""
    named = list(named)
    for i in range(0, len(named), size):
        yield from named[i:i + size]


def _trainer_tensors(model, arch: str):
    """What a transformers trainer sends: named_parameters(), plus glm's persistent router bias buffer."""
    out = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    if arch == "glm4_moe":
        out += [(n, b.clone()) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    return out


@pytest.mark.parametrize("name", _hf_models.ARCHS + ("qwen3_moe_tied",))
async def test_named_parameters_of_a_perturbed_transformers_model_sync_into_the_next_turn(name, hf_model_dir):
    path = hf_model_dir(name)
    prompts = _prompts(3)
    trainer = _hf_models.make(name, seed=0)                   # the checkpoint's weights ...
    _hf_models.randomize(trainer, seed=77)                    # ... then a training step moved every one
    want = [_hf_models.hf_greedy(trainer, p, 6)[0] for p in prompts]
    async with RolloutWorker(hf_worker_cfg(path)) as w:
        before = await _greedy(w, prompts)
        n = await w.update_weights(_buckets(_trainer_tensors(trainer, name), 7))
        assert n == len(w.last_weight_sync.applied) > 0
        after = await _greedy(w, prompts)
    assert after == want != before


async def test_checkpoint_names_from_safetensors_shards_sync_the_perturbed_model(hf_model_dir, tmp_path):
    from safetensors import safe_open
    path = hf_model_dir("qwen3_moe")
    trainer = _hf_models.make("qwen3_moe", seed=0)
    _hf_models.randomize(trainer, seed=5)
    ckpt = _hf_models.save(trainer, tmp_path / "step1")
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 1

    def stream():                                             # per-expert checkpoint names, shard by shard
        for f in shards:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)
    names = [k for k, _ in stream()]
    assert any(".mlp.experts.3.up_proj.weight" in k for k in names)
    prompts = _prompts(4)
    want = [_hf_models.hf_greedy(trainer, p, 6)[0] for p in prompts]
    async with RolloutWorker(hf_worker_cfg(path)) as w:
        await w.update_weights(stream())
        assert sorted(w.last_weight_sync.applied) == sorted(names)
        assert await _greedy(w, prompts) == want


async def test_a_bad_tensor_in_the_last_bucket_leaves_every_weight_unchanged(hf_model_dir):
    path = hf_model_dir("qwen3_moe")
    trainer = _hf_models.make("qwen3_moe", seed=0)
    _hf_models.randomize(trainer, seed=9)
    good = _trainer_tensors(trainer, "qwen3_moe")
    prompts = _prompts(6)
    async with RolloutWorker(hf_worker_cfg(path)) as w:
        snapshot = {n: p.clone() for n, p in w.model.named_parameters()}
        before = await _greedy(w, prompts)
        last = good[-1][0]
        cases = [
            (good[:-1] + [(last, good[-1][1][:-1])], f"{last}.*shape"),                        # wrong shape
            (good + [("model.layers.0.mlp.experts.9.up_proj.weight", good[0][1])], "unknown"),  # no expert 9
            (good[:-1], "incomplete.*" + last.replace(".", r"\.")),                          # a tensor missing
            (good[:-1] + [(last, torch.full_like(good[-1][1], float("nan")))], "non-finite"),
        ]
        for named, match in cases:
            with pytest.raises(WeightUpdateError, match=match):
                await w.update_weights(_buckets(named, 5))
            assert all(torch.equal(p, snapshot[n]) for n, p in w.model.named_parameters())
        # a packed transformers tensor and the same experts by checkpoint names: given twice
        per_expert = [("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(32, 64))]
        with pytest.raises(WeightUpdateError, match="already"):
            await w.update_weights(good + per_expert)
        assert all(torch.equal(p, snapshot[n]) for n, p in w.model.named_parameters())
        assert await _greedy(w, prompts) == before               # the worker serves on, unchanged
        # a partial sync of a subset is allowed when asked for
        q = [(n, t) for n, t in good if n.endswith("q_norm.weight")]
        assert await w.update_weights(q, partial=True) == len(q) == 3
