"""FP8 models (``model.quantization: fp8``, issue 37) without checkpoints: the blockwise round trip,
which projections are FP8 (the routed experts; the dense ones too with ``model.fp8_dense``), the
quantized random init, the forward's FP8 dispatch (local, expert-parallel, attention TP), weight
sync in FP8 (bf16 in, quantized on the way, all-or-nothing, halves alone, engine names checked),
and a worker serving greedily whose logprobs are the FP8 model's own. The tests that depend on the
dense format run under both settings (``DENSE``)."""
import dataclasses
import math

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.config import ModelConfig
from ainfer_pd.engine.model.linear import (FP8_SUFFIX, SCALE_SUFFIX, Fp8Kernels, grouped, layer_projections,
                                           quantize_parts)
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.engine.model.weights import WeightStage
from ainfer_pd.engine.quant.fp8 import FP8, FP8_MAX, dequantize_blockwise, experts_fp8_reference, quantize_blockwise
from ainfer_pd.errors import ConfigError, UnsupportedOptionError, WeightUpdateError
from tests.conftest import rand_ids, tiny_cfg
from tests.test_engine_core import recompute_greedy

GREEDY = dict(temperature=0.0, ignore_eos=True)
DENSE = pytest.mark.parametrize("fp8_dense", [False, True], ids=["experts-fp8", "all-fp8"])
DENSE_LEAVES = ("wqkv", "wo", "dense_w13", "dense_w2", "shared_w13", "shared_w2")
# glm4_moe: a dense first layer, a shared expert, a sigmoid router; widths past one 128-block with
# partial edge blocks (192 = 128 + 64, 320 = 2 x 128 + 64), q rows 256 and k / v rows 128 each
WIDE = dict(architecture="glm4_moe", vocab_size=300, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=64, num_experts=8, top_k=2, expert_intermediate=192, shared_expert_intermediate=192,
            dense_layers=(0,), dense_intermediate=320, router="sigmoid", num_expert_groups=2, topk_groups=1,
            partial_rotary_factor=0.5, qkv_bias=True, routed_scaling_factor=2.0, dtype="bfloat16", seed=5)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (float8 has no CPU equality), to compare bit for bit."""
    return t.detach().contiguous().view(torch.uint8) if t.dtype == FP8 else t.detach()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: _bytes(p).clone() for n, p in model.named_parameters()}


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


# ---------------------------------------------------------------------------- round trip
def test_blockwise_round_trip_is_within_the_e4m3_bound_in_every_block():
    """Each 128 x 128 block (the edge ones partial) has its own scale: amax / 448; its largest
    magnitude lands on 448, and every element comes back within half an e4m3 step: 2^-4 of its
    magnitude (3 mantissa bits), or 2^-10 of the scale below e4m3's normal range."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    for bi in range(3):
        for bj in range(2):
            w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] *= 10.0 ** (3 * bi - 2 * bj - 1)
    w[128:256, 128:] = 0.0                                        # an all-zero block
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8 and s.shape == (3, 2) and s.dtype == torch.float32
    back = dequantize_blockwise(q, s)
    for bi in range(3):
        for bj in range(2):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            ref, got, scale = w[blk], back[blk], float(s[bi, bj])
            amax = float(ref.abs().max())
            if amax == 0.0:
                assert not got.any()
                continue
            assert math.isclose(scale, amax / FP8_MAX, rel_tol=1e-6)
            assert float(q[blk].float().abs().max()) == FP8_MAX
            bound = torch.maximum(ref.abs() * 2.0 ** -4, torch.full_like(ref, scale * 2.0 ** -10)) * (1 + 1e-5)
            assert bool(((got - ref).abs() <= bound).all()), (bi, bj)


def test_a_fused_projection_quantizes_each_part_on_its_own_grid():
    """w13 [2I, D] with I = 192: gate and up each 2 block rows (a partial one each), never a
    block shared across the halves; quantizing a half alone gives its half of the whole."""
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(192, 256, generator=g), 100 * torch.randn(192, 256, generator=g)
    q, s = quantize_parts(torch.cat([gate, up]), (192, 192))
    assert s.shape == (4, 2)
    qg, sg = quantize_blockwise(gate)
    assert torch.equal(q[:192].view(torch.uint8), qg.view(torch.uint8)) and torch.equal(s[:2], sg)
    pr = layer_projections(ModelConfig(**WIDE), 1, 8)["w13"]
    assert pr.part("up") == (192, 384, 2, 4) and not pr.one_grid and pr.scale_shape == (8, 4, 2)
    assert layer_projections(ModelConfig(**WIDE), 1, 8)["wqkv"].one_grid      # q 256 rows, k 128, v 128


