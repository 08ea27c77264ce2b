"""Ownership registry and audit (SPEC §3.4): P and D state must be disjoint."""
from __future__ import annotations

import json

import pytest
import torch

from ainfer_pd.comm.experts import LocalDispatcher, OwnershipRegistry, PhaseDispatchers, SHARED
from ainfer_pd.comm.experts.base import HostEvent, HostStream
from ainfer_pd.comm.experts.ownership import REQUIRED_KINDS, tensor_range
from ainfer_pd.errors import ConfigError, OwnershipAuditError
from ainfer_pd.phase import Phase

P, D = Phase.PREFILL, Phase.DECODE


def _local_pair(**kw) -> PhaseDispatchers:
    mk = dict(hidden=16, top_k=2, max_tokens=8, **kw)
    return PhaseDispatchers(LocalDispatcher(P, 4, **mk), LocalDispatcher(D, 4, **mk))


def _complete_phase(reg: OwnershipRegistry, phase: Phase, qp: tuple[int, int]) -> dict:
    objs = {"buffer": torch.empty(64), "counters": torch.zeros(4, dtype=torch.int64),
            "workspace": torch.empty(16, dtype=torch.int64), "stream": HostStream(phase.value),
            "events": HostEvent(phase.value), "double_buffer_index": object()}
    for kind in REQUIRED_KINDS[phase]:
        if kind == "qp_range":
            reg.register(kind, f"{phase.value}.qps", phase, identity=hash((phase, "qp")), qp_range=qp)
        else:
            reg.register(kind, f"{phase.value}.{kind}", phase, objs[kind])
    return objs


def _codes(report) -> set[str]:
    return {v.code for v in report.violations}


def test_a_complete_disjoint_registration_passes_and_reports_phase_memory():
    reg = OwnershipRegistry()
    p = _complete_phase(reg, P, (8, 16))
    _complete_phase(reg, D, (0, 8))
    reg.register("weights", "w", SHARED, torch.empty(10))
    reg.register("runtime", "nvshmem", SHARED, identity=1)
    report = reg.audit(strict=True)
    assert report.ok and not report.violations
    expect_p = sum(t.numel() * t.element_size() for k, t in p.items() if k in ("buffer", "counters", "workspace"))
    assert report.phase_memory_bytes == expect_p
    assert report.both_phases_bytes == 2 * expect_p
    d = report.to_dict()
    json.dumps(d)                                        # goes into the JSONL run trace
    assert d["ok"] and d["phase_memory_bytes"] == expect_p and d["num_objects"] == len(report.objects)


def test_a_counter_shared_by_both_phases_fails_the_audit():
    reg = OwnershipRegistry()
    p = _complete_phase(reg, P, (8, 16))
    _complete_phase(reg, D, (0, 8))
    reg.register("counters", "D.counters(planted)", D, p["counters"])
    report = reg.audit()
    assert not report.ok and "shared-identity" in _codes(report)
    with pytest.raises(OwnershipAuditError, match="counters"):
        reg.audit(strict=True)


def test_an_event_shared_by_both_phases_fails_the_audit():
    reg = OwnershipRegistry()
    p = _complete_phase(reg, P, (8, 16))
    _complete_phase(reg, D, (0, 8))
    reg.register("events", "D.events(planted)", D, p["events"])
    assert "shared-identity" in _codes(reg.audit())


def test_separate_buffer_objects_over_overlapping_memory_fail_the_audit():
    reg = OwnershipRegistry()
    big = torch.empty(128)
    _complete_phase(reg, P, (8, 16))
    _complete_phase(reg, D, (0, 8))
    reg.register("buffer", "P.slice", P, big[:70])
    reg.register("buffer", "D.slice", D, big[64:])       # different tensors, 6 elements alias
    report = reg.audit()
    assert _codes(report) == {"address-overlap"}
    reg2 = OwnershipRegistry()
    reg2.register("buffer", "P.slice", P, big[:64])
    reg2.register("buffer", "D.slice", D, big[64:])      # adjacent, no overlap
    assert "address-overlap" not in _codes(reg2.audit())


def test_overlapping_qp_ranges_fail_and_empty_ranges_never_overlap():
    reg = OwnershipRegistry()
    _complete_phase(reg, P, (6, 12))
    _complete_phase(reg, D, (0, 8))
    assert _codes(reg.audit()) == {"qp-overlap"}
    reg = OwnershipRegistry()
    _complete_phase(reg, P, (3, 3))
    _complete_phase(reg, D, (0, 8))
    assert reg.audit().ok


def test_a_mutable_object_in_the_shared_set_fails_the_audit():
    reg = OwnershipRegistry()
    _complete_phase(reg, P, (8, 16))
    _complete_phase(reg, D, (0, 8))
    reg.register("counters", "global recv counter", SHARED, torch.zeros(1))
    reg.register("weights", "P-private weights copy", P, torch.zeros(1))
    assert _codes(reg.audit()) == {"mutable-shared", "bad-owner"}


def test_a_phase_missing_a_kind_of_the_table_fails_the_audit():
    reg = OwnershipRegistry()
    _complete_phase(reg, P, (8, 16))
    reg.register("buffer", "D.only-a-buffer", D, torch.empty(4))
    report = reg.audit()
    missing = {v.message for v in report.violations if v.code == "missing-kind"}
    assert any("double_buffer_index" in m for m in missing) and any("'stream'" in m for m in missing)
    assert reg.audit(phases=(P,)).ok                      # a P-only audit


def test_registration_rejects_bad_owners_and_missing_identity():
    reg = OwnershipRegistry()
    with pytest.raises(ConfigError):
        reg.register("buffer", "x", "P", torch.empty(1))
    with pytest.raises(ConfigError):
        reg.register("buffer", "x", P)


def test_tensor_range_spans_strided_views():
    t = torch.empty(4, 6)
    assert tensor_range(t) == (t.data_ptr(), t.data_ptr() + 24 * 4)
    col = t[:, 1]
    assert tensor_range(col) == (col.data_ptr(), col.data_ptr() + (3 * 6 + 1) * 4)
    assert tensor_range(torch.empty(0)) is None


def test_local_p_and_d_dispatchers_own_disjoint_state():
    pd = _local_pair()
    report = pd.registry().audit(strict=True)
    kinds_d = {o.kind for o in report.objects if o.owner is D}
    assert set(REQUIRED_KINDS[D]) <= kinds_d
    assert report.phase_memory_bytes > 0


def test_one_stream_or_event_passed_to_both_local_dispatchers_fails_the_audit():
    shared_stream = HostStream("one stream for both")
    pd = PhaseDispatchers(LocalDispatcher(P, 4, hidden=8, top_k=2, max_tokens=4, stream=shared_stream),
                          LocalDispatcher(D, 4, hidden=8, top_k=2, max_tokens=4, stream=shared_stream))
    report = pd.registry().audit()
    assert not report.ok
    assert any("P.stream" in v.message and "D.stream" in v.message for v in report.violations)
