"""An FP8 KV pool under ``spec.method: mtp``: the MTP draft layer has its own KV layer, so it has
its own K / V scale row too: the checkpoint's when it carries that layer's, else each column's
largest over the target's layers; calibration (which runs the target's layers only) sets it the
same way. Outputs stay those of plain decoding on the same pool (drafts never change them)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from ainfer_pd import RolloutWorker, SamplingParams
from tests import _hf_models, _mtp_model
from tests.conftest import hf_worker_cfg

L = _hf_models.SPECS["glm4_moe"][2]["num_hidden_layers"]
K, V = [0.02, 0.5, 0.25, 0.125], [0.75, 0.04, 0.375, 0.0625]        # the last: the MTP layer's own
SPEC = {"method": "mtp", "adaptive": False, "num_draft_tokens": 3}
FP8_KV = {"kv_dtype": "fp8_e4m3"}
PROMPT = list(range(5, 25))
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    model, mtp = _mtp_model.make(1, own_head=False, own_embed=False)
    return _mtp_model.save(model, mtp, tmp_path_factory.mktemp("mtp") / "m")


def _with_scales(src, dst, layers):
    shutil.copytree(src, dst)
    tensors = {}
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(K[i])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(V[i])
    save_file(tensors, str(dst / "kv-scales.safetensors"))
    idx = dst / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"].update({n: "kv-scales.safetensors" for n in tensors})
    idx.write_text(json.dumps(data))
    return dst


async def _run(cfg):
    async with RolloutWorker(cfg) as w:
        out = await w.generate(PROMPT, GREEDY)
        return out, w.model.kv_scales.clone(), w


@pytest.mark.parametrize("own", [False, True], ids=["target scales only", "the MTP layer's own too"])
async def test_the_mtp_layer_has_its_own_kv_scale_row(mtp_dir, tmp_path, own):
    d = _with_scales(mtp_dir, tmp_path / "s", range(L + 1 if own else L))
    want = torch.tensor([K[:L], V[:L]], dtype=torch.float32).T
    mtp_row = torch.tensor([K[L], V[L]]) if own else want.amax(dim=0)
    spec, ks, _ = await _run(hf_worker_cfg(d, cache=FP8_KV, spec=SPEC))
    plain, ks_plain, _ = await _run(hf_worker_cfg(d, cache=FP8_KV))
    assert ks.shape == (L + 1, 2) and ks_plain.shape == (L, 2)
    assert torch.equal(ks[:L], want) and torch.equal(ks_plain, want)
    assert torch.equal(ks[L], mtp_row), ks
    assert spec.token_ids == plain.token_ids and spec.logprobs == pytest.approx(plain.logprobs, abs=1e-5)


async def test_calibration_under_mtp_sets_the_mtp_row_from_the_target_layers(mtp_dir):
    async with RolloutWorker(hf_worker_cfg(mtp_dir, cache=FP8_KV, spec=SPEC)) as w:
        got = await w.calibrate_kv_scales([PROMPT, list(range(60, 90))], margin=1.25)
        ks = w.model.kv_scales
        assert got.shape == (L, 2) and ks.shape == (L + 1, 2)
        assert torch.equal(ks[:L].cpu(), got) and torch.equal(ks[L].cpu(), got.amax(dim=0))
        out = await w.generate(PROMPT, GREEDY)
        assert len(out.token_ids) == 16
        await w.release(out.trajectory_id)
        assert w.kv_leak_free()