# ---------------------------------------------------------------------------- config, init
def test_quantization_and_fp8_dense_are_validated_and_attention_tp_is_refused_with_fp8_dense():
    with pytest.raises(ConfigError, match="model.quantization='int4'"):
        ModelConfig(quantization="int4").validate()
    with pytest.raises(ConfigError, match="quantization"):
        tiny_cfg(**{"model.quantization": 8})
    with pytest.raises(ConfigError, match="model.fp8_dense .* needs model.quantization: fp8"):
        ModelConfig(fp8_dense=True).validate()
    with pytest.raises(ConfigError, match="model.fp8_dense .* needs model.quantization: fp8"):
        tiny_cfg(**{"model.fp8_dense": True})
    with pytest.raises(ConfigError, match="model.fp8_dense must be true/false"):
        tiny_cfg(**{"model.quantization": "fp8", "model.fp8_dense": "yes"})
    from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
    with pytest.raises(UnsupportedOptionError, match="fp8_dense with attention tensor parallelism"):
        ModelRunner(RunnerSections.from_config(tiny_cfg(**{"model.quantization": "fp8", "model.fp8_dense": True})),
                    torch.device("cpu"), None,
                    tp_shard=(0, 2))


def test_attention_tp_shards_the_model_dtype_attention_of_an_fp8_model(tmp_path):
    """Without ``fp8_dense`` the attention is in the model dtype: two gloo TP ranks, each holding
    half the heads, compute the unsharded FP8 model's logits (the experts FP8 on both)."""
    import yaml
    from tests._dist_util import run_ranks
    from tests.test_tp_attention import TINY, _tp_prefill_rank
    cfg = yaml.safe_load(TINY.read_text())
    cfg["model"]["quantization"] = "fp8"
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = run_ranks(_tp_prefill_rank, 2, str(path), timeout_s=90)
    for r, x in enumerate(res):
        assert x["shard_heads"] == (2, 1) and x["kv_ok"], r
        assert x["max_abs"] < 1e-3 and x["tp_tok"] == x["ref_tok"], (r, x["max_abs"])


def test_which_projections_are_fp8():
    """Default: the routed experts FP8, every dense projection (attention, shared expert, dense
    MLP) a model-dtype parameter; ``fp8_dense``: every projection FP8. Never the router, the
    shared gate, the embedding or the head."""
    for dense in (False, True):
        c = dataclasses.replace(ModelConfig(**WIDE), quantization="fp8", fp8_dense=dense)
        m = build_model(c)
        params = dict(m.named_parameters())
        for i, lyr in enumerate(m.layers):
            assert {leaf: pr.fp8 for leaf, pr in lyr.projections.items()} == {
                leaf: dense or leaf in ("w13", "w2") for leaf in lyr.projections}
            for leaf, pr in lyr.projections.items():
                fp8 = f"layers.{i}.{leaf}{FP8_SUFFIX}"
                if pr.fp8:
                    assert getattr(lyr, leaf) is None and params[fp8].dtype == FP8, (dense, leaf)
                else:
                    assert getattr(lyr, leaf).dtype == torch.bfloat16 and fp8 not in params, (dense, leaf)
        assert set(DENSE_LEAVES) <= set(m.layers[0].projections) | set(m.layers[1].projections)
        assert all(params[n].dtype == torch.bfloat16 for n in ("embed", "lm_head", "layers.1.router"))


