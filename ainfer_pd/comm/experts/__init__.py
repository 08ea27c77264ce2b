"""Expert-parallel dispatch backends with phase-owned communication state (SPEC §3.4).

- :mod:`.base`       interface (notify / dispatch / combine), lifecycle, ``PhaseDispatchers``
- :mod:`.handles`    one dispatch's handles (``Notified``, ``Dispatched``, ``RecvCounts`` ...)
- :mod:`.stand_ins`  CPU stand-ins of a phase's stream / events, D's double-buffer index
- :mod:`.local`      world size 1: local routing, CUDA-graph capturable
- :mod:`.torch_a2a`  ``torch.distributed`` all-to-all (gloo / NCCL), one group per phase
- :mod:`.deepep`     DeepEP V1 ``Buffer``: P normal intranode, D low-latency (GPU hosts)
- :mod:`.ownership`  registry + audit of who owns which mutable object

``deepep`` is imported lazily (it needs the optional ``deep_ep`` package).
"""
from .base import (BaseDispatcher, BufferState, CombineResult, Dispatched, ExpertDispatcher,
                   ExpertFn, HostEvent, HostStream, LifetimeToken, Notified, PhaseDispatchers,
                   RecvCounts)
from .local import LocalDispatcher
from .ownership import (SHARED, AuditReport, OwnedObject, OwnershipRegistry, Violation,
                        tensor_range)

__all__ = [
    "AuditReport", "BaseDispatcher", "BufferState", "CombineResult", "Dispatched",
    "ExpertDispatcher", "ExpertFn", "HostEvent", "HostStream", "LifetimeToken", "LocalDispatcher",
    "Notified", "OwnedObject", "OwnershipRegistry", "PhaseDispatchers", "RecvCounts", "SHARED",
    "Violation", "tensor_range",
]
