"""Decode metadata: block tables resolved on the device, the P warm-up, the run breakdown."""
import random

import torch

from ainfer_pd.engine.attention import DecodeMeta
from ainfer_pd.engine.kv.kv_cache import KVCacheManager
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections
from ainfer_pd.engine.runtime.warmup import warmup_prefill
from ainfer_pd.tools.report import breakdown, interval_stats
from ainfer_pd.phase import Phase, PhaseContext
from tests.conftest import tiny_cfg


def test_block_table_resolves_to_the_per_row_slots():
    rng = random.Random(0)
    kv = KVCacheManager(400, 16)
    tids = [f"t{i}" for i in range(7)]
    lens = [rng.randrange(1, 300) for _ in tids]
    for t, n in zip(tids, lens):                      # interleaved reservations: scattered blocks
        kv.reserve(t, n + rng.randrange(0, 40))
    nb = -(-max(lens) // 16)
    meta = DecodeMeta(None, torch.tensor(lens), block_table=kv.block_table(tids, nb), block_size=16)
    meta.resolve()
    assert meta.key_slots.shape == (len(tids), nb * 16)
    for b, (t, n) in enumerate(zip(tids, lens)):
        assert torch.equal(meta.key_slots[b, :n], kv.slots(t, 0, n))
        assert kv.slot_of(t, n - 1) == int(kv.slots(t, n - 1, n))


def test_prefill_warmup_writes_only_the_scratch_slot():
    cfg = tiny_cfg()
    kv = KVCacheManager(64, cfg.cache.block_size)
    runner = ModelRunner(RunnerSections.from_config(cfg), torch.device("cpu"), kv)
    with torch.inference_mode():
        sizes = warmup_prefill(runner, PhaseContext(Phase.PREFILL, None), 40, cached=24)
    assert sizes == [16, 24, 32, 40]
    s = runner.scratch_slot
    assert s == 64 * cfg.cache.block_size                       # the first slot of the scratch block
    assert runner.kv_cache[:, :, :s].abs().sum() == 0           # real blocks untouched
    assert runner.kv_cache[:, :, s].abs().sum() > 0             # the scratch slot was written
    assert runner.kv_cache[:, :, s + 1:].abs().sum() == 0


def test_breakdown_and_interval_stats():
    m = {"d_iter_s_count": 3, "d_iter_s_mean": 0.005, "d_iter_s_sum": 0.015, "d_build_s_mean": 0.0004,
         "p_epoch_s_count": 2, "p_epoch_s_mean": 0.03, "p_epoch_tokens_mean": 512, "busy_fraction": 0.9}
    line = breakdown(m)
    assert "D iters 3" in line and "launch->done 5.00 ms" in line and "P epochs 2: 30.00 ms" in line
    ivs = [("P.attn0", "P", 0.0, 0.7), ("P.attn1", "P", 1.0, 1.002), ("D.iter", "D", 0.0, 0.005),
           ("D.capture", "D", 0.0, 5.0)]
    s = interval_stats(ivs)
    assert s.startswith("D.capture")                              # heaviest group first
    assert "P.attn n=2" in s
    assert "slowest: P.attn0 at 0.00 s 700.0 ms" in s               # capture / warm-up never "slowest"