@DENSE
def test_fp8_random_init_is_the_quantized_model_dtype_init_and_an_ep_shard_its_slice(fp8_dense):
    """Each FP8 projection is the quantized projection of the model-dtype model of the same seed;
    everything else (the dense projections without ``fp8_dense`` too) equals it."""
    c16 = ModelConfig(**WIDE)
    c8 = dataclasses.replace(c16, quantization="fp8", fp8_dense=fp8_dense)
    m16, m8, shard = build_model(c16), build_model(c8), build_model(c8, experts=(2, 6))
    p16, p8, ps = dict(m16.named_parameters()), dict(m8.named_parameters()), dict(shard.named_parameters())
    n_fp8 = 0
    for name, p in p16.items():
        i, leaf = (int(name.split(".")[1]), name.split(".")[2]) if name.startswith("layers.") else (None, name)
        pr = m8.layers[i].projections.get(leaf) if i is not None else None
        if pr is None or not pr.fp8:
            assert torch.equal(p8[name], p), name                  # router, norms, biases, embed, head
            continue
        w = p.transpose(-1, -2) if pr.transposed else p
        q, s = quantize_parts(w, pr.rows)
        assert torch.equal(_bytes(p8[name + FP8_SUFFIX]), _bytes(q)), name
        assert torch.equal(p8[name + SCALE_SUFFIX], s), name
        assert getattr(m8.layers[i], leaf) is None and p8[name + FP8_SUFFIX].dtype == FP8
        if pr.routed:
            assert torch.equal(_bytes(ps[name + FP8_SUFFIX]), _bytes(q[2:6])), name
            assert torch.equal(ps[name + SCALE_SUFFIX], s[2:6]), name
        n_fp8 += 1
    # all: attention x3, dense MLP, 2 MoE layers x4 (experts, shared); else the 2 MoE layers' experts
    assert n_fp8 == (3 * 2 + 2 + 2 * 4 if fp8_dense else 2 * 2)
    if not fp8_dense:
        assert not _same(_snapshot(m8), _snapshot(build_model(c8)))          # seed-stable


# ---------------------------------------------------------------------------- forward
@DENSE
def test_fp8_forward_runs_the_fp8_math_locally_and_expert_parallel(fp8_dense):
    """The local FP8 experts are the torch oracle's; an expert-parallel rank's grouped local
    experts give each row its expert's output (rows past the counts zero); the layer's
    projections run on the FP8 values (a model-dtype forward on the dequantized weights is close,
    not equal: the activations are quantized in 1 x 128 groups)."""
    c8 = dataclasses.replace(ModelConfig(**WIDE), dtype="float32", quantization="fp8", fp8_dense=fp8_dense)
    m = build_model(c8)
    lyr = m.layers[1]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, c8.hidden_size, generator=g)
    r = m.route_rows(1, x)
    want = experts_fp8_reference(x, r.topk_idx, r.topk_weights, lyr.w13_fp8, lyr.w13_scale_inv, lyr.w2_fp8,
                                 lyr.w2_scale_inv)
    from ainfer_pd.engine.model.linear import routed
    assert torch.equal(routed(m, lyr, x, r), want)
    # an expert-parallel shard [4, 8): rows grouped by local expert, 2 padding rows at the end
    shard = build_model(c8, experts=(4, 8))
    counts = torch.tensor([2, 0, 3, 1])
    xg = torch.randn(8, c8.hidden_size, generator=g)
    got = grouped(shard.layers[1], 0, 4, xg, counts, shard.fp8_kernels)
    ids = torch.tensor([4, 4, 6, 6, 6, 7])
    ref = experts_fp8_reference(xg[:6], ids.unsqueeze(1), torch.ones(6, 1), lyr.w13_fp8, lyr.w13_scale_inv,
                                lyr.w2_fp8, lyr.w2_scale_inv)
    torch.testing.assert_close(got[:6], ref, rtol=1e-6, atol=1e-6)
    assert not got[6:].any()
    # the whole forward against the model-dtype model holding the dequantized weights
    deq = build_model(dataclasses.replace(c8, quantization="none"))
    _load_dequantized(deq, m)
    # (this random init has near ties in its routers: a position whose activations' rounding flips an
    # expert choice moves by more; the tolerance is on the median and on 80% of the positions)
    a, b = _logits(m, list(range(3, 40))), _logits(deq, list(range(3, 40)))
    err = (a - b).abs().amax(dim=-1) / b.std()                    # per position, in logit standard deviations
    assert 0 < float(err.median()) < 0.35 and float((err < 0.5).float().mean()) >= 0.8, err
    # the dense projections' format: dequantizing the FP8 ones gives a model whose math differs
    # only by the activations' rounding; a model-dtype projection's math is exactly the model's
    lyr0 = m.layers[0]
    x0 = torch.randn(5, c8.hidden_size, generator=g)
    from ainfer_pd.engine.model.linear import project
    got = project(lyr0, "wqkv", x0, lyr0.bqkv, m.fp8_kernels)
    plain = project(deq.layers[0], "wqkv", x0, deq.layers[0].bqkv, deq.fp8_kernels)
    assert torch.equal(got, plain) != fp8_dense


