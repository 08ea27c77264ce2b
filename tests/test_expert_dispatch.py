"""Expert dispatch: local routing, torch all-to-all over real gloo processes, lifecycle,
phase-owned concurrency, and the DeepEP backend's validation and call sequence (mocked).

Multi-rank checks run once per world size in spawned processes (module-scoped fixtures);
each test asserts one property of the returned results.
"""
from __future__ import annotations

import asyncio
import datetime
import multiprocessing as mp
import queue
import socket
import sys
import threading
import traceback
import types

import pytest
import torch
import torch.nn.functional as F

from ainfer_pd.comm.experts.base import BufferState, PhaseDispatchers
from ainfer_pd.comm.experts.local import LocalDispatcher
from ainfer_pd.errors import (BackendUnavailableError, BufferRetiredError, ConfigError,
                              DispatchCancelledError, DispatchPendingError, DispatchStateError)
from ainfer_pd.phase import Phase, PhaseContext

HIDDEN, NUM_EXPERTS, TOP_K, INTER = 32, 8, 2, 16


# ---- a fixed-seed MoE layer (SwiGLU experts), shared by every rank -----------------------------
def make_layer(seed: int = 1234) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(NUM_EXPERTS, HIDDEN, generator=g) * 0.5,
        "w1": torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.2,
        "w3": torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.2,
        "w2": torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=g) * 0.2,
    }


