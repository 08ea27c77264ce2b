"""A speculating runner's decode graphs come in two sets over the same buckets: plain passes replay
graphs whose attention reads each row alone, verify passes graphs that read a turn's keys once for its
rows. Capture needs CUDA (the GPU gate's ``spec_passes_replay_their_graph_sets``); here the set a batch
replays is checked on CPU with recorded stand-ins for the captured graphs."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ainfer_pd.engine.attention import DecodeMeta, ForwardBatch, lead_offsets
from ainfer_pd.engine.runtime.cuda_graphs import DecodeGraphs


class RecordedGraph:
    """Stands in for a captured CUDA graph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _graphs(width: int, max_decode_batch: int, sizes=(1, 4, 16, 32, 64), ctxs=(64, 256)) -> DecodeGraphs:
    runner = SimpleNamespace(kv=SimpleNamespace(block_size=16),
                             sections=SimpleNamespace(verify_width=width,
                                                      scheduler=SimpleNamespace(max_decode_batch=max_decode_batch)))
    g = DecodeGraphs(runner, sizes, ctxs, scratch_slot=0, ctx=None, stream=None)
    for B in g.plain_batch_sizes():
        for L in ctxs:
            g.graphs[(B, L)] = (RecordedGraph(), g._static(B, L, "cpu"), torch.zeros(B, 3))
    if width > 1:
        for B in sizes:
            for L in ctxs:
                g.verify_graphs[(B, L)] = (RecordedGraph(), g._static(B, L, "cpu"), torch.zeros(B, 3))
    return g


def _batch(widths: list[int], keys: int, group_width: int | None) -> ForwardBatch:
    """One row per position of turns of ``widths[i]`` rows at ``keys`` keys; turn groups with ``group_width``."""
    n = sum(widths)
    lens = torch.tensor([keys + j for w in widths for j in range(w)])
    lead = None if group_width is None else torch.tensor(lead_offsets(widths, group_width))
    meta = DecodeMeta(None, lens, block_table=torch.zeros(n, -(-(keys + max(widths)) // 16), dtype=torch.int64),
                      block_size=16, lead_off=lead, group_width=group_width or 1)
    return ForwardBatch(torch.arange(n), lens - 1, torch.arange(n) + 16, [], meta, torch.arange(n), block_size=16)


def test_plain_passes_replay_plain_graphs_and_verify_passes_verify_graphs():
    g = _graphs(width=4, max_decode_batch=16)
    assert g.plain_batch_sizes() == (1, 4, 16)          # a plain pass has at most max_decode_batch rows
    assert g.try_run(_batch([1] * 10, 100, None)) is not None
    assert g.graphs[(16, 256)][0].replays == 1 and g.num_replays == 1 and g.num_verify_replays == 0
    fb = _batch([4, 1, 3, 4, 4, 4, 4, 4, 4], 100, 4)        # 32 rows: past every plain size
    assert g.try_run(fb) is not None
    assert g.verify_graphs[(32, 256)][0].replays == 1 and g.num_replays == 2 and g.num_verify_replays == 1
    s = g.verify_graphs[(32, 256)][1]
    assert s["lead"][:32].tolist() == fb.decode.lead_off.tolist()
    fb = _batch([2, 2], 10, 4)                               # a small verify: the verify set still
    g.try_run(fb)
    assert g.verify_graphs[(4, 64)][0].replays == 1 and g.graphs[(4, 64)][0].replays == 0
    assert sum(e[0].replays for e in g.graphs.values()) == 1


def test_the_plain_set_holds_the_first_size_past_the_decode_batch_and_every_size_without_speculation():
    assert _graphs(width=4, max_decode_batch=20).plain_batch_sizes() == (1, 4, 16, 32)
    assert _graphs(width=4, max_decode_batch=64).plain_batch_sizes() == (1, 4, 16, 32, 64)
    g = _graphs(width=1, max_decode_batch=4)
    assert g.plain_batch_sizes() == (1, 4, 16, 32, 64) and not g.verify_graphs
    # no verify set (a group width of 1): a verify pass replays the plain graphs, each row alone
    assert g.try_run(_batch([3, 3], 40, 1)) is not None and g.graphs[(16, 64)][0].replays == 1
    assert g.num_replays == 1 and g.num_verify_replays == 0


def test_the_verify_cost_batch_each_row_alone_is_a_verify_pass_of_single_row_groups():
    """``--compare-alone``'s batch replays the verify graphs too (its rows alone: every lead offset 0);
    one token a row is a plain pass."""
    from ainfer_pd.engine.runtime.verify_costs import _decode_batch
    from tests.conftest import cpu_runner, tiny_cfg
    cfg = tiny_cfg(**{"model.num_layers": 1, "cache.num_blocks": 64, "spec.method": "suffix"})
    runner = cpu_runner(cfg)
    W = runner.sections.verify_width
    assert W > 1
    alone = _decode_batch(runner, 3, 4, 20, grouped=False).decode
    assert alone.lead_off.tolist() == [0] * 12 and alone.group_width == W
    grouped = _decode_batch(runner, 3, 4, 20).decode
    assert grouped.lead_off.tolist() == lead_offsets([4] * 3, W)
    assert _decode_batch(runner, 3, 1, 20).decode.lead_off is None