@torch.no_grad()
def _load_dequantized(dst, src) -> None:
    from ainfer_pd.engine.model.linear import store
    from ainfer_pd.engine.quant.fp8 import dequantize_blockwise as dq
    for name, p in dst.named_parameters():
        i, leaf = (int(name.split(".")[1]), name.split(".")[2]) if name.startswith("layers.") else (None, name)
        pr = src.layers[i].projections.get(leaf) if i is not None else None
        if pr is None or not pr.fp8:
            p.copy_(dict(src.named_parameters())[name])
            continue
        q, s = getattr(src.layers[i], leaf + FP8_SUFFIX), getattr(src.layers[i], leaf + SCALE_SUFFIX)
        parts = []
        for part in pr.part_names or (None,):
            a, b, sa, sb = pr.part(part)
            parts.append(dq(q[..., a:b, :], s[..., sa:sb, :]))
        w = torch.cat(parts, dim=-2)
        store(dst.layers[i], dst.layers[i].projections[leaf], w.transpose(-1, -2) if pr.transposed else w)


def _logits(model, ids: list[int]) -> torch.Tensor:
    from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
    c, T = model.cfg, len(ids)
    kv = torch.zeros(c.num_layers, 2, T, c.num_kv_heads, c.head_dim, dtype=c.torch_dtype)
    slots = torch.arange(T)
    fb = ForwardBatch(torch.tensor(ids), torch.arange(T), slots, [PrefillSeq(0, T, T, slots)], None, torch.arange(T))
    with torch.inference_mode():
        return model.forward_batch(fb, kv)


# ---------------------------------------------------------------------------- weight sync (engine names)
def test_engine_name_syncs_of_fp8_parameters_are_checked_and_all_or_nothing():
    """The engine's own names: FP8 experts as e4m3 + scales, the model-dtype dense projections
    (default) as they are, never in float8 (their engine names have no scales)."""
    c8 = dataclasses.replace(ModelConfig(**WIDE), quantization="fp8")
    src, m = build_model(dataclasses.replace(c8, seed=9)), build_model(c8)
    before = _snapshot(m)
    named = dict(src.named_parameters())
    assert named["layers.0.wqkv"].dtype == torch.bfloat16 and "layers.0.wqkv_scale_inv" not in named
    w13 = "layers.1.w13_fp8"
    bad = [({w13: named[w13].float()}, "dtype torch.float32, expected torch.float8_e4m3fn"),
           ({"layers.1.w13_scale_inv": torch.ones(8, 3, 2)}, "shape"),
           ({w13: torch.full_like(named[w13].view(torch.uint8), 0x7F).view(FP8)}, "non-finite"),
           ({"layers.1.router": named["layers.1.router"].to(FP8)}, "dtype"),
           ({"layers.0.wqkv": named["layers.0.wqkv"].to(FP8)}, "dtype torch.float8_e4m3fn, expected torch.bfloat16"),
           ({"layers.0.wqkv_scale_inv": torch.ones(4, 2)}, "unknown weight name"),
           ({"layers.1.shared_w2": named["layers.1.shared_w2"] * float("inf")}, "non-finite")]
    for items, match in bad:
        with pytest.raises(WeightUpdateError, match=match):
            WeightStage(m, partial=True).add_all({**named, **items}.items()).apply()
    assert not _same(before, _snapshot(m))
    with pytest.raises(WeightUpdateError, match="incomplete"):         # the values without their scales
        WeightStage(m).add_all([(n, t) for n, t in named.items() if not n.endswith(SCALE_SUFFIX)]).apply()
    assert not _same(before, _snapshot(m))
    WeightStage(m).add_all(named.items()).apply()
    assert not _same(_snapshot(src), _snapshot(m))