def make_batch(layer, seed: int, num_tokens: int, masked: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)                       # [T, D]
    probs = torch.softmax(x @ layer["router"].t(), dim=-1)                  # [T, E]
    w, idx = torch.topk(probs, TOP_K, dim=-1)                               # [T, k]
    w = w / w.sum(-1, keepdim=True)
    if masked and num_tokens > 3:
        idx[num_tokens // 2, 1] = -1                                        # "no selection"
    return x, idx, w


def expert_fn_for(layer, first_expert: int):
    """SwiGLU experts of one shard: rows sorted by local expert, ``counts`` rows each."""
    def fn(xg: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(xg)
        start = 0
        for l, c in enumerate(counts.tolist()):
            if c:
                e, h = first_expert + l, xg[start:start + c]
                out[start:start + c] = (F.silu(h @ layer["w1"][e]) * (h @ layer["w3"][e])) @ layer["w2"][e]
                start += c
        return out
    return fn


def reference(layer, x, idx, w):
    """The EP = 1 local result."""
    d = LocalDispatcher(Phase.PREFILL, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K,
                        max_tokens=max(1, x.shape[0]))
    return d.run_moe(x, idx, w, expert_fn_for(layer, 0))


def dense_reference(layer, x, idx, w):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(idx[t, k])
            if e >= 0:
                h = x[t:t + 1]
                y = (F.silu(h @ layer["w1"][e]) * (h @ layer["w3"][e])) @ layer["w2"][e]
                out[t] += w[t, k] * y[0]
    return out


# ---- a small spawn helper (real gloo processes) ------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, q):
    import torch.distributed as dist
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        q.put((rank, True, fn(rank, world)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report every failure to the parent
        q.put((rank, False, traceback.format_exc()))


def spawn_ranks(fn, world: int, timeout_s: float = 80.0) -> list:
    # forkserver with torch preloaded: 4 ranks start in ~3 s instead of ~15 s of parallel
    # torch imports on a 2-core machine (ignored if another test already started it)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ainfer_pd.comm.experts.torch_a2a"])
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < world:
            try:
                rank, ok, payload = q.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(world)) - set(results))} timed out")
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


class ListRecorder:
    """Duck-typed recorder: keeps (event, attrs) in order, thread-safe."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self._lock = threading.Lock()

    def event(self, name: str, **attrs) -> None:
        with self._lock:
            self.events.append((name, attrs))


# ---- rank programs -----------------------------------------------------------------------------
def _make_torch_dispatchers(rank, world, recorder=None):
    from ainfer_pd.comm.experts.torch_a2a import TorchAllToAllDispatcher, new_phase_groups
    groups = new_phase_groups()
    p = TorchAllToAllDispatcher(Phase.PREFILL, groups[Phase.PREFILL], rank, world, NUM_EXPERTS,
                                hidden=HIDDEN, top_k=TOP_K, max_tokens=64, recorder=recorder)
    d = TorchAllToAllDispatcher(Phase.DECODE, groups[Phase.DECODE], rank, world, NUM_EXPERTS,
                                hidden=HIDDEN, top_k=TOP_K, max_tokens=16, recorder=recorder)
    return PhaseDispatchers(p, d)


def _max_err(disp, layer, x, idx, w):
    e0 = disp.local_expert_range[0]
    out = disp.run_moe(x, idx, w, expert_fn_for(layer, e0))
    return float((out - reference(layer, x, idx, w)).abs().max()) if x.shape[0] else 0.0


def _rank_correctness(rank, world):
    """EP = world vs EP = 1, both phases, varied (also empty) batches."""
    layer = make_layer()
    pd = _make_torch_dispatchers(rank, world)
    errs = []
    for it, sizes in enumerate([(17, 9), (40, 0), (1, 16), (64, 5)]):
        for phase, T in zip(Phase, sizes):
            T = max(0, T - 3 * rank) if it % 2 else T + rank
            T = min(T, 64 if phase is Phase.PREFILL else 16)
            x, idx, w = make_batch(layer, 1000 * rank + 10 * it + (phase is Phase.DECODE), T)
            errs.append(_max_err(pd.get(phase), layer, x, idx, w))
    return {"max_err": max(errs), "num_checks": len(errs)}


def _rank_full(rank, world):
    """EP = 2: correctness, P and D concurrently from two threads, lifecycle, trace order, audit."""
    from ainfer_pd.comm.experts.ownership import SHARED
    import torch.distributed as dist

    res = _rank_correctness(rank, world)
    layer = make_layer()
    rec = ListRecorder()
    pd = _make_torch_dispatchers(rank, world, recorder=rec)

    # -- P and D concurrently, different batch sizes, many iterations --
    errors: dict[str, list] = {"P": [], "D": []}
    iters = {"P": 25, "D": 60}

    def loop(phase: Phase, sizes: tuple[int, int]):
        disp = pd.get(PhaseContext(phase, stream=None))
        try:
            for i in range(iters[phase.value]):
                T = sizes[0] + (7 * i + 3 * rank) % (sizes[1] - sizes[0] + 1)
                x, idx, w = make_batch(layer, 50_000 * (phase is Phase.DECODE) + 100 * i + rank, T)
                errors[phase.value].append(_max_err(disp, layer, x, idx, w))
        except BaseException:
            errors[phase.value].append(traceback.format_exc())

    threads = [threading.Thread(target=loop, args=(Phase.PREFILL, (40, 64))),
               threading.Thread(target=loop, args=(Phase.DECODE, (1, 16)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    res["concurrent"] = {k: (len(v), max(v, key=lambda e: e if isinstance(e, float) else 1e9))
                         for k, v in errors.items()}
    # both threads interleaved: D events appear between P notify and P combine
    kinds = [(a["phase"], n) for n, a in rec.events]
    p_first, p_last = kinds.index(("P", "expert.notify")), len(kinds) - 1 - kinds[::-1].index(("P", "expert.combine"))
    res["interleaved_D_events"] = sum(1 for ph, _ in kinds[p_first:p_last] if ph == "D")

    # -- lifecycle: second notify rejected; cancel -> retired -> quiesce -> reusable --
    P = pd.prefill
    x, idx, w = make_batch(layer, 7 + rank, 20)
    life = []
    n1 = P.notify(idx, tokens=[("req-a", 1), ("req-b", 3)])
    try:
        P.notify(idx)
    except DispatchPendingError:
        life.append("second-notify-rejected")
    life.append(P.cancel(n1) and P.state.value)
    try:
        P.notify(idx)
    except BufferRetiredError:
        life.append("retired-rejected")
    try:
        P.dispatch(n1, x, idx, w)
    except DispatchCancelledError:
        life.append("cancelled-dispatch-rejected")
    P.quiesce()
    life.append(P.state.value)
    life.append(_max_err(P, layer, x, idx, w) < 1e-5)
    # cancel after data moved: the combine is refused, buffer reusable after quiesce
    n2 = P.notify(idx)
    d2 = P.dispatch(n2, x, idx, w)
    P.cancel(d2)
    try:
        P.combine(d2, d2.x)
    except DispatchCancelledError:
        life.append("cancelled-combine-rejected")
    P.quiesce()
    life.append(_max_err(P, layer, x, idx, w) < 1e-5)
    # tagged result carries the lifetimes
    n3 = P.notify(idx, tokens=[("req-a", 2)])
    d3 = P.dispatch(n3, x, idx, w)
    tagged = P.combine_tagged(d3, expert_fn_for(layer, P.local_expert_range[0])(d3.x, d3.counts))
    life.append(list(tagged.tokens))
    life.append(tagged.stale({"req-a": 3}.get))
    res["lifecycle"] = life

    # -- background P task: waits for counts, then the permit, then moves data --
    async def scenario():
        trace: list[str] = []
        permit = asyncio.Event()
        D = pd.decode

        async def p_task():
            n = P.notify(idx)
            trace.append("P.notify")
            counts = await n.wait(timeout=30)
            trace.append(f"P.counts:{counts.total}")
            await permit.wait()
            trace.append("P.permit")
            d = P.dispatch(n, x, idx, w)
            trace.append("P.dispatch")
            P.combine(d, expert_fn_for(layer, P.local_expert_range[0])(d.x, d.counts))
            trace.append("P.combine")

        async def d_loop():
            for i in range(3):
                xd, idd, wd = make_batch(layer, 9 + i, 4)
                await asyncio.to_thread(_max_err, D, layer, xd, idd, wd)
                trace.append(f"D.iter{i}")
            trace.append("grant")
            permit.set()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(p_task())
            tg.create_task(d_loop())
        return trace

    res["trace"] = asyncio.run(scenario())

    # -- audit: the real configuration passes, a planted shared counter/event fails --
    topology = {"ep": world}
    shared = []
    reg = pd.registry()
    reg.register("runtime", "torch.distributed default group", SHARED, dist.group.WORLD)
    reg.register("topology", "ep topology", SHARED, topology)
    for name, t in layer.items():
        reg.register("weights", name, SHARED, t)
    report = reg.audit()
    res["audit"] = report.to_dict()
    bad = pd.registry(shared)
    bad.register("counters", "D.torch.send_counts(planted: P's)", Phase.DECODE, pd.prefill._send_counts)
    bad.register("events", "D.notify_done(planted: P's)", Phase.DECODE, pd.prefill.events["notify_done"])
    res["planted"] = bad.audit().to_dict()
    res["addresses"] = {ph.value: [o.address_range for o in pd.get(ph).owned_objects() if o.address_range]
                        for ph in Phase}
    return res


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep2():
    return spawn_ranks(_rank_full, 2)


@pytest.fixture(scope="module")
def ep4():
    return spawn_ranks(_rank_correctness, 4)


# ---- local routing -----------------------------------------------------------------------------
def test_local_dispatch_matches_a_dense_per_token_loop_for_both_phases():
    layer = make_layer()
    x, idx, w = make_batch(layer, 3, 23)
    ref = dense_reference(layer, x, idx, w)
    for phase in Phase:
        d = LocalDispatcher(phase, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=32)
        for _ in range(3):   # D flips its double buffer every call
            assert torch.allclose(d.run_moe(x, idx, w, expert_fn_for(layer, 0)), ref, atol=1e-5)


def test_local_counts_come_from_a_fixed_size_tensor_and_wait_reports_them():
    layer = make_layer()
    x, idx, w = make_batch(layer, 4, 9)
    d = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=16)
    n = d.notify(idx)
    assert n.counts_ready()
    counts = asyncio.run(n.wait())
    valid = idx[idx >= 0]
    assert counts.per_expert == tuple(int((valid == e).sum()) for e in range(NUM_EXPERTS))
    assert d.counts.shape == (NUM_EXPERTS,) and d.counts.data_ptr() == d._counts.data_ptr()
    disp = d.dispatch(n, x, idx, w)
    assert disp.x.shape == (idx.numel(), HIDDEN)        # padded rows (masked slots) at the end
    d.combine(disp, disp.x)


def test_local_dispatch_never_pulls_counts_to_the_host_so_the_d_graph_can_capture_it():
    layer = make_layer()
    x, idx, w = make_batch(layer, 4, 9)
    d = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=16)
    n = d.notify(idx)
    disp = d.dispatch(n, x, idx, w)
    assert n.counts is None                             # no .tolist() on the D path
    d.combine(disp, disp.x)


def test_local_dispatcher_rejects_batches_beyond_its_buffers():
    d = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=4)
    with pytest.raises(ConfigError):
        d.notify(torch.zeros(5, TOP_K, dtype=torch.int64))
    assert d.state is BufferState.IDLE


def test_second_notify_while_pending_is_rejected_and_cancel_retires_until_quiesce():
    layer = make_layer()
    x, idx, w = make_batch(layer, 5, 8)
    d = LocalDispatcher(Phase.PREFILL, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    n = d.notify(idx, tokens=[("r1", 0)])
    with pytest.raises(DispatchPendingError):
        d.notify(idx)
    assert d.cancel(n) and d.state is BufferState.RETIRED
    assert not d.cancel(n)                              # idempotent
    with pytest.raises(BufferRetiredError):
        d.notify(idx)
    with pytest.raises(DispatchCancelledError):
        d.dispatch(n, x, idx, w)
    with pytest.raises(DispatchCancelledError):
        asyncio.run(n.wait())
    d.quiesce()
    assert d.state is BufferState.IDLE
    assert torch.allclose(d.run_moe(x, idx, w, expert_fn_for(layer, 0)), reference(layer, x, idx, w))


def test_dispatch_and_combine_refuse_stale_or_foreign_handles():
    layer = make_layer()
    x, idx, w = make_batch(layer, 6, 8)
    p = LocalDispatcher(Phase.PREFILL, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    dd = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    n = p.notify(idx)
    with pytest.raises(DispatchStateError):
        dd.dispatch(n, x, idx, w)                       # a P dispatch on the D buffer
    disp = p.dispatch(n, x, idx, w)
    with pytest.raises(DispatchStateError):
        p.dispatch(n, x, idx, w)                        # already dispatched
    p.combine(disp, disp.x)
    with pytest.raises(DispatchStateError):
        p.combine(disp, disp.x)                         # already combined
    assert not p.cancel(n)                              # finished: nothing to retire


def test_combine_result_is_tagged_with_request_lifetimes():
    layer = make_layer()
    x, idx, w = make_batch(layer, 8, 6)
    d = LocalDispatcher(Phase.PREFILL, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    n = d.notify(idx, tokens=[("a", 1), ("b", 2)])
    disp = d.dispatch(n, x, idx, w)
    res = d.combine_tagged(disp, expert_fn_for(layer, 0)(disp.x, disp.counts))
    assert res.tokens == (("a", 1), ("b", 2))
    assert res.stale({"a": 1, "b": 3}.get) == [("b", 2)]


def test_a_failing_expert_fn_cancels_the_pending_dispatch():
    layer = make_layer()
    x, idx, w = make_batch(layer, 9, 6)
    d = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)

    def boom(xg, counts):
        raise RuntimeError("expert failed")
    with pytest.raises(RuntimeError):
        d.run_moe(x, idx, w, boom)
    assert d.state is BufferState.RETIRED
    d.quiesce()
    d.run_moe(x, idx, w, expert_fn_for(layer, 0))


def test_phase_dispatchers_are_chosen_by_the_explicit_phase_context():
    p = LocalDispatcher(Phase.PREFILL, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    d = LocalDispatcher(Phase.DECODE, NUM_EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens=8)
    pd = PhaseDispatchers(p, d)
    assert pd.get(PhaseContext(Phase.PREFILL, stream=None)) is p
    assert pd.get(Phase.DECODE) is d
    with pytest.raises(ConfigError):
        PhaseDispatchers(d, p)
    with pytest.raises(ConfigError):
        pd.get("P")


# ---- torch all-to-all over real gloo processes -------------------------------------------------
def test_ep2_dispatch_experts_combine_equals_the_ep1_result(ep2):
    for r in ep2:
        assert r["num_checks"] == 8 and r["max_err"] < 1e-5


def test_ep4_dispatch_experts_combine_equals_the_ep1_result(ep4):
    for r in ep4:
        assert r["num_checks"] == 8 and r["max_err"] < 1e-5


def test_p_and_d_dispatchers_run_concurrently_from_two_threads_with_correct_results(ep2):
    for r in ep2:
        (np_, errp), (nd, errd) = r["concurrent"]["P"], r["concurrent"]["D"]
        assert (np_, nd) == (25, 60), r["concurrent"]
        assert isinstance(errp, float) and errp < 1e-5, errp
        assert isinstance(errd, float) and errd < 1e-5, errd
    # the two phases really overlapped: D finished dispatches while P was mid-stream
    assert max(r["interleaved_D_events"] for r in ep2) > 0


def test_phase_owned_buffers_have_disjoint_addresses(ep2):
    for r in ep2:
        p = r["addresses"]["P"]
        d = r["addresses"]["D"]
        assert all(a[1] <= b[0] or b[1] <= a[0] for a in p for b in d)


def test_torch_lifecycle_rejects_second_notify_and_reuses_after_quiesce(ep2):
    for r in ep2:
        assert r["lifecycle"] == [
            "second-notify-rejected", "retired", "retired-rejected", "cancelled-dispatch-rejected",
            "idle", True, "cancelled-combine-rejected", True, [("req-a", 2)], [("req-a", 2)]]


def test_background_p_task_waits_counts_then_permit_then_moves_data(ep2):
    for r in ep2:
        t = r["trace"]
        counts = next(i for i, e in enumerate(t) if e.startswith("P.counts"))
        assert t.index("P.notify") < counts < t.index("P.permit") < t.index("P.dispatch") < t.index("P.combine")
        assert t.index("grant") < t.index("P.permit")
        # D kept running while P held its counts and waited for the permit
        assert t.index("D.iter0") < t.index("P.permit")


def test_audit_passes_for_the_real_torch_configuration(ep2):
    for r in ep2:
        a = r["audit"]
        assert a["ok"], a["violations"]
        kinds = {(o["owner"], o["kind"]) for o in a["objects"]}
        for k in ("buffer", "counters", "workspace", "stream", "events", "qp_range", "process_group"):
            assert ("P", k) in kinds and ("D", k) in kinds
        assert ("D", "double_buffer_index") in kinds
        assert a["phase_memory_bytes"] > 0 and a["phase_memory_bytes"] == a["bytes_by_owner"]["P"]


def test_audit_fails_for_a_planted_shared_counter_and_event(ep2):
    for r in ep2:
        a = r["planted"]
        assert not a["ok"]
        msgs = " ".join(v["message"] for v in a["violations"])
        assert "P.torch.send_counts" in msgs and "P.notify_done" in msgs
        assert "shared-identity" in {v["code"] for v in a["violations"]}


def test_torch_dispatcher_validates_its_group_and_sizes():
    from ainfer_pd.comm.experts.torch_a2a import TorchAllToAllDispatcher
    with pytest.raises(ConfigError):
        TorchAllToAllDispatcher(Phase.PREFILL, None, 0, 2, NUM_EXPERTS, hidden=8, top_k=2, max_tokens=4)
    with pytest.raises(ConfigError):
        TorchAllToAllDispatcher(Phase.PREFILL, object(), 0, 3, NUM_EXPERTS, hidden=8, top_k=2, max_tokens=4)


# ---- DeepEP: validation, missing package, mocked call sequence ---------------------------------
def test_deepep_missing_package_raises_backend_unavailable_pointing_to_the_doc(monkeypatch):
    from ainfer_pd.comm.experts import deepep
    monkeypatch.setitem(sys.modules, "deep_ep", None)       # import deep_ep -> ImportError
    with pytest.raises(BackendUnavailableError, match="docs/DEEPEP.md"):
        deepep.import_deep_ep()


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_ranks=1), "2, 4 or 8"),
    (dict(num_ranks=16), "2, 4 or 8"),
    (dict(hidden=1000), "hidden"),
    (dict(hidden=3072), "low-latency"),
    (dict(top_k=12), "top_k"),
    (dict(top_k=33), "top_k"),
    (dict(num_experts=250), "divisible"),
    (dict(num_experts=8 * 129), "local experts"),
    (dict(max_decode_tokens_per_rank=0), "max_decode_tokens_per_rank"),
    (dict(num_nvl_bytes=1000), "128"),
    (dict(num_qps_per_rank=3), "num_qps_per_rank"),
])
def test_deepep_config_is_validated_up_front(kwargs, match):
    from ainfer_pd.comm.experts.deepep import DeepEPConfig
    base = dict(num_experts=256, hidden=2560, top_k=8, num_ranks=8, max_decode_tokens_per_rank=128)
    with pytest.raises(ConfigError, match=match):
        DeepEPConfig(**{**base, **kwargs}).validate()


def test_deepep_valid_config_derives_qp_slices_and_local_experts():
    from ainfer_pd.comm.experts.deepep import DeepEPConfig
    cfg = DeepEPConfig(num_experts=256, hidden=2560, top_k=8, num_ranks=8, max_decode_tokens_per_rank=128)
    cfg.validate()
    assert cfg.num_local_experts == 32 and cfg.qps_per_rank == 32
    assert cfg.qp_range(Phase.DECODE) == (0, 32) and cfg.qp_range(Phase.PREFILL) == (32, 64)


@pytest.fixture
def fake_deep_ep(monkeypatch):
    fake = _FakeDeepEP()
    monkeypatch.setitem(sys.modules, "deep_ep", fake.module)
    return fake


class _FakeDeepEP:
    """Records every call of the ``deep_ep.Buffer`` V1 API the backend uses, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        fake = self

        class Config:
            def __init__(self, *args):
                self.args = args

            def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
                return 1 << 20

        class EventOverlap:
            def current_stream_wait(self):
                fake.calls.append(("event.current_stream_wait",))

        class Buffer:
            num_sms = 20

            def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                         num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                         allow_mnnvl=False, explicitly_destroy=False, comm=None):
                self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
                self.low_latency_mode = low_latency_mode
                self.runtime = object()
                # persistent device memory, like the runtime's cudaMalloc'd buffers
                self._mem = {False: torch.empty(max(num_nvl_bytes, 1), dtype=torch.uint8),
                             True: torch.empty(max(num_rdma_bytes, 1), dtype=torch.uint8)}
                self.rank, self.group_size = group.rank(), group.size()
                fake.calls.append(("Buffer", dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                                  low_latency_mode=low_latency_mode,
                                                  num_qps_per_rank=num_qps_per_rank,
                                                  explicitly_destroy=explicitly_destroy)))

            @staticmethod
            def get_dispatch_config(num_ranks):
                return Config("dispatch", num_ranks)

            @staticmethod
            def get_combine_config(num_ranks):
                return Config("combine", num_ranks)

            @staticmethod
            def get_low_latency_rdma_size_hint(m, hidden, num_ranks, num_experts):
                return 4 << 20

            def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
                return self._mem[use_rdma_buffer]

            def get_comm_stream(self):
                return types.SimpleNamespace(name=f"comm-stream-{id(self)}")

            def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                                    async_finish=False, allocate_on_comm_stream=False):
                fake.calls.append(("get_dispatch_layout", dict(num_experts=num_experts,
                                                               async_finish=async_finish,
                                                               allocate_on_comm_stream=allocate_on_comm_stream)))
                R, E = self.group_size, num_experts
                L = E // R
                is_in = torch.zeros(topk_idx.shape[0], R, dtype=torch.bool)
                valid = topk_idx >= 0
                for r in range(R):
                    is_in[:, r] = ((topk_idx // L == r) & valid).any(1)
                per_expert = torch.zeros(E, dtype=torch.int32)
                per_expert.scatter_add_(0, topk_idx[valid], torch.ones_like(topk_idx[valid], dtype=torch.int32))
                return is_in.sum(0).int(), None, per_expert, is_in, EventOverlap()

            def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                         is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                         topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                         previous_event=None, async_finish=False, allocate_on_comm_stream=False):
                fake.calls.append(("dispatch", dict(num_worst_tokens=num_worst_tokens,
                                                    expert_alignment=expert_alignment,
                                                    config=config.args, handle=handle,
                                                    async_finish=async_finish)))
                # single-rank loopback: this rank "receives" its own tokens for its experts
                L = num_tokens_per_expert.numel() // self.group_size
                lo = self.rank * L
                keep = is_token_in_rank[:, self.rank]
                rx, ri, rw = x[keep], topk_idx[keep].clone(), topk_weights[keep]
                mine = (ri >= lo) & (ri < lo + L)
                ri = torch.where(mine, ri - lo, torch.full_like(ri, -1))
                pad = num_worst_tokens - rx.shape[0]
                if pad > 0:
                    rx = torch.cat([rx, rx.new_zeros(pad, rx.shape[1])])
                    ri = torch.cat([ri, ri.new_full((pad, ri.shape[1]), -1)])
                    rw = torch.cat([rw, rw.new_zeros(pad, rw.shape[1])])
                return rx, ri, rw, [], ("handle", keep), EventOverlap()

            def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                        previous_event=None, async_finish=False, allocate_on_comm_stream=False):
                fake.calls.append(("combine", dict(config=config.args, handle=handle[0])))
                keep = handle[1]
                out = x.new_zeros(keep.shape[0], x.shape[1])
                out[keep] = x[: int(keep.sum())]
                return out, None, EventOverlap()

            def clean_low_latency_buffer(self, m, hidden, num_experts):
                fake.calls.append(("clean_low_latency_buffer", (m, hidden, num_experts)))

            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats=None,
                                     dispatch_wait_recv_cost_stats=None, use_fp8=True,
                                     round_scale=False, use_ue8m0=False, async_finish=False,
                                     return_recv_hook=False):
                fake.calls.append(("low_latency_dispatch",
                                   dict(m=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
                                        use_fp8=use_fp8, async_finish=async_finish,
                                        return_recv_hook=return_recv_hook)))
                R = self.group_size
                L = num_experts // R
                cap = num_max_dispatch_tokens_per_rank * R
                recv = x.new_zeros(L, cap, x.shape[1])
                count = torch.zeros(L, dtype=torch.int32)
                src = []
                for t in range(x.shape[0]):
                    for e in topk_idx[t].tolist():
                        if e >= 0 and e // L == self.rank:
                            l = e - self.rank * L
                            recv[l, count[l]] = x[t]
                            src.append((l, int(count[l]), t))
                            count[l] += 1
                handle = (src, None, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
                return recv, count, handle, EventOverlap(), lambda: fake.calls.append(("dispatch_hook",))

            def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                                    zero_copy=False, async_finish=False, return_recv_hook=False,
                                    out=None, combine_wait_recv_cost_stats=None):
                fake.calls.append(("low_latency_combine", dict(async_finish=async_finish,
                                                               return_recv_hook=return_recv_hook)))
                src, L = handle[0], x.shape[0]
                res = x.new_zeros(topk_idx.shape[0], x.shape[2])
                for l, slot, t in src:
                    k = (topk_idx[t] == self.rank * L + l).nonzero()[0, 0]
                    res[t] += topk_weights[t, k] * x[l, slot]
                return res, EventOverlap(), lambda: fake.calls.append(("combine_hook",))

            def destroy(self):
                fake.calls.append(("destroy", self.low_latency_mode))

        self.module = types.ModuleType("deep_ep")
        self.module.Buffer = Buffer
        self.module.Config = Config
        self.module.EventOverlap = EventOverlap

    def names(self):
        return [c[0] for c in self.calls]


