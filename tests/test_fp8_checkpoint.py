"""Blockwise FP8 Hugging Face checkpoints (issue 37): tiny FP8 checkpoints written here from the
float ones of tests/_hf_models.py (every projection quantized per 128 x 128 block, its
``weight_scale_inv`` beside it, ``quantization_config`` in ``config.json``, two shards with the
scales in the other shard than their weights) load for every architecture and compute what the
dequantized weights compute in transformers, into the default FP8 model (routed experts FP8, the
dense projections dequantized into the model dtype) and into the all-FP8 one (``fp8_dense``);
quantize-at-load, the typed refusals, weight sync of bf16 tensors (bit-exact with loading them)
and of e4m3 + scale pairs, expert-parallel shards, export, and verl's ``rollout.quantization``."""
import json
import random
import re
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from ainfer_pd import RolloutWorker, WorkerConfig
from ainfer_pd.engine.model.linear import FP8_SUFFIX, SCALE_SUFFIX, Fp8Kernels, quantize_parts
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.engine.model.moe import experts_local
from ainfer_pd.engine.model.weights import WeightStage
from ainfer_pd.engine.quant.fp8 import FP8, dequantize_blockwise, dequantize_w13, quantize_blockwise
from ainfer_pd.errors import CheckpointError, UnsupportedModelError, UnsupportedOptionError, WeightUpdateError
from tests import _hf_models
from tests.conftest import hf_worker_cfg
from tests.test_fp8_model import DENSE, _bytes, _same, _snapshot

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROJ = re.compile(r"(_proj|\.w[123])\.weight$")         # every Linear of the attention and MLPs
PROMPTS = [[3, 17, 200, 45, 9, 77, 120, 5, 61], list(range(40, 72)), [250, 2, 2, 131, 99, 14]]


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(dst, tensors: dict, config: dict) -> None:
    """Two shards (alternate names: a weight and its scale land in different files) and the index."""
    dst.mkdir()
    names = sorted(tensors)
    wmap = {}
    for k, part in enumerate((names[::2], names[1::2]), 1):
        fname = f"model-0000{k}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / fname))
        wmap.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (dst / "config.json").write_text(json.dumps(config))


def write_fp8(src, dst, keep=(), mutate=None) -> dict[str, torch.Tensor]:
    """``dst``: ``src``'s checkpoint in blockwise FP8, the projections whose names contain an
    entry of ``keep`` left in their float dtype (and listed in ``modules_to_not_convert``, with the
    router and qwen2's shared-expert gate). Returns the dequantized tensors: what it holds."""
    out, deq = {}, {}
    for n, t in _tensors(src).items():
        if PROJ.search(n) and not any(k in n for k in keep):
            q, s = quantize_blockwise(t)
            out[n], out[n + "_scale_inv"] = q, s
            deq[n] = dequantize_blockwise(q, s, t.dtype)
        else:
            out[n] = deq[n] = t
    if mutate is not None:
        mutate(out)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**QUANT, "modules_to_not_convert": ["lm_head", "mlp.gate", *keep]}
    _write(dst, out, config)
    return deq


def _fp8_dir(hf_model_dir, tmp_path, name: str, **kw):
    return tmp_path / f"{name}-fp8", write_fp8(hf_model_dir(name), tmp_path / f"{name}-fp8", **kw)


def _model(path, **model):
    return build_model(hf_worker_cfg(path, model=model).model)


def _logits(model, ids: list[int]) -> torch.Tensor:
    from tests.test_fp8_model import _logits as run
    return run(model, ids)


def _n_dense(c) -> int:
    """Checkpoint tensors of the dense projections: q, k, v, o per layer, 3 per shared expert and dense MLP."""
    return 4 * c.num_layers + 3 * (len(c.dense_layers) + bool(c.shared_expert_intermediate) * len(c.moe_layers))


def _dense_is(m, want: dict[str, torch.Tensor]) -> int:
    """Every model-dtype projection of the FP8 model ``m`` a checkpoint name fills holds exactly
    ``want[name]`` (the dequantized e4m3 tensor, or the float one as stored). How many it checked."""
    from ainfer_pd.hf.names import name_table
    table, n = name_table(m), 0
    for name, t in table.hf.items():
        if t.dequant and t.scale_of is None and name in want:
            p = table.params[t.param]
            region = p[t.index] if t.index else p
            assert torch.equal(region.transpose(-1, -2) if t.transpose else region, want[name].to(p.dtype)), name
            n += 1
    return n