@DENSE
async def test_a_worker_serves_fp8_greedily_and_its_logprobs_are_the_fp8_models_own(fp8_dense):
    """``model.quantization: fp8`` on the tiny config (random init quantized at load): generate and
    continue_ under the fine-grained policy, tokens and logprobs equal to a full recompute
    through the FP8 torch forward; the same after sleep level 2 (weights kept on the host, or
    dropped and synced back under the engine's names: FP8 e4m3 + scales, model-dtype as they are)."""
    cfg = tiny_cfg(**{"model.quantization": "fp8", "model.fp8_dense": fp8_dense, "scheduler.policy": "fine-grained"})
    ref_model = build_model(cfg.model)
    import random
    rng = random.Random(3)
    prompt, obs = rand_ids(rng, 37), rand_ids(rng, 9)
    async with RolloutWorker(cfg) as w:
        assert w.model.layers[0].w13_fp8.dtype == FP8
        assert (w.model.layers[0].wo_fp8.dtype == FP8) if fp8_dense else (w.model.layers[0].wo.dtype == torch.float32)
        o = await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        o2 = await w.continue_(o.trajectory_id, obs, SamplingParams(max_new_tokens=5, **GREEDY))
        await w.release(o.trajectory_id)
        await w.sleep(2)                                        # FP8 values and scales to host memory and back
        await w.wake_up()
        assert (await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))).token_ids == o.token_ids
        await w.sleep(2, keep_weights=False)                    # verl's hybrid mode: dropped, then synced back
        await w.wake_up(["weights"])
        await w.update_weights(ref_model.named_parameters())     # the engine's own FP8 names: e4m3 + scales
        await w.wake_up(["kv_cache"])
        assert (await w.generate(prompt, SamplingParams(max_new_tokens=6, **GREEDY))).token_ids == o.token_ids
    for out, ctx in ((o, prompt), (o2, prompt + o.token_ids + obs)):
        toks, lps = recompute_greedy(ref_model, cfg, ctx, len(out.token_ids))
        assert out.token_ids == toks
        assert max(abs(a - b) for a, b in zip(out.logprobs, lps)) < 2e-3, (out.logprobs, lps)


async def test_the_triton_moe_backend_runs_the_fp8_kernels_and_agrees_with_the_torch_path():
    """``device.moe_backend: triton`` (under the interpreter here) gives an FP8 model the Triton FP8
    GEMM and fused MoE: the same greedy tokens as the torch references, logprobs within 2e-3
    (``fp8_dense``: the GEMM runs too; the default runs the fused MoE only)."""
    from ainfer_pd.engine.quant.fp8_ops import fp8_linear, fused_experts_fp8
    import random
    rng = random.Random(4)
    prompt = rand_ids(rng, 12)
    outs = []
    for backend in ("torch", "triton"):
        cfg = tiny_cfg(**{"model.quantization": "fp8", "model.fp8_dense": True, "device.moe_backend": backend,
                          "model.num_layers": 2})
        async with RolloutWorker(cfg) as w:
            k = w.model.fp8_kernels
            assert (k.linear, k.experts) == ((fp8_linear, fused_experts_fp8) if backend == "triton" else
                                             (Fp8Kernels().linear, Fp8Kernels().experts))
            outs.append(await w.generate(prompt, SamplingParams(max_new_tokens=3, **GREEDY)))
    assert outs[0].token_ids == outs[1].token_ids
    assert max(abs(a - b) for a, b in zip(outs[0].logprobs, outs[1].logprobs)) < 2e-3


async def test_expert_parallel_ranks_serve_fp8_like_one_rank():
    """Two real gloo ranks, each holding half the experts in FP8 (its shard's quantized init) and
    computing them through the expert exchange in FP8: the greedy outputs of the one-rank FP8 run."""
    import asyncio
    from tests._dist_util import run_ranks
    from tests.test_multirank_engine import _drive, _plans, _rank_main
    plans = _plans(4, seed=5)
    async with RolloutWorker(tiny_cfg(**{"model.quantization": "fp8"})) as w:
        ref = await _drive(w, plans)
    res = await asyncio.to_thread(run_ranks, _rank_main, 2, "fine-grained", plans, {"model.quantization": "fp8"},
                                  timeout_s=120)
    for rank, (outs, leak_free, *_rest) in enumerate(res):
        assert leak_free and outs == ref[rank::2], rank


def test_the_weight_bytes_estimate_counts_fp8_projections_at_one_byte():
    """What the KV pool's sizing can subtract for the weights (``ModelConfig.rank_weight_bytes``),
    against the bytes the model-dtype model, the default FP8 model (experts FP8), the all-FP8 model
    and their expert-parallel shards hold (within 1%)."""
    bf16 = ModelConfig(**WIDE)
    experts, every = (dataclasses.replace(bf16, quantization="fp8", fp8_dense=d) for d in (False, True))
    for c in (bf16, experts, every):
        for ep, shard in ((1, None), (2, (0, 4))):
            held = sum(p.numel() * p.element_size() for p in build_model(c, experts=shard).parameters())
            assert abs(c.rank_weight_bytes(ep) - held) <= 0.01 * held, (c.quantization, c.fp8_dense, ep)
    assert every.rank_weight_bytes(1) < experts.rank_weight_bytes(1) < 0.85 * bf16.rank_weight_bytes(1)
