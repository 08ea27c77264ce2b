"""DeepEP backend over the real ``deep_ep.Buffer`` V1 API (DeepEP 1.2.x; GPU hosts only).

Shape legend: T = tokens on this rank, k = top-k, H = hidden, E = experts, R = EP ranks,
L = E / R local experts, M = ``num_max_dispatch_tokens_per_rank`` (D), C = M * R.

Ownership (SPEC §3.4; see docs/DEEPEP.md):

- P owns a **normal intranode** ``Buffer(group_P, num_nvl_bytes>0, num_rdma_bytes=0)``: it
  never initialises NVSHMEM; its NVL buffer, host-mapped ``moe_recv_counter``s, 32 MiB
  workspace and comm stream are its own. P's QP slice ``[s, 2s)`` is reserved (intranode
  normal kernels move data over NVLink IPC, not QPs).
- D owns a **low-latency** ``Buffer(group_D, num_rdma_bytes>0, low_latency_mode=True,
  num_qps_per_rank=s)``: the one NVSHMEM initialisation, its RDMA buffer (with the two
  halves selected by the double-buffer index), its counters and workspace, QPs ``[0, s)``.
  ``low_latency_dispatch/combine(..., return_recv_hook=True)`` launch on the caller's (D
  graph) stream, so they are capturable in the D CUDA graph.
- Shared: NVSHMEM runtime + its process-global env vars, ``Buffer.num_sms`` (a class-level
  static), topology, links, weights, KV storage.

**Split at notification with the V1 API.** Upstream normal ``dispatch`` runs the notify
kernel and then busy-polls the host-mapped ``moe_recv_counter`` inside one call, so the
call cannot stop between "peers know the shape" and "data moves". This backend realises the
split without patching DeepEP:

1. ``notify``: ``get_dispatch_layout`` (local) and an async ``all_to_all`` of the
   ``[R, 1 + L]`` per-rank / per-expert counts over P's own process group (P's
   notification: peers learn the dispatch shape; nothing else moves).
2. ``Notified.wait``: the counts wait, on the P task's worker thread (never on the loop).
3. ``dispatch`` (after the turnstile permit): ``Buffer.dispatch(..., num_worst_tokens=R_recv)``
   with the exact receive count from step 2, which skips upstream's CPU busy-poll; the
   device-side notify inside it is a short NVLink barrier all ranks reach in the same
   turnstile round. (An upstream change — exposing ``notify_dispatch`` and a cached-layout
   data launch as two calls — would remove the duplicated counts exchange.)

The module imports ``deep_ep`` lazily; without it every constructor raises
:class:`BackendUnavailableError` pointing to docs/DEEPEP.md. Sizes are validated up front
(:class:`DeepEPConfig`) against the limits of the upstream kernels, cited per constant.

Modules: :mod:`.deepep_buffer` (limits, :class:`DeepEPConfig`, the Buffer + ownership part),
:mod:`.deepep_normal` (P), :mod:`.deepep_low_latency` (D); every name is re-exported here.
:mod:`.deepep_check` is the multi-GPU check (``python -m ainfer_pd.comm.experts.deepep_check``),
which imports this module (never the reverse).
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .base import PhaseDispatchers
from .deepep_buffer import (BUFFER_ALIGNMENT_BYTES, INTRANODE_RANKS, LL_HIDDEN_SIZES,  # noqa: F401
                            MAX_LOCAL_EXPERTS_NORMAL, MAX_TOPK_LOW_LATENCY, MAX_TOPK_NORMAL,
                            WORKSPACE_BYTES, DeepEPConfig, DeepEPDispatcherBase, import_deep_ep)
from .deepep_low_latency import DeepEPLowLatencyDispatcher
from .deepep_normal import CountsExchange, DeepEPNormalDispatcher, torch_counts_exchange  # noqa: F401
from .ownership import SHARED, OwnedObject, OwnershipRegistry


def make_deepep_dispatchers(p_group: Any, d_group: Any, cfg: DeepEPConfig, *,
                            deep_ep: Any = None, d_stream: Any = None,
                            recorder: Any = None) -> PhaseDispatchers:
    """P normal intranode Buffer (no NVSHMEM) + D low-latency Buffer (the one NVSHMEM init)."""
    cfg.validate()
    if p_group is d_group:
        raise ConfigError("P and D need their own process groups (phase-owned communicators)")
    de = deep_ep if deep_ep is not None else import_deep_ep()
    p = DeepEPNormalDispatcher(p_group, cfg, deep_ep=de, recorder=recorder)
    d = DeepEPLowLatencyDispatcher(d_group, cfg, deep_ep=de, stream=d_stream, recorder=recorder)
    return PhaseDispatchers(p, d)


def deepep_shared_objects(deep_ep: Any) -> list[OwnedObject]:
    """What both phases share by design: the NVSHMEM runtime (+ process-global env) and
    the class-level ``Buffer.num_sms``."""
    reg = OwnershipRegistry()
    reg.register("runtime", "nvshmem runtime + NVSHMEM_* env (process-global)", SHARED,
                 identity=hash("nvshmem-runtime"))
    reg.register("runtime", "deep_ep.Buffer.num_sms (class static)", SHARED, deep_ep.Buffer)
    return list(reg.objects)
