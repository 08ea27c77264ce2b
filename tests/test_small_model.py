"""The committed small real model (``tests/data/small_qwen3_moe``, trained by
``trainer_examples/small_model/train.py``, issue 38 item 5): ainfer-pd loads it, its greedy
multi-turn rollout equals transformers' own ``generate``, and it is trained (held-out loss well
below a uniform model's), so the test fails on random weights."""
import json
import math
from pathlib import Path

import pytest
import torch

from ainfer_pd import RolloutWorker, SamplingParams
from tests.conftest import hf_worker_cfg

DIR = Path(__file__).resolve().parent / "data" / "small_qwen3_moe"
PROMPT = ('<|user|>\nimport os\nimport sys\n\n\ndef main(argv=None):\n    """Parse the command line and '
          'run."""\n    if argv is None:\n        argv = sys.argv[1:]\n<|end|><|assistant|>\n')
OBSERVATION = "<|end|><|tool|>\n$ python -c 'import os; print(os.sep)'\n/\n<|end|><|assistant|>\n"
N = 24


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DIR)
    model = AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32).eval()
    return tok, model


def _hf_generate(model, ids: list[int]) -> list[int]:
    """transformers' greedy generate of N tokens (EOS ignored, as the worker's ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id, use_cache=True)
    return out[0, len(ids):].tolist()


def test_checkpoint_is_small_and_recorded():
    size = sum(p.stat().st_size for p in DIR.iterdir())
    assert size <= 16 * 2**20, size
    recipe = json.loads((DIR / "recipe.json").read_text())
    assert recipe["final_heldout_loss"] < 0.6 * recipe["uniform_loss"]
    assert recipe["args"]["seed"] is not None and recipe["file_list_sha256"]


async def test_greedy_multi_turn_rollout_equals_transformers_generate(hf):
    tok, model = hf
    prompt = tok(PROMPT)["input_ids"]
    obs = tok(OBSERVATION)["input_ids"]
    cfg = hf_worker_cfg(DIR)
    assert cfg.model.architecture == "qwen3_moe"
    assert set(cfg.model.stop_token_ids) == {tok.convert_tokens_to_ids("<|end|>"), tok.eos_token_id}
    greedy = SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True)
    async with RolloutWorker(cfg) as w:
        assert not w.model.load_report.random_init
        o1 = await w.generate(prompt, greedy)
        o2 = await w.continue_(o1.trajectory_id, obs, greedy)
        assert o2.num_cached_tokens >= len(prompt)
        await w.release(o2.trajectory_id)
        assert w.kv_leak_free()
    want1 = _hf_generate(model, prompt)
    assert o1.token_ids == want1
    want2 = _hf_generate(model, prompt + want1 + obs)
    assert o2.token_ids == want2
    text = tok.decode(o1.token_ids + o2.token_ids)
    assert sum(c.isalpha() for c in text) > len(text) / 3, text          # code-like text, not noise


def test_heldout_loss_well_below_uniform(hf):
    tok, model = hf
    ids = tok((DIR / "heldout_sample.txt").read_text())["input_ids"][:2048]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0, :-1].float()
    loss = float(torch.nn.functional.cross_entropy(logits, x[0, 1:]))
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.6 * uniform, (loss, uniform)