# ---------------------------------------------------------------------------- config.json
@pytest.mark.parametrize("q,match", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
    ({**QUANT, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({k: v for k, v in QUANT.items() if k != "weight_block_size"}, "per-tensor"),
    ({**QUANT, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**QUANT, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({**QUANT, "kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
])
def test_other_quantization_configs_are_refused_by_name(hf_model_dir, tmp_path, q, match):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((hf_model_dir("qwen3_moe") / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
    with pytest.raises(UnsupportedModelError, match=match):
        WorkerConfig.from_pretrained(d)
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**QUANT, "dequantize": False}}))
    assert WorkerConfig.from_pretrained(d).model.quantization == "fp8"


# ---------------------------------------------------------------------------- loading
@DENSE
@pytest.mark.parametrize("name", _hf_models.ARCHS)
def test_an_fp8_checkpoint_loads_and_computes_what_its_dequantized_weights_compute(name, fp8_dense, hf_model_dir,
                                                                                    tmp_path):
    """Loaded bytes are the checkpoint's (FP8 projections), or its dequantized tensors exactly
    (the default model's dense projections, in the model dtype). The logits of a few prompts
    against transformers' own forward on the dequantized weights (float32), per position max
    |difference| in units of the logits' standard deviation: with the FP8 kernels' activation
    quantization switched off (the dequantized weights times unquantized activations) below 1e-4
    (measured <= 3e-6: the weights load exactly); with it (the FP8 model's real math, torch path)
    a median below 0.6 with ``fp8_dense`` (measured 0.30 qwen3_moe, 0.38 qwen2_moe, 0.43 mixtral,
    0.34 glm4_moe: the 1 x 128 e4m3 rounding of the activations, about 2% per GEMM on these tiny
    random models, and the expert choices it flips), below 0.3 by default (measured 0.13, 0.10,
    0.19, 0.11: only the experts' activations are rounded)."""
    from transformers import AutoModelForCausalLM
    path, deq = _fp8_dir(hf_model_dir, tmp_path, name)
    m = _model(path, fp8_dense=fp8_dense)
    assert m.cfg.quantization == "fp8" and (m.layers[0].wqkv is None) == fp8_dense
    ck = _tensors(path)
    c, lyr = m.cfg, m.layers[-1]
    H = c.num_heads * c.head_dim
    up = ("model.layers.2.block_sparse_moe.experts.3.w3.weight" if name == "mixtral"
          else "model.layers.2.mlp.experts.3.up_proj.weight")
    I = c.expert_intermediate
    if fp8_dense:
        assert torch.equal(_bytes(lyr.wqkv_fp8[:H]), _bytes(ck["model.layers.2.self_attn.q_proj.weight"]))
        assert _dense_is(m, deq) == 0
    else:
        assert ck["model.layers.2.self_attn.q_proj.weight"].dtype == FP8
        assert _dense_is(m, deq) == _n_dense(c)
    assert torch.equal(_bytes(lyr.w13_fp8[3, I:]), _bytes(ck[up]))
    assert torch.equal(lyr.w13_scale_inv[3, 1:], ck[up + "_scale_inv"])
    dq = tmp_path / f"{name}-dequantized"
    _write(dq, deq, json.loads((hf_model_dir(name) / "config.json").read_text()))
    hf = AutoModelForCausalLM.from_pretrained(dq, dtype=torch.float32).eval()
    errs, exact = [], []
    for ids in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
        errs.append((_logits(m, ids) - want).abs().amax(dim=-1) / want.std())
        m.fp8_kernels = Fp8Kernels(linear=_linear_unquantized_x, experts=_experts_unquantized_x)
        exact.append(float((_logits(m, ids) - want).abs().max() / want.std()))
        m.fp8_kernels = Fp8Kernels()
    err = torch.cat(errs)
    assert max(exact) < 1e-4, (name, exact)
    assert 0.01 < float(err.median()) < (0.6 if fp8_dense else 0.3), (name, err)


def _linear_unquantized_x(x, q, scale_inv, bias=None):
    """The FP8 GEMM without its activation quantization: x times the dequantized weight."""
    return torch.nn.functional.linear(x.float(), dequantize_blockwise(q, scale_inv), bias).to(x.dtype)


def _experts_unquantized_x(x, r, w13, w13_scale, w2, w2_scale, residual=None):
    """The FP8 experts without activation quantization: the model-dtype experts on the dequantized weights."""
    gate, up = dequantize_w13(w13, w13_scale)
    w2d = dequantize_blockwise(w2, w2_scale)
    return experts_local(x, r, torch.cat([gate, up], dim=-2).transpose(-1, -2), w2d.transpose(-1, -2), residual)


@DENSE
def test_quantize_at_load_is_the_quantized_float_model_and_kept_modules_load_in_their_format(fp8_dense, hf_model_dir,
                                                                                              tmp_path):
    """``model.quantization: fp8`` on a float checkpoint: every FP8 projection is the quantized
    projection of the float model from the same directory, every other tensor that model's. An
    FP8 checkpoint that keeps some projections in float (``modules_to_not_convert``) loads them
    in the model's format: quantized at load into an FP8 projection (the same bytes as the
    checkpoint that stores them quantized), as stored into a model-dtype one."""
    src = hf_model_dir("qwen2_moe")
    m16, m8 = _model(src), _model(src, quantization="fp8", fp8_dense=fp8_dense)
    p16, p8 = dict(m16.named_parameters()), dict(m8.named_parameters())
    for name, p in p16.items():
        i, leaf = (int(name.split(".")[1]), name.split(".")[2]) if name.startswith("layers.") else (None, name)
        pr = m8.layers[i].projections.get(leaf) if i is not None else None
        if pr is None or not pr.fp8:
            assert torch.equal(p8[name], p), name
            continue
        q, s = quantize_parts(p.transpose(-1, -2) if pr.transposed else p, pr.rows)
        assert torch.equal(_bytes(p8[name + FP8_SUFFIX]), _bytes(q)) and torch.equal(p8[name + SCALE_SUFFIX], s), name
    full, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen2_moe")
    kept = tmp_path / "kept"
    deq = write_fp8(src, kept, keep=("self_attn.o_proj", "layers.1.mlp.experts.2.", "shared_expert.down_proj"))
    ck = _tensors(kept)
    assert ck["model.layers.1.mlp.experts.2.up_proj.weight"].dtype == torch.float32
    assert ck["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float32
    from_kept = _model(kept, fp8_dense=fp8_dense)
    if fp8_dense:
        assert not _same(_snapshot(_model(full, fp8_dense=True)), _snapshot(from_kept))
        assert not _same(_snapshot(_model(full, fp8_dense=True)), _snapshot(m8))
    else:                 # o_proj and the shared down_proj as stored, the other dense ones dequantized
        assert _dense_is(from_kept, deq) == 4 * 3 + 3 * 3
        assert torch.equal(from_kept.layers[1].wo, ck["model.layers.1.self_attn.o_proj.weight"])
    # the routed experts are FP8 either way: expert 2 of layer 1 quantized at load, like the full checkpoint's
    assert torch.equal(_bytes(from_kept.layers[1].w13_fp8), _bytes(_model(full).layers[1].w13_fp8))


def _drop(name):
    return lambda out: out.pop(name)


def _set(name, value):
    def f(out):
        out[name] = value(out[name])
    return f


@pytest.mark.parametrize("mutate,match", [
    (_drop("model.layers.2.mlp.experts.2.down_proj.weight_scale_inv"),
     r"'model.layers.2.mlp.experts.2.down_proj.weight' is stored in float8_e4m3fn but the checkpoint has no "
     r"'model.layers.2.mlp.experts.2.down_proj.weight_scale_inv'"),
    (_set("model.layers.0.self_attn.k_proj.weight_scale_inv", lambda s: torch.ones(2, 1)),
     r"'model.layers.0.self_attn.k_proj.weight_scale_inv' in model-0000\d-of-00002.safetensors: weight_scale_inv has "
     r"shape \(2, 1\), expected \(1, 1\)"),
    (_set("model.layers.2.mlp.gate.weight", lambda t: t.to(FP8)), r"'model.layers.2.mlp.gate.weight' is stored in "
     "float8_e4m3fn; this engine keeps it in the model dtype"),
    (_set("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv", lambda s: s.to(FP8)), "block scales .* float8"),
    # the dense projections, dequantized at load into the default model: the same checks
    (_drop("model.layers.1.self_attn.o_proj.weight_scale_inv"), r"'model.layers.1.self_attn.o_proj.weight' is stored "
     r"in float8_e4m3fn but the checkpoint has no 'model.layers.1.self_attn.o_proj.weight_scale_inv'"),
    (_set("model.layers.1.self_attn.o_proj.weight", lambda q: q.float()), r"'model.layers.1.self_attn.o_proj."
     r"weight_scale_inv' scales 'model.layers.1.self_attn.o_proj.weight', which is stored in F32"),
    (_set("model.layers.1.self_attn.v_proj.weight_scale_inv", lambda s: s.to(FP8)), "block scales .* float8"),
])
def test_a_bad_or_missing_weight_scale_inv_is_a_checkpoint_error_naming_the_tensor(hf_model_dir, tmp_path, mutate,
                                                                                    match):
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen3_moe", mutate=mutate)
    with pytest.raises(CheckpointError, match=match):
        _model(path)


def test_an_fp8_checkpoint_under_quantization_none_is_refused(hf_model_dir, tmp_path):
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "mixtral")
    with pytest.raises(CheckpointError, match="an FP8 checkpoint loads with model.quantization: fp8"):
        _model(path, quantization="none")


# ---------------------------------------------------------------------------- weight sync
def _trainer():
    t = _hf_models.make("qwen3_moe", seed=0)
    _hf_models.randomize(t, seed=31)
    return t


@DENSE
async def test_a_bf16_sync_into_an_fp8_worker_equals_loading_those_weights_quantized(fp8_dense, hf_model_dir,
                                                                                     tmp_path):
    """verl's flow: the trainer's float weights under checkpoint names (buckets) into a worker
    serving an FP8 checkpoint: the FP8 projections quantized on the way in, the model-dtype ones
    (default: the dense projections) copied as they are; bit-exact with an FP8 model loaded from a
    checkpoint of those weights; transformers' packed names give the same bytes. A sync with one
    bad tensor (its last) and an incomplete one leave the model as it was."""
    trainer = _trainer()
    saved = _hf_models.save(trainer, tmp_path / "trainer")
    want = _snapshot(_model(saved, quantization="fp8", fp8_dense=fp8_dense))
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen3_moe")
    named = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    per_expert = list(_hf_models.per_expert(named))
    async with RolloutWorker(hf_worker_cfg(path, model={"fp8_dense": fp8_dense})) as w:
        assert (w.model.layers[0].wqkv is None) == fp8_dense
        before = _snapshot(w.model)
        bad = per_expert[:-1] + [(per_expert[-1][0], per_expert[-1][1] * float("nan"))]
        with pytest.raises(WeightUpdateError, match="non-finite"):
            await w.update_weights([bad[i:i + 5] for i in range(0, len(bad), 5)])
        with pytest.raises(WeightUpdateError, match=r"incomplete .*up_proj.weight"):
            await w.update_weights([p for p in per_expert if p[0] != "model.layers.2.mlp.experts.6.up_proj.weight"])
        assert not _same(before, _snapshot(w.model))
        await w.update_weights([per_expert[i:i + 5] for i in range(0, len(per_expert), 5)])
        assert not _same(want, _snapshot(w.model))
    packed = _model(path, fp8_dense=fp8_dense)
    WeightStage(packed).add_all(named).apply()
    assert not _same(want, _snapshot(packed))


def test_e4m3_and_scale_pairs_sync_into_model_dtype_projections_dequantized(hf_model_dir, tmp_path):
    """An FP8 checkpoint's own tensors synced into the default FP8 model: the dense projections'
    e4m3 + ``weight_scale_inv`` pairs (in any order, split over buckets, the buffers reused after
    each bucket under ``copy``) are dequantized: bit-exact with loading that checkpoint. One of a
    pair without the other, a scale beside a float weight, a scale given twice or misshaped: a
    WeightUpdateError, nothing written (partial syncs too)."""
    trainer = _hf_models.save(_trainer(), tmp_path / "trainer")
    fp8_trainer = tmp_path / "trainer-fp8"
    write_fp8(trainer, fp8_trainer)
    want = _snapshot(_model(fp8_trainer))
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen3_moe")
    m = _model(path)
    before = _snapshot(m)
    items = sorted(_tensors(fp8_trainer).items())
    random.Random(0).shuffle(items)                 # scales before and after their weights, in other buckets
    at = {n: i for i, (n, _) in enumerate(items)}
    assert {at[n + "_scale_inv"] < at[n] for n in at if n + "_scale_inv" in at} == {True, False}
    o = "model.layers.1.self_attn.o_proj.weight"
    ck = dict(items)
    bad = [([(o, ck[o])], r"'model.layers.1.self_attn.o_proj.weight' arrived in float8_e4m3fn without its "
                          "weight_scale_inv"),
           ([(o + "_scale_inv", ck[o + "_scale_inv"])], r"'model.layers.1.self_attn.o_proj.weight_scale_inv' arrived "
                                                         "without its weight in float8_e4m3fn"),
           ([(o, ck[o].float()), (o + "_scale_inv", ck[o + "_scale_inv"])], "arrived without its weight"),
           ([(o, ck[o]), (o + "_scale_inv", ck[o + "_scale_inv"])] * 2, "given twice|already filled"),
           ([(o + "_scale_inv", ck[o + "_scale_inv"]), (o + "_scale_inv", ck[o + "_scale_inv"])], "given twice"),
           ([(o, ck[o]), (o + "_scale_inv", torch.ones(2, 2))], "shape"),
           ([(o, ck[o]), (o + "_scale_inv", ck[o + "_scale_inv"].to(FP8))], "expected float32")]
    for pairs, match in bad:
        with pytest.raises(WeightUpdateError, match=match):
            WeightStage(m, partial=True).add_all(pairs).apply()
    assert not _same(before, _snapshot(m))
    stage = WeightStage(m, copy=True)
    buffers = [(n, t.clone()) for n, t in items]
    for k in range(0, len(buffers), 7):
        stage.add_all(buffers[k:k + 7])
        for _, t in buffers[k:k + 7]:                 # the source reuses its buffers for the next bucket
            t.view(torch.uint8).zero_()
    assert stage.apply() > 0 and stage.report.applied
    assert not _same(want, _snapshot(m))
    assert _dense_is(m, {n: dequantize_blockwise(t, ck[n + "_scale_inv"]) for n, t in ck.items()
                         if n + "_scale_inv" in ck}) == _n_dense(m.cfg)


def test_a_gate_half_alone_quantizes_into_its_own_half(hf_model_dir, tmp_path):
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen3_moe")
    m = _model(path)
    before = _snapshot(m)
    gate = torch.randn(m.cfg.expert_intermediate, m.cfg.hidden_size) * 3
    stage = WeightStage(m, partial=True)
    stage.add("model.layers.0.mlp.experts.5.gate_proj.weight", gate)
    stage.apply()
    q, s = quantize_blockwise(gate)
    I, after = m.cfg.expert_intermediate, _snapshot(m)
    assert _same(before, after) == ["layers.0.w13_fp8", "layers.0.w13_scale_inv"]
    assert torch.equal(after["layers.0.w13_fp8"][5, :I], _bytes(q)) and torch.equal(m.layers[0].w13_scale_inv[5, :1], s)
    changed = (after["layers.0.w13_fp8"] != before["layers.0.w13_fp8"]).nonzero()
    assert set(changed[:, 0].tolist()) == {5} and int(changed[:, 1].max()) < I          # the up half untouched
    # an e4m3 half (a checkpoint's bytes) needs its weight_scale_inv in the same sync, even a partial one
    stage = WeightStage(m, partial=True)
    stage.add("model.layers.0.mlp.experts.5.up_proj.weight", q)
    with pytest.raises(WeightUpdateError, match="up_proj.weight' arrived in float8_e4m3fn without its weight_scale"):
        stage.apply()
    stage = WeightStage(m, partial=True)
    stage.add_all([("model.layers.0.mlp.experts.5.up_proj.weight", q),
                   ("model.layers.0.mlp.experts.5.up_proj.weight_scale_inv", s)]).apply()
    lyr = m.layers[0]
    assert torch.equal(_bytes(lyr.w13_fp8[5, I:]), _bytes(q)) and torch.equal(lyr.w13_scale_inv[5, 1:], s)


def test_an_expert_parallel_rank_reads_and_quantizes_only_its_own_experts(hf_model_dir, tmp_path, monkeypatch):
    path, _ = _fp8_dir(hf_model_dir, tmp_path, "qwen3_moe")
    c = hf_worker_cfg(path).model
    full, shard = build_model(c), build_model(c, experts=(4, 8))
    rep = shard.load_report
    mine = re.compile(r"\.experts\.([4-7])\.")
    assert all(mine.search(n) for n in rep.tensors_read if ".experts." in n)
    assert any(".experts.0." in n for n in rep.tensors_skipped)
    trainer = _trainer()
    named = [(n, p.detach().clone()) for n, p in trainer.named_parameters()]
    WeightStage(full).add_all(named).apply()
    from ainfer_pd.hf import names
    seen = []
    real = names.quantize_parts
    monkeypatch.setattr(names, "quantize_parts", lambda w, rows=(): seen.append(tuple(w.shape)) or real(w, rows))
    stage = WeightStage(shard)
    stage.add_all(_hf_models.per_expert(named)).apply()
    assert stage.report.skipped and all(not mine.search(n) for n in stage.report.skipped)
    assert seen and all(s[0] != 8 for s in seen)
    seen.clear()
    WeightStage(shard).add_all(named).apply()                          # packed: only [4, 8) is quantized
    assert (4, 2 * c.expert_intermediate, c.hidden_size) in seen and all(s[0] != 8 for s in seen)
    for lyr, whole in zip(shard.layers, full.layers):
        if lyr.is_moe:
            assert torch.equal(_bytes(lyr.w13_fp8), _bytes(whole.w13_fp8[4:]))
            assert torch.equal(lyr.w2_scale_inv, whole.w2_scale_inv[4:])


# ---------------------------------------------------------------------------- export, verl
@DENSE
def test_export_of_an_fp8_model_is_the_hf_fp8_format_and_loads_back_bit_exact(fp8_dense, hf_model_dir, tmp_path):
    """The FP8 projections as e4m3 + ``weight_scale_inv``, the rest in the model dtype, and every
    Linear written in a float dtype (the default model's dense projections, the routers,
    ``lm_head``) named in ``modules_to_not_convert``; the directory loads back into the same
    bytes (the same ``fp8_dense``)."""
    from ainfer_pd.hf.export import save_pretrained, state_dict
    from ainfer_pd.hf.quant_config import FP8_CONFIG
    m = _model(hf_model_dir("glm4_moe"), quantization="fp8", fp8_dense=fp8_dense)
    out = save_pretrained(m, tmp_path / "export", max_shard_bytes=40_000)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == FP8_CONFIG
    ck = _tensors(out)
    floats = {n.removesuffix(".weight") for n, t in ck.items()
              if n.endswith(".weight") and t.dtype != FP8 and t.dim() == 2 and n != "model.embed_tokens.weight"}
    assert sorted(qc["modules_to_not_convert"]) == sorted(floats)
    assert {"lm_head", "model.layers.1.mlp.gate"} <= floats
    assert ("model.layers.1.self_attn.q_proj" in floats) != fp8_dense
    assert ("model.layers.0.mlp.down_proj" in floats) != fp8_dense                # glm4's dense first layer
    assert not any(".experts." in n for n in floats)
    dense = ck["model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert dense.dtype == (FP8 if fp8_dense else torch.float32)
    assert ("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv" in ck) == fp8_dense
    assert ck["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == FP8
    assert ck["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert not _same(_snapshot(m), _snapshot(_model(out, fp8_dense=fp8_dense)))
    with pytest.raises(UnsupportedOptionError, match="transformers-layout"):
        state_dict(m, "transformers")


def test_verl_rollout_quantization_fp8_maps_to_the_model_and_its_bf16_buckets_are_not_cast_to_fp8(hf_model_dir):
    from ainfer_pd.integrations.verl.settings import rollout_overrides
    from ainfer_pd.integrations.verl.weight_staging import prepare_bucket
    base = hf_worker_cfg(hf_model_dir("qwen3_moe"))
    assert rollout_overrides({"quantization": "fp8"}, base, {}) == {"model.quantization": "fp8"}
    with pytest.raises(UnsupportedOptionError, match="quantization='awq'"):
        rollout_overrides({"quantization": "awq"}, base, {})
    m = build_model(base.replace(**{"model.quantization": "fp8", "model.dtype": "bfloat16"}).model)
    t = torch.randn(m.cfg.expert_intermediate, m.cfg.hidden_size, dtype=torch.float32)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    [(_, got)] = prepare_bucket(types.SimpleNamespace(model=m), [(name, t.t().contiguous())], cast_dtype=True)
    assert got.dtype == torch.bfloat16
    # a model-dtype (bf16) projection: e4m3 + its float32 scales pass uncast (dequantized at commit)
    o = "model.layers.0.self_attn.o_proj.weight"
    q, s = quantize_blockwise(torch.randn(m.cfg.hidden_size, m.cfg.num_heads * m.cfg.head_dim))
    got = prepare_bucket(types.SimpleNamespace(model=m), [(o, q), (o + "_scale_inv", s)], cast_dtype=True)
    assert [t.dtype for _, t in got] == [FP8, torch.float32]
