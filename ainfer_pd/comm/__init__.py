"""Communication: rank topology and process groups (``topology``), phase-identified attention
collectives (``collectives``) and expert dispatch backends (``experts``)."""
from .topology import (ATTN_DP_D, ATTN_TP_P, CONTROL, EP_D, EP_P, ETP_D, ETP_P, WORLD, GroupSpec,
                       Topology, build_process_groups, dp_groups, ep_groups, etp_groups, group_specs,
                       groups_cross, tp_groups, validate_dims)

__all__ = [
    "ATTN_DP_D", "ATTN_TP_P", "CONTROL", "EP_D", "EP_P", "ETP_D", "ETP_P", "WORLD", "GroupSpec",
    "Topology", "build_process_groups", "dp_groups", "ep_groups", "etp_groups", "group_specs",
    "groups_cross", "tp_groups", "validate_dims",
]
