"""FP8 KV cache scales (``cache.kv_scales``): from the checkpoint (every name family vLLM reads), from
a weight sync, or calibrated (``RolloutWorker.calibrate_kv_scales``, an amax pass).

* the config key and its typed errors;
* a tiny Hugging Face checkpoint carrying scales in each name family loads them into
  ``model.kv_scales``; ``unit`` ignores them, a model-dtype pool ignores them (never unexpected);
* a malformed scale (not a positive finite scalar), K without V, a missing layer, ``checkpoint``
  without scales: a CheckpointError naming the tensor;
* calibration: scales = amax * margin / 448 with the amax taken independently from transformers'
  own KV cache (post-RoPE keys, values); refused while a turn is in flight or on a model-dtype pool;
  cached KV is dropped; on a model whose V exceeds 448 the calibrated pool reconstructs K / V and
  the logits far better than scale 1.0;
* a weight sync writes scales in place, all-or-nothing with the rest; a model-dtype pool ignores them.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import types

import pytest
import torch
from safetensors.torch import save_file

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
from ainfer_pd.engine.attention.kv_fp8 import FP8_MAX
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.model.weights import WeightStage
from ainfer_pd.engine.runtime.kv_calibration import calibrate_kv_scales
from ainfer_pd.engine.runtime.runner import ModelRunner
from ainfer_pd.engine.runtime.runner_sections import RunnerSections
from ainfer_pd.errors import (CheckpointError, ConfigError, InvalidRequestError, TrajectoryBusyError,
                              UnsupportedOptionError, WeightUpdateError)
from ainfer_pd.phase import Phase, PhaseContext
from tests import _hf_models
from tests.conftest import hf_worker_cfg, rand_ids, tiny_cfg

CPU = torch.device("cpu")
FP8_KV = {"kv_dtype": "fp8_e4m3"}
L = 3                                               # layers of the tiny qwen3_moe
K = [0.021, 0.5, 3.25]                              # per-layer scales: distinct, so a misplaced one shows
V = [0.75, 0.043, 1.5]
P = "model.layers.{i}.self_attn."
FAMILIES = {                                        # name family -> (K leaf, V leaf, scalar shape)
    "self_attn": ("k_scale", "v_scale", ()),
    "attn": ("attn.k_scale", "attn.v_scale", (1,)),
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale", ()),
    "output_scale": ("k_proj.output_scale", "v_proj.output_scale", (1,)),
}
PROMPTS = [[3, 17, 200, 45, 9, 77, 120, 5, 61, 8, 8, 30], list(range(40, 77)), [250, 2, 2, 131, 99, 14, 7]]


def _scales(family: str, layers=range(L)) -> dict[str, torch.Tensor]:
    kl, vl, shape = FAMILIES[family]
    out = {}
    for i in layers:
        out[P.format(i=i) + kl] = torch.full(shape, K[i])
        out[P.format(i=i) + vl] = torch.full(shape, V[i])
    return out


def _with_tensors(src, dst, tensors: dict[str, torch.Tensor]):
    """A copy of the checkpoint ``src`` with ``tensors`` in a shard of their own, in the index."""
    shutil.copytree(src, dst)
    idx = dst / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    if tensors:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "kv-scales.safetensors"))
        data["weight_map"].update({n: "kv-scales.safetensors" for n in tensors})
    idx.write_text(json.dumps(data))
    return dst


def _runner(path, **cache) -> ModelRunner:
    return ModelRunner(RunnerSections.from_config(hf_worker_cfg(path, cache=cache)), CPU, KVCacheManager(16, 16))


def _expected() -> torch.Tensor:
    return torch.tensor([K, V], dtype=torch.float32).T


# ---------------------------------------------------------------------------- config
def test_kv_scales_config_and_typed_errors():
    assert tiny_cfg().cache.kv_scales == "auto"
    for mode in ("auto", "unit", "checkpoint"):
        assert tiny_cfg(**{"cache.kv_dtype": "fp8_e4m3", "cache.kv_scales": mode}).cache.kv_scales == mode
    for bad in ("calibrated", "1.0", ""):
        with pytest.raises(UnsupportedOptionError) as e:
            tiny_cfg(**{"cache.kv_dtype": "fp8_e4m3", "cache.kv_scales": bad})
        assert e.value.key == "cache.kv_scales" and "cache.kv_scales" in str(e.value)
    with pytest.raises(UnsupportedOptionError, match="kv_dtype") as e:        # checkpoint scales on a bf16 pool
        tiny_cfg(**{"cache.kv_scales": "checkpoint"})
    assert e.value.key == "cache.kv_scales"
    with pytest.raises(ConfigError, match="cache.kv_scales"):
        WorkerConfig.from_dict({"cache": {"kv_dtype": "fp8_e4m3", "kv_scales": "amax"}})


# ---------------------------------------------------------------------------- checkpoint scales
@pytest.mark.parametrize("family", [*FAMILIES, "kv_scale"])
def test_checkpoint_scales_of_every_name_family_load(hf_model_dir, tmp_path, family):
    if family == "kv_scale":                        # one scale for both K and V
        tensors = {P.format(i=i) + "kv_scale": torch.tensor(K[i]) for i in range(L)}
        want = torch.tensor([K, K], dtype=torch.float32).T
    else:
        tensors, want = _scales(family), _expected()
    d = _with_tensors(hf_model_dir("qwen3_moe"), tmp_path / family, tensors)
    for mode in ("auto", "checkpoint"):
        r = _runner(d, kv_scales=mode, **FP8_KV)
        assert torch.equal(r.model.kv_scales, want), (mode, r.model.kv_scales)
        assert set(tensors) <= set(r.model.load_report.tensors_read)
    assert torch.equal(_runner(d, kv_scales="unit", **FP8_KV).model.kv_scales, torch.ones(L, 2))
    bf16_pool = _runner(d)                          # kv_dtype auto: the scales are known names, ignored
    assert bf16_pool.model.kv_scales is None and bf16_pool.kv_cache.dtype == torch.float32
    assert not set(tensors) & set(bf16_pool.model.load_report.tensors_read)


@pytest.mark.parametrize("value,match", [
    (torch.tensor(-0.5), "positive"), (torch.tensor(0.0), "positive"), (torch.tensor(float("inf")), "finite"),
    (torch.tensor(float("nan")), "finite"), (torch.tensor([0.5, 0.5]), "shape"),
    (torch.tensor(3, dtype=torch.int32), "dtype"),
])
def test_a_malformed_checkpoint_scale_is_a_checkpoint_error_naming_it(hf_model_dir, tmp_path, value, match):
    tensors = _scales("self_attn")
    bad = P.format(i=1) + "v_scale"
    tensors[bad] = value
    d = _with_tensors(hf_model_dir("qwen3_moe"), tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=match) as e:
        _runner(d, **FP8_KV)
    assert bad in str(e.value)


def test_k_without_v_missing_layers_and_checkpoint_mode_without_scales_are_typed_errors(hf_model_dir, tmp_path):
    src = hf_model_dir("qwen3_moe")
    alone = _scales("modelopt")
    del alone[P.format(i=2) + "v_proj.v_scale"]
    d = _with_tensors(src, tmp_path / "k-alone", alone)
    with pytest.raises(CheckpointError, match="both or neither") as e:
        _runner(d, **FP8_KV)
    assert P.format(i=2) + "k_proj.k_scale" in str(e.value)
    d = _with_tensors(src, tmp_path / "two-layers", _scales("self_attn", layers=(0, 1)))
    for mode in ("auto", "checkpoint"):              # some layers only: never 1.0 for the rest silently
        with pytest.raises(CheckpointError, match=P.format(i=2) + "k_scale"):
            _runner(d, kv_scales=mode, **FP8_KV)
    with pytest.raises(CheckpointError, match=P.format(i=0) + "k_scale"):
        _runner(src, kv_scales="checkpoint", **FP8_KV)
    assert torch.equal(_runner(src, kv_scales="auto", **FP8_KV).model.kv_scales, torch.ones(L, 2))
    twice = {**_scales("self_attn"), P.format(i=0) + "attn.k_scale": torch.tensor(1.0)}
    with pytest.raises(CheckpointError, match="already scales"):
        _runner(_with_tensors(src, tmp_path / "twice", twice), **FP8_KV)


def test_every_expert_and_attention_shard_takes_the_same_scales(hf_model_dir, tmp_path):
    """Expert-parallel ranks (half the experts each) and attention-TP ranks (half the KV heads) take
    the same per-layer scales, from the checkpoint and from a sync (no rank skips them as another's)."""
    from ainfer_pd.engine.model.model import build_model
    from ainfer_pd.engine.runtime.tensor_parallel import shard_attention_
    from ainfer_pd.hf.kv_scales import kv_scales_for
    d = _with_tensors(hf_model_dir("qwen3_moe"), tmp_path / "ep", _scales("modelopt"))
    cfg = hf_worker_cfg(d, cache=FP8_KV)
    synced = {n: t * 2 for n, t in _scales("self_attn").items()}
    for shard in ((0, 4), (4, 8), "tp0", "tp1"):
        m = build_model(cfg.model, experts=shard if isinstance(shard, tuple) else None)
        if isinstance(shard, str):
            shard_attention_(m, int(shard[-1]), 2)
        m.kv_scales = kv_scales_for(m, cfg.cache, CPU)
        assert torch.equal(m.kv_scales, _expected()), shard
        stage = WeightStage(m, partial=True).add_all(synced)
        assert stage.apply() == 2 * L and torch.equal(m.kv_scales, _expected() * 2), shard


# ---------------------------------------------------------------------------- calibration
def _hf_amax(path, prompts) -> torch.Tensor:
    """[L, 2] largest |K| (post-RoPE) and |V| that transformers' own forward puts in its KV cache."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    amax = torch.zeros(m.config.num_hidden_layers, 2)
    with torch.no_grad():
        for p in prompts:
            cache = m(torch.tensor([p]), use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                amax[i] = torch.maximum(amax[i], torch.stack([layer.keys.abs().max(), layer.values.abs().max()]))
    return amax


async def test_calibration_sets_scales_from_the_kv_amax_and_drops_cached_kv(hf_model_dir):
    """Against transformers' KV cache of the same prompts (prefill chunked at 16 tokens here);
    the scales land in the pool's tensor in place; an idle trajectory's KV is not reused after."""
    d = hf_model_dir("qwen3_moe")
    want = _hf_amax(d, PROMPTS) * 1.5 / FP8_MAX
    cfg = hf_worker_cfg(d, cache=FP8_KV, scheduler={"max_prefill_tokens": 16})
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        ks = w.model.kv_scales
        a = await w.generate(PROMPTS[1], sp)
        got = await w.calibrate_kv_scales(PROMPTS, margin=1.5)
        assert w.model.kv_scales is ks and torch.equal(ks, got)
        assert torch.allclose(got, want, rtol=1e-4, atol=0), (got, want)
        c = await w.continue_(a.trajectory_id, [5, 6], sp)
        assert c.num_cached_tokens == 0              # its KV was stored under scale 1.0: recomputed
        await w.release(a.trajectory_id)
        assert w.kv_leak_free() and w.engine.kv.num_free_blocks == w.engine.kv.alloc.num_blocks


async def test_calibration_is_refused_in_flight_on_a_model_dtype_pool_and_for_bad_input():
    rng_prompt = list(range(2, 42))
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128})) as w:      # kv_dtype auto
        with pytest.raises(UnsupportedOptionError) as e:
            await w.calibrate_kv_scales([rng_prompt])
        assert e.value.key == "cache.kv_dtype"
    async with RolloutWorker(tiny_cfg(**{"cache.num_blocks": 128, "cache.kv_dtype": "fp8_e4m3"})) as w:
        for prompts, margin in (([], 1.25), ([[]], 1.25), ([rng_prompt], 0.0), ([rng_prompt], float("nan")),
                                ([[10 ** 9]], 1.25)):
            with pytest.raises(InvalidRequestError):
                await w.calibrate_kv_scales(prompts, margin)
        turn = asyncio.create_task(w.generate(rng_prompt, SamplingParams(max_new_tokens=64, temperature=0.0,
                                                                         ignore_eos=True), trajectory_id="busy"))
        await asyncio.sleep(0)                       # submitted: its turn is in flight
        with pytest.raises(TrajectoryBusyError, match="busy"):
            await w.calibrate_kv_scales([rng_prompt])
        assert torch.equal(w.model.kv_scales, torch.ones(w.cfg.model.num_layers, 2))     # nothing changed
        out = await turn
        assert len(out.token_ids) == 64
        scales = await w.calibrate_kv_scales([rng_prompt])          # idle now: allowed
        assert not torch.equal(scales, torch.ones_like(scales))
        await w.release("busy")
        assert w.kv_leak_free()


def _scaled_v_checkpoint(root, factor: float = 300.0):
    """The tiny qwen3_moe with every v_proj scaled by ``factor``: |V| well past 448."""
    m = _hf_models.make("qwen3_moe")
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.v_proj.weight.mul_(factor)
    return _hf_models.save(m, root / "big-v")


def _prefill(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    fb = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                      [PrefillSeq(0, n, n, block_ids=torch.arange(4))], None, torch.arange(n), block_size=16)
    with torch.inference_mode():
        return runner.forward_fb(fb, PhaseContext(Phase.PREFILL, None))


def _stored(runner: ModelRunner, n: int) -> torch.Tensor:
    """The pool's first n slots as float32 [L, 2, n, Hk, hd] (an FP8 pool dequantized)."""
    kv = runner.kv_cache[:, :, :n]
    if runner.model.kv_scales is None:
        return kv.float()
    return kv.float() * runner.model.kv_scales.view(-1, 2, 1, 1, 1)


def test_calibrated_scales_reconstruct_kv_past_448_far_better_than_unit(tmp_path):
    d = _scaled_v_checkpoint(tmp_path)
    ids = PROMPTS[1]
    ref, unit, cal = _runner(d), _runner(d, **FP8_KV), _runner(d, **FP8_KV)
    scales = calibrate_kv_scales(cal.model, PROMPTS, 1.25, max_tokens=512, block_size=16)
    assert float(scales[:, 1].min()) > 1.0           # |V| amax > 448 / 1.25 in every layer
    logits = {name: _prefill(r, ids) for name, r in (("ref", ref), ("unit", unit), ("cal", cal))}
    exact = _stored(ref, len(ids))
    assert float(exact[:, 1].abs().max()) > 2 * FP8_MAX
    err = {name: [float((_stored(r, len(ids))[:, j] - exact[:, j]).norm() / exact[:, j].norm()) for j in (0, 1)]
           for name, r in (("unit", unit), ("cal", cal))}
    assert err["cal"][1] <= 0.06 and err["unit"][1] >= 5 * err["cal"][1], err       # V: saturated at 448 (0.47 / 0.043)
    assert err["cal"][0] <= 0.06, err
    gap = {name: float((logits[name] - logits["ref"]).norm() / logits["ref"].norm()) for name in ("unit", "cal")}
    assert gap["cal"] * 3 <= gap["unit"], gap         # logits rel err 0.48 / 0.038


# ---------------------------------------------------------------------------- weight sync
def test_weight_sync_writes_scales_in_place_all_or_nothing(hf_model_dir):
    r = _runner(hf_model_dir("qwen3_moe"), **FP8_KV)
    ks, ptr = r.model.kv_scales, r.model.kv_scales.data_ptr()
    o_name = "model.layers.0.self_attn.o_proj.weight"
    o_before = r.model.layers[0].wo.clone()
    stage = WeightStage(r.model, partial=True).add_all({**_scales("attn"), o_name: torch.zeros(64, 64)})
    assert stage.apply() == 2 * L + 1
    assert r.model.kv_scales is ks and ks.data_ptr() == ptr and torch.equal(ks, _expected())
    assert not torch.equal(r.model.layers[0].wo, o_before)
    mixed = {P.format(i=0) + "kv_scale": torch.tensor(2.0), P.format(i=1) + "k_proj.output_scale": torch.tensor([4.0]),
             P.format(i=1) + "v_proj.output_scale": torch.tensor(8.0)}
    WeightStage(r.model, partial=True).add_all(mixed).apply()
    assert ks.tolist() == [[2.0, 2.0], [4.0, 8.0], [K[2], V[2]]]      # layer 2 keeps its scales
    before, wo = ks.clone(), r.model.layers[0].wo.clone()
    alone = {o_name: torch.ones(64, 64), P.format(i=2) + "k_scale": torch.tensor(9.0)}
    with pytest.raises(WeightUpdateError, match=P.format(i=2) + "k_scale"):
        WeightStage(r.model, partial=True).add_all(alone).apply()
    assert torch.equal(ks, before) and torch.equal(r.model.layers[0].wo, wo)        # nothing written
    for bad in (torch.tensor(-1.0), torch.tensor([1.0, 2.0]), torch.tensor(float("inf"))):
        with pytest.raises(WeightUpdateError, match=P.format(i=0) + "v_scale"):
            WeightStage(r.model, partial=True).add(P.format(i=0) + "v_scale", bad)
    from ainfer_pd.integrations.verl.weight_staging import prepare_bucket      # verl's bucket check lets them by
    staged = prepare_bucket(types.SimpleNamespace(model=r.model), list(_scales("attn").items()), cast_dtype=True)
    assert [n for n, _ in staged] == list(_scales("attn"))
    plain = _runner(hf_model_dir("qwen3_moe"))      # a pool in the model dtype: scales ignored, no error
    stage = WeightStage(plain.model, partial=True).add_all(_scales("self_attn"))
    assert stage.apply() == 0 and sorted(stage.report.ignored) == sorted(_scales("self_attn"))


async def test_update_weights_carries_scales_into_the_running_worker(hf_model_dir):
    async with RolloutWorker(hf_worker_cfg(hf_model_dir("qwen3_moe"), cache=FP8_KV)) as w:
        ks = w.model.kv_scales
        n = await w.update_weights(_scales("output_scale"), partial=True)
        assert n == 2 * L and w.model.kv_scales is ks and torch.equal(ks, _expected())
        assert sorted(w.last_weight_sync.applied) == sorted(_scales("output_scale"))
        with pytest.raises(WeightUpdateError, match="positive"):
            await w.update_weights({P.format(i=0) + "k_scale": torch.tensor(0.0),
                                    P.format(i=0) + "v_scale": torch.tensor(1.0)}, partial=True)
        assert torch.equal(ks, _expected())
        out = await w.generate(rand_ids(random.Random(1), 20, 256),
                               SamplingParams(max_new_tokens=4, temperature=0.0))
        await w.release(out.trajectory_id)
        assert w.kv_leak_free()
