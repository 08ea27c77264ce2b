"""A P graph bucket whose passes read their own keys through TMA (the long prefill plan) keeps the
roped K and V of its captured QKV prologue in static buffers and hands them to the eager attention,
as the eager pass does (``engine/runtime/prefill_graphs.py``).

The capture and replay run on the GPU gate (``*_prefill_graph_equals_eager_2048_on_*``). Here a
**CPU stand-in of a replay** re-runs each captured piece on the bucket's static buffers, in the
order the capture recorded (a CUDA graph replays the same kernels on the same buffers), with the
TMA plan forced on the interpreter's TMA kernel: the replayed pass reads its own K/V from the
bucket and gives the eager pass's logits and pool.
"""
import torch

import ainfer_pd.engine.attention.triton_backend as tb
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq
from ainfer_pd.engine.attention.plan import TMA_PREFILL_TOKENS, PrefillPlan, prefill_plan
from ainfer_pd.engine.attention.triton_backend import TritonAttention
from ainfer_pd.engine.attention.triton_prefill_tma import prefill_tma
from ainfer_pd.engine.runtime.prefill_graphs import PrefillBinding, PrefillGraphs

CPU = torch.device("cpu")
TMA16 = PrefillPlan(16, 16, 4, 1, own_keys_tma=True)


class _Rerun:
    """A captured piece's CPU stand-in: ``replay`` runs the piece again."""

    def __init__(self, fn):
        self.replay = fn


def _stand_in_bucket(pg: PrefillGraphs, T: int, kv):
    """Bucket T with its pieces as :class:`_Rerun` stand-ins, chained as ``_capture`` chains the graphs."""
    m = pg.model
    b = pg._new_bucket(T, kv)
    fbs = ForwardBatch(b.ids, b.pos, b.write, [], None, None, block_size=0, padded=True)
    box = {}
    b.embed = _Rerun(lambda: box.update(st=pg._embed(fbs)))
    for i in range(m.cfg.num_layers):
        b.pre.append(_Rerun(lambda i=i: pg._pre(i, box["st"], fbs, kv[i], b)))
        b.post.append(_Rerun(lambda i=i: box.update(st=pg._post(i, box["st"], fbs, b))))

        def experts(i=i):
            box["st"] = pg._experts(i, box["st"])
            b.h_out = box["st"].h
        b.experts.append(_Rerun(experts))
    return b


def test_a_tma_bucket_keeps_its_roped_kv_and_replays_the_eager_pass(monkeypatch):
    from ainfer_pd.engine.model.model import build_model
    from tests.conftest import tiny_cfg
    calls = []

    def counted(q, kn, vn, *a, **kw):
        calls.append((q.shape[0], kn.data_ptr()))
        return prefill_tma(q, kn, vn, *a, **kw)
    monkeypatch.setattr(tb, "prefill_tma", counted)
    mc = tiny_cfg(**{"model.num_layers": 2}).model
    model = build_model(mc)
    model.attn_backend = TritonAttention(CPU, prefill_override=TMA16, tma=True)
    bs, S, scratch = 16, 16 * 16, 0
    g = torch.Generator().manual_seed(3)
    kv0 = torch.randn(2, 2, S, mc.num_kv_heads, mc.head_dim, generator=g)
    T, bucket = 45, 64                                       # 33 fresh tokens, 12 on 40 cached; 19 padding rows
    ids = torch.randint(2, 512, (T,), generator=g)
    b0, b1 = torch.tensor([3, 7, 1]), torch.tensor([5, 9, 2, 11])
    pos = torch.cat([torch.arange(33), torch.arange(40, 52)])
    write = torch.cat([(b0[:, None] * bs + torch.arange(bs)).reshape(-1)[:33],
                       (b1[:, None] * bs + torch.arange(bs)).reshape(-1)[40:52]])

    def batch():
        return ForwardBatch(ids, pos, write, [PrefillSeq(0, 33, 33, block_ids=b0), PrefillSeq(33, 12, 52, block_ids=b1)],
                            None, torch.tensor([32, 44]), block_size=bs)
    kv_eager = kv0.clone()
    with torch.inference_mode():
        eager = model.forward_batch(batch(), kv_eager)
    assert [n for n, _ in calls] == [T, T]                   # the eager pass reads its own K/V in both layers
    calls.clear()

    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.model, pg.scratch, pg.device, pg.num_replays = model, scratch, CPU, 0
    kv = kv0.clone()
    b = _stand_in_bucket(pg, bucket, kv)
    assert b.own_kv is not None and b.own_kv[0].shape == (bucket, mc.num_kv_heads, mc.head_dim)
    binding = PrefillBinding(pg, b, batch(), T)
    with torch.inference_mode():
        binding.embed()
        for i in range(mc.num_layers):
            binding.attn_route(i, kv[i])
            binding.experts(i)
        replayed = binding.head()
    assert [n for n, _ in calls] == [T, T]                   # the same kernel, replayed
    assert all(ptr == b.own_kv[0].data_ptr() for _, ptr in calls)   # on the bucket's kept keys
    assert torch.allclose(replayed, eager, atol=1e-4, rtol=1e-4), (replayed - eager).abs().max()
    real = torch.cat([write, torch.full((bucket - T,), scratch)])
    assert torch.allclose(kv[:, :, real[:T]], kv_eager[:, :, write], atol=1e-5)   # the pass's K/V, as eager wrote them
    assert torch.equal(b.own_kv[1][:T], kv[1, 1, write])     # the last layer's V kept is what it wrote


def test_only_buckets_whose_passes_read_their_own_kv_keep_them():
    from ainfer_pd.engine.model.model import build_model
    from tests.conftest import tiny_cfg
    mc = tiny_cfg(**{"model.num_layers": 1}).model
    model = build_model(mc).to(torch.bfloat16)
    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.model, pg.scratch, pg.device = model, 0, CPU
    kv16 = torch.zeros(1, 2, 64, mc.num_kv_heads, mc.head_dim, dtype=torch.bfloat16)
    kv8 = kv16.to(torch.float8_e4m3fn)
    model.attn_backend = TritonAttention(CPU, tma=True)       # the plan of the bucket's size decides
    assert pg._new_bucket(TMA_PREFILL_TOKENS, kv16).own_kv is not None
    assert pg._new_bucket(TMA_PREFILL_TOKENS - 64, kv16).own_kv is None
    assert pg._new_bucket(TMA_PREFILL_TOKENS, kv8).own_kv is None     # an FP8 pool never reads them
    model.attn_backend = TritonAttention(CPU)                 # no TMA on the device
    assert pg._new_bucket(TMA_PREFILL_TOKENS, kv16).own_kv is None
    assert prefill_plan(128, False, TMA_PREFILL_TOKENS, tma=True).own_keys_tma
    assert not prefill_plan(128, False, TMA_PREFILL_TOKENS - 1, tma=True).own_keys_tma
    assert prefill_plan(128, False, TMA_PREFILL_TOKENS) == PrefillPlan(64, 64, 4, 2)   # no TMA: the long tile at 4K
