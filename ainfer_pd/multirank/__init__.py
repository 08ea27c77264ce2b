"""Multi-rank ordering: phase-identified attention collectives, the conflicting-pair registry
and stream routing (SPEC 3.3), the progress watchdog and the multi-rank harness that shows the
crossed-order hazard of SPEC 2 and its fix with real processes (gloo)."""
from .ordering import (C_STREAM, D_ADP_ALL_GATHER, D_ADP_REDUCE_SCATTER, D_STREAM, ORDERINGS, P_ATP_ALL_REDUCE,
                       P_STREAM, CollectiveKind, ConflictRegistry, collective_stream)

__all__ = ["C_STREAM", "D_ADP_ALL_GATHER", "D_ADP_REDUCE_SCATTER", "D_STREAM", "ORDERINGS", "P_ATP_ALL_REDUCE",
           "P_STREAM", "CollectiveKind", "ConflictRegistry", "collective_stream"]