class _FakeGroup:
    def __init__(self, rank=0, size=2):
        self._r, self._s = rank, size

    def rank(self):
        return self._r

    def size(self):
        return self._s


def _deepep_cfg(**kw):
    from ainfer_pd.comm.experts.deepep import DeepEPConfig
    base = dict(num_experts=8, hidden=2048, top_k=2, num_ranks=2, max_decode_tokens_per_rank=8)
    return DeepEPConfig(**{**base, **kw})


def _deepep_layer(hidden):
    g = torch.Generator().manual_seed(5)
    return {"w1": torch.randn(8, hidden, 8, generator=g) * 0.02,
            "w3": torch.randn(8, hidden, 8, generator=g) * 0.02,
            "w2": torch.randn(8, 8, hidden, generator=g) * 0.02}


def _swiglu(layer, e, h):
    return (F.silu(h @ layer["w1"][e]) * (h @ layer["w3"][e])) @ layer["w2"][e]


def _rank0_reference(layer, x, idx, w):
    """Loopback fake: rank 0 of 2 only hears itself, so only experts 0..3 contribute."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < 4:
                out[t] += w[t, k] * _swiglu(layer, e, x[t:t + 1])[0]
    return out


def test_deepep_normal_p_path_calls_the_v1_api_in_order_split_at_notification(fake_deep_ep):
    from ainfer_pd.comm.experts.deepep import DeepEPNormalDispatcher
    cfg = _deepep_cfg()
    sent = {}

    def loopback(send):            # the counts exchange: rank 0 only hears itself
        sent["send"] = send.clone()
        recv = torch.zeros_like(send)
        recv[0] = send[0]
        return (lambda: True), (lambda: recv)

    disp = DeepEPNormalDispatcher(_FakeGroup(0, 2), cfg, deep_ep=fake_deep_ep.module,
                                  counts_exchange=loopback)
    layer = _deepep_layer(cfg.hidden)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, cfg.hidden, generator=g).bfloat16().float()
    idx = torch.tensor([[0, 5], [1, 2], [6, 7], [3, 3 - 3], [4, 0], [2, -1]])
    w = torch.rand(6, 2, generator=g)

    n = disp.notify(idx, tokens=[("r", 1)])
    assert fake_deep_ep.names() == ["Buffer", "get_dispatch_layout"]   # nothing moved yet
    counts = asyncio.run(n.wait())
    assert sent["send"].shape == (2, 1 + 4)
    in_rank0 = int(((idx >= 0) & (idx < 4)).any(1).sum())
    assert counts.per_source == (in_rank0, 0)
    d = disp.dispatch(n, x.bfloat16(), idx, w)
    assert fake_deep_ep.calls[-1][1]["num_worst_tokens"] == in_rank0      # no CPU busy-poll
    assert fake_deep_ep.calls[-1][1]["config"] == ("dispatch", 2)
    assert d.counts.tolist() == [int((idx == e).sum()) for e in range(4)]

    def experts(xg, c):
        out, s = torch.zeros_like(xg), 0
        for l, m in enumerate(c.tolist()):
            out[s:s + m] = _swiglu(layer, l, xg[s:s + m].float()).to(xg.dtype)
            s += m
        return out
    out = disp.combine(d, experts(d.x, d.counts))
    assert fake_deep_ep.names() == ["Buffer", "get_dispatch_layout", "dispatch", "combine"]
    buf = fake_deep_ep.calls[0][1]
    assert buf["num_nvl_bytes"] > 0 and buf["num_rdma_bytes"] == 0 and not buf["low_latency_mode"]
    assert buf["explicitly_destroy"]
    assert fake_deep_ep.calls[-1][1]["config"] == ("combine", 2)
    assert torch.allclose(out.float(), _rank0_reference(layer, x, idx, w), atol=2e-2, rtol=2e-2)
    disp.close()
    assert fake_deep_ep.names()[-1] == "destroy"


def test_deepep_low_latency_d_path_uses_recv_hooks_and_cleans_after_a_cancel(fake_deep_ep):
    from ainfer_pd.comm.experts.deepep import DeepEPLowLatencyDispatcher
    cfg = _deepep_cfg()
    disp = DeepEPLowLatencyDispatcher(_FakeGroup(0, 2), cfg, deep_ep=fake_deep_ep.module)
    buf = fake_deep_ep.calls[0][1]
    assert buf == dict(num_nvl_bytes=0, num_rdma_bytes=4 << 20, low_latency_mode=True,
                       num_qps_per_rank=4, explicitly_destroy=True)
    layer = _deepep_layer(cfg.hidden)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, cfg.hidden, generator=g).bfloat16()
    idx = torch.tensor([[0, 4], [1, 3], [5, 6], [2, 0], [3, 7]])
    w = torch.rand(5, 2, generator=g)

    def masked_experts(xm, counts):   # [L, C, H] masked layout
        out = torch.zeros_like(xm)
        for l, m in enumerate(counts.tolist()):
            out[l, :m] = _swiglu(layer, l, xm[l, :m].float()).to(xm.dtype)
        return out
    dbi = disp._dbi.value
    out = disp.run_moe(x, idx, w, masked_experts)
    assert fake_deep_ep.names()[1:] == ["low_latency_dispatch", "dispatch_hook",
                                        "low_latency_combine", "combine_hook"]
    ll = fake_deep_ep.calls[1][1]
    assert ll == dict(m=8, num_experts=8, use_fp8=False, async_finish=False, return_recv_hook=True)
    assert fake_deep_ep.calls[3][1] == dict(async_finish=False, return_recv_hook=True)
    assert disp._dbi.value == dbi                     # two flips: dispatch + combine
    assert torch.allclose(out.float(), _rank0_reference(layer, x.float(), idx, w), atol=2e-2, rtol=2e-2)
    # a cancelled D dispatch: the buffer is cleaned at the quiescent point, then reused
    n = disp.notify(idx)
    disp.cancel(n)
    disp.quiesce()
    assert fake_deep_ep.calls[-1] == ("clean_low_latency_buffer", (8, 2048, 8))
    disp.run_moe(x, idx, w, masked_experts)
    with pytest.raises(ConfigError):
        disp.notify(torch.zeros(9, 2, dtype=torch.int64))    # > max_decode_tokens_per_rank


def test_deepep_pair_audits_clean_with_disjoint_qp_slices(fake_deep_ep):
    from ainfer_pd.comm.experts.deepep import deepep_shared_objects, make_deepep_dispatchers
    cfg = _deepep_cfg()
    with pytest.raises(ConfigError):
        make_deepep_dispatchers(g := _FakeGroup(0, 2), g, cfg, deep_ep=fake_deep_ep.module)
    pd = make_deepep_dispatchers(_FakeGroup(0, 2), _FakeGroup(0, 2), cfg, deep_ep=fake_deep_ep.module)
    kinds = [c[1]["low_latency_mode"] for c in fake_deep_ep.calls if c[0] == "Buffer"]
    assert kinds == [False, True]                      # one NVSHMEM init: the D buffer only
    report = pd.registry(deepep_shared_objects(fake_deep_ep.module)).audit(strict=True)
    qps = {o.owner: o.qp_range for o in report.objects if o.kind == "qp_range"}
    assert qps == {Phase.DECODE: (0, 4), Phase.PREFILL: (4, 8)}
    assert report.phase_memory_bytes >= pd.prefill.num_nvl_bytes


def test_deepep_rejects_fp32_activations_and_wrong_group_size(fake_deep_ep):
    from ainfer_pd.comm.experts.deepep import DeepEPLowLatencyDispatcher
    with pytest.raises(ConfigError):
        DeepEPLowLatencyDispatcher(_FakeGroup(0, 4), _deepep_cfg(), deep_ep=fake_deep_ep.module)
    disp = DeepEPLowLatencyDispatcher(_FakeGroup(0, 2), _deepep_cfg(), deep_ep=fake_deep_ep.module)
    idx = torch.zeros(2, 2, dtype=torch.int64)
    n = disp.notify(idx)
    with pytest.raises(ConfigError):
        disp.dispatch(n, torch.zeros(2, 2048), idx, torch.ones(2, 2))


def _rank_peer_dies(rank, world):
    """One clean EP=2 round, then rank 1 exits; rank 0's next P dispatch meets the dead peer."""
    import os

    from ainfer_pd.errors import CollectiveFailedError
    layer = make_layer()
    pd = _make_torch_dispatchers(rank, world)
    x, idx, w = make_batch(layer, 7 + rank, 12)
    _max_err(pd.get(Phase.PREFILL), layer, x, idx, w)
    torch.distributed.barrier()
    if rank == 1:
        os._exit(0)                                    # dies without closing anything
    try:
        _max_err(pd.get(Phase.PREFILL), layer, x, idx, w)
    except CollectiveFailedError as exc:
        return {"typed": True, "ranks": exc.group_ranks, "msg": str(exc), "cause": type(exc.__cause__).__name__}
    except BaseException as exc:                       # noqa: BLE001 - the test reports what came
        return {"typed": False, "msg": repr(exc)}
    return {"typed": False, "msg": "no error"}


def test_a_dead_peer_fails_the_expert_exchange_with_a_typed_error_naming_the_group():
    """gloo raises a bare RuntimeError when a peer closed its connection; the dispatcher turns
    it into CollectiveFailedError naming the phase, the exchange and the group's ranks."""
    from tests._dist_util import run_ranks
    res = run_ranks(_rank_peer_dies, 2, timeout_s=90, return_exceptions=True)
    r0 = res[0]
    assert r0["typed"], r0
    assert r0["ranks"] == (0, 1) and "rank 0: P expert" in r0["msg"] and "[0, 1]" in r0["msg"], r0
    assert r0["cause"].endswith("Error"), r0
