"""Issue 34, item 2: the model's whole stop set ends a turn, as vLLM uses it: every id of
``config.json``'s ``eos_token_id`` list and of ``generation_config.json``'s ``eos_token_id`` (an
int or a list), unless ``SamplingParams(ignore_eos=True)``. Tiny Hugging Face directories are
written here (``config.json`` of the tiny config: a seeded random init)."""
from __future__ import annotations

import asyncio
import json

import pytest

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.errors import CheckpointError, ConfigError
from ainfer_pd.hf.config import fields_from_hf
from ainfer_pd.hf.export import config_json
from tests.conftest import hf_worker_cfg, tiny_cfg

PROMPT = [5, 17, 99, 23, 42, 7, 300, 12]
N = 12


def _write(d, *, eos, gen=None):
    d.mkdir()
    cj = config_json(tiny_cfg().model)
    cj["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cj))
    if gen is not None:
        (d / "generation_config.json").write_text(json.dumps(gen))
    return d


async def _gen(d, **params):
    async with RolloutWorker(hf_worker_cfg(d)) as w:
        out = await asyncio.wait_for(w.generate(PROMPT, SamplingParams(max_new_tokens=N, temperature=0.0, **params)), 60)
        await w.release(out.trajectory_id)
        assert w.kv_leak_free()
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The greedy tokens of the tiny model on PROMPT (no stop), an id it never emits, and the
    first position k >= 1 whose token is new (stopping there gives k + 1 tokens)."""
    d = _write(tmp_path_factory.mktemp("ref") / "m", eos=None)
    toks = asyncio.run(_gen(d, ignore_eos=True)).token_ids
    assert len(toks) == N
    never = next(i for i in range(2, 512) if i not in toks)
    k = next(i for i in range(1, N) if toks[i] not in toks[:i])
    return toks, never, k


@pytest.mark.parametrize("where", ["config-list", "generation-int", "generation-list"])
async def test_every_id_of_the_models_stop_set_ends_a_turn(tmp_path, reference, where):
    toks, never, k = reference
    stop = toks[k]
    if where == "config-list":          # GLM-4.5: config.json lists several EOS ids
        d = _write(tmp_path / "m", eos=[never, stop])
    elif where == "generation-int":
        d = _write(tmp_path / "m", eos=never, gen={"eos_token_id": stop})
    else:                               # Qwen3: <|im_end|> and <|endoftext|> in generation_config.json
        d = _write(tmp_path / "m", eos=never, gen={"eos_token_id": [never, stop], "bos_token_id": 3})
    m = WorkerConfig.from_pretrained(d).model
    assert m.eos_token_id == never and stop in m.stop_token_ids and m.stop_set == {never, stop}
    out = await _gen(d)
    assert out.finish_reason == "stop" and out.token_ids == toks[:k + 1]
    # ignore_eos turns the whole model stop set off (vLLM: generation_config's ids too)
    out = await _gen(d, ignore_eos=True)
    assert out.finish_reason == "length" and out.token_ids == toks
    # a request's own stop ids still stop it under ignore_eos
    out = await _gen(d, ignore_eos=True, stop_token_ids=[stop])
    assert out.finish_reason == "stop" and out.token_ids == toks[:k + 1]


def test_the_stop_set_is_read_and_checked(tmp_path):
    cj = config_json(tiny_cfg().model)
    assert fields_from_hf({**cj, "eos_token_id": [4, 9, 4]})["stop_token_ids"] == (4, 9)
    assert fields_from_hf({**cj, "eos_token_id": None})["eos_token_id"] is None
    # no eos in config.json, one in generation_config.json: it is the EOS
    m = WorkerConfig.from_pretrained(_write(tmp_path / "a", eos=None, gen={"eos_token_id": [6, 8]})).model
    assert m.eos_token_id == 6 and m.stop_set == {6, 8}
    for bad in ("x", [1, "2"], [True], -1):
        with pytest.raises(CheckpointError, match="eos_token_id"):
            WorkerConfig.from_pretrained(_write(tmp_path / f"g{bad!s:.3}", eos=1, gen={"eos_token_id": bad}))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "config.json").write_text(json.dumps(cj))
    (tmp_path / "j" / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        WorkerConfig.from_pretrained(tmp_path / "j")
    with pytest.raises(ConfigError, match="stop_token_ids"):
        tiny_cfg(**{"model.stop_token_ids": (1, 512)})
