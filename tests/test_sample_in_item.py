"""Sampling runs in the stream item that computes the logits (P's head, the D item, a verify
iteration's item), never on the event loop: the loop only reads what the item sampled (CPU
device; the mixed-chunked reference loop is the one that samples on the loop)."""
import asyncio
import threading

import pytest

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.loop import turns as turns_mod
from ainfer_pd.engine.model import sampler as sampler_mod
from tests.conftest import tiny_cfg


@pytest.mark.parametrize("policy,overlap,spec", [("normal", False, False), ("fine-grained", False, False),
                                                 ("fine-grained", True, False), ("normal", False, True)])
def test_no_token_is_sampled_on_the_event_loop(policy, overlap, spec, monkeypatch):
    loop_thread: list[threading.Thread] = []
    sampled_on: set[str] = set()
    real = sampler_mod.sample_on_device

    def on_loop(*a, **kw):
        raise AssertionError("a token was sampled on the event loop")

    def watch(*a, **kw):
        sampled_on.add("loop" if threading.current_thread() in loop_thread else "item")
        return real(*a, **kw)

    monkeypatch.setattr(turns_mod, "sample", on_loop)
    for mod in ("ainfer_pd.engine.loop.p_walk", "ainfer_pd.engine.loop.d_overlap", "ainfer_pd.spec.verify"):
        monkeypatch.setattr(f"{mod}.sample_on_device", watch)

    async def main():
        loop_thread.append(threading.current_thread())
        over = {"scheduler.policy": policy, "scheduler.overlap_decode": overlap, "model.num_layers": 2}
        if spec:
            over.update({"spec.method": "suffix", "spec.num_draft_tokens": 3, "spec.adaptive": False})
        async with RolloutWorker(tiny_cfg(**over)) as w:
            prompt = [5, 6, 7, 8] * 6
            greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
            first = await w.generate(prompt, greedy)      # its output drafts its greedy siblings' (spec)
            outs = [first] + list(await asyncio.gather(*(w.generate(prompt, greedy) for _ in range(2))))
            nxt = await asyncio.gather(*(w.continue_(o.trajectory_id, [5, 6, 7], SamplingParams(
                max_new_tokens=8, temperature=0.0, repetition_penalty=1.2)) for o in outs))
            for o in nxt:
                await w.release(o.trajectory_id)
            assert all(len(o.token_ids) == 8 for o in nxt) and w.kv_leak_free()
            return w.metrics()
    m = asyncio.run(main())
    assert sampled_on == {"item"}
    if spec:
        assert m.get("spec_verifies", 0) > 0                # verify iterations ran, verified in their item
