"""Rank topology: world size ``g``, attention-DP width ``d``, expert-parallel width ``e``.

Layout (SPEC section 2; the SGLang convention):

* attention-TP groups (``ATP = g / d`` ranks each) are **contiguous blocks**: replica ``k`` owns
  ranks ``[k*ATP, (k+1)*ATP)``; ``dp_rank = rank // ATP`` and ``tp_rank = rank % ATP``.
  g=4, d=2: TP {0,1}, {2,3}.
* DP-attention groups join the ranks with the **same TP index across replicas** (stride ATP):
  g=4, d=2: {0,2}, {1,3}. These cross the TP groups when ``ATP > 1`` and ``ADP > 1``.
* expert-TP groups (``ETP = g / e`` ranks each) are contiguous blocks; expert-parallel groups
  join the ranks with the same ETP index (stride ETP): ``ep_rank = rank // ETP``.
  g=8, e=8: one EP group of all ranks, ETP groups are singletons.

Everything here is pure except :func:`build_process_groups`, which creates the real
``torch.distributed`` groups. ``new_group`` is a collective over the default group: every
rank must create every group, in the same order, even the groups it is not a member of.
:func:`group_specs` is that one global order.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

from ..errors import TopologyError

Group = tuple[int, ...]

# Names of the groups build_process_groups returns (one per phase where the phase owns it).
CONTROL = "control"          # gloo, all ranks: the turnstile rendezvous (CPU only)
REPLICA = "replica"          # gloo, one attention-DP replica (its TP ranks): the leader's step broadcast
ATTN_TP_P = "attn_tp.P"      # P: full attention-TP all-reduce (eager)
ATTN_TP_D = "attn_tp.D"      # D: its own attention-TP all-reduce (inside the D iteration / graph)
ATTN_DP_D = "attn_dp.D"      # D: DP-attention reduce-scatter / all-gather (graph replay)
EP_P, EP_D = "ep.P", "ep.D"  # phase-owned expert-parallel communicators (SPEC 3.4)
ETP_P, ETP_D = "etp.P", "etp.D"
WORLD = "world"              # the default group (not created; included for convenience)

# kind of each family: which member list of the topology it uses
_FAMILIES: tuple[tuple[str, str, str], ...] = (
    # (name, member-list family, backend kind: "ctrl" = always gloo, "data" = data backend)
    (CONTROL, "world", "ctrl"),
    (REPLICA, "tp", "ctrl"),
    (ATTN_TP_P, "tp", "data"),
    (ATTN_TP_D, "tp", "data"),
    (ATTN_DP_D, "dp", "data"),
    (EP_P, "ep", "data"),
    (EP_D, "ep", "data"),
    (ETP_P, "etp", "data"),
    (ETP_D, "etp", "data"),
)


def _check_positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise TopologyError(f"{name} must be a positive integer, got {v!r}")
    return v


def validate_dims(world_size: int, attn_dp: int, expert_parallel: int) -> None:
    """Raise :class:`TopologyError` unless ``d | g`` and ``e | g`` with positive integers."""
    g = _check_positive_int("world_size", world_size)
    d = _check_positive_int("attn_dp", attn_dp)
    e = _check_positive_int("expert_parallel", expert_parallel)
    if g % d:
        raise TopologyError(f"world_size={g} is not divisible by attn_dp={d} (ATP = g/d must be an integer)")
    if g % e:
        raise TopologyError(f"world_size={g} is not divisible by expert_parallel={e} "
                            f"(ETP = g/e must be an integer)")


# ------------------------------------------------------------------ pure group lists
def tp_groups(world_size: int, attn_dp: int) -> list[Group]:
    """All attention-TP groups, replica order: contiguous blocks of ATP ranks."""
    validate_dims(world_size, attn_dp, 1)
    atp = world_size // attn_dp
    return [tuple(range(k * atp, (k + 1) * atp)) for k in range(attn_dp)]


def dp_groups(world_size: int, attn_dp: int) -> list[Group]:
    """All DP-attention groups, TP-index order: same TP index across replicas (stride ATP)."""
    validate_dims(world_size, attn_dp, 1)
    atp = world_size // attn_dp
    return [tuple(i + k * atp for k in range(attn_dp)) for i in range(atp)]


def etp_groups(world_size: int, expert_parallel: int) -> list[Group]:
    """All expert-TP groups: contiguous blocks of ETP ranks."""
    validate_dims(world_size, 1, expert_parallel)
    etp = world_size // expert_parallel
    return [tuple(range(k * etp, (k + 1) * etp)) for k in range(expert_parallel)]


def ep_groups(world_size: int, expert_parallel: int) -> list[Group]:
    """All expert-parallel groups: same ETP index across ETP blocks (stride ETP)."""
    validate_dims(world_size, 1, expert_parallel)
    etp = world_size // expert_parallel
    return [tuple(j + k * etp for k in range(expert_parallel)) for j in range(etp)]


def groups_cross(a: list[Group], b: list[Group]) -> bool:
    """True when some group of ``a`` and some group of ``b`` share >= 1 rank while neither
    contains the other: the two communicator families can close a device-order cycle."""
    for x in a:
        sx = set(x)
        for y in b:
            sy = set(y)
            inter = sx & sy
            if inter and not (sx <= sy or sy <= sx):
                return True
    return False


@dataclass(frozen=True, slots=True)
class Topology:
    """One rank's coordinates and the member lists of its groups (all tuples of global ranks)."""

    world_size: int
    attn_dp: int
    expert_parallel: int
    rank: int

    def __post_init__(self) -> None:
        validate_dims(self.world_size, self.attn_dp, self.expert_parallel)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise TopologyError(f"rank={self.rank!r} outside [0, world_size={self.world_size})")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_config(cls, parallel_cfg: Any, rank: int) -> "Topology":
        """From a :class:`~ainfer_pd.config.ParallelConfig` (re-validated here)."""
        return cls(world_size=parallel_cfg.world_size, attn_dp=parallel_cfg.attn_dp,
                   expert_parallel=parallel_cfg.expert_parallel, rank=rank)

    def for_rank(self, rank: int) -> "Topology":
        return Topology(self.world_size, self.attn_dp, self.expert_parallel, rank)

    # ---------------------------------------------------------------- widths
    @property
    def atp(self) -> int:
        return self.world_size // self.attn_dp

    @property
    def adp(self) -> int:
        return self.attn_dp

    @property
    def etp(self) -> int:
        return self.world_size // self.expert_parallel

    @property
    def ep(self) -> int:
        return self.expert_parallel

    @property
    def crossed(self) -> bool:
        """ATP > 1 and ADP > 1: the P TP groups and the D DP-attention groups intersect."""
        return self.atp > 1 and self.attn_dp > 1

    # ---------------------------------------------------------------- coordinates
    @property
    def dp_rank(self) -> int:
        """Attention-DP replica index of this rank."""
        return self.rank // self.atp

    @property
    def tp_rank(self) -> int:
        """Index inside the attention-TP group (= index of the DP-attention group)."""
        return self.rank % self.atp

    @property
    def is_replica_leader(self) -> bool:
        """This rank owns its replica's requests (tp_rank 0)."""
        return self.tp_rank == 0

    @property
    def replica_leader(self) -> int:
        """Global rank of this replica's leader."""
        return self.dp_rank * self.atp

    @property
    def ep_rank(self) -> int:
        """Index inside the expert-parallel group (= index of the ETP block)."""
        return self.rank // self.etp

    @property
    def etp_rank(self) -> int:
        """Index inside the expert-TP group (= index of the EP group)."""
        return self.rank % self.etp

    # ---------------------------------------------------------------- this rank's groups
    @property
    def tp_group(self) -> Group:
        return self.all_tp_groups()[self.dp_rank]

    @property
    def dp_group(self) -> Group:
        return self.all_dp_groups()[self.tp_rank]

    @property
    def ep_group(self) -> Group:
        return self.all_ep_groups()[self.etp_rank]

    @property
    def etp_group(self) -> Group:
        return self.all_etp_groups()[self.ep_rank]

    @property
    def world_group(self) -> Group:
        return tuple(range(self.world_size))

    # ---------------------------------------------------------------- all groups
    def all_tp_groups(self) -> list[Group]:
        return tp_groups(self.world_size, self.attn_dp)

    def all_dp_groups(self) -> list[Group]:
        return dp_groups(self.world_size, self.attn_dp)

    def all_ep_groups(self) -> list[Group]:
        return ep_groups(self.world_size, self.expert_parallel)

    def all_etp_groups(self) -> list[Group]:
        return etp_groups(self.world_size, self.expert_parallel)

    def replica_ranks(self, dp_rank: int) -> Group:
        """Ranks of attention-DP replica ``dp_rank`` (its TP group)."""
        return self.all_tp_groups()[dp_rank]

    def describe(self) -> str:
        return (f"g={self.world_size} ADP={self.attn_dp} ATP={self.atp} EP={self.ep} ETP={self.etp}"
                f"{' crossed' if self.crossed else ''}; rank {self.rank}: dp_rank={self.dp_rank} "
                f"tp={self.tp_group} dp={self.dp_group} ep={self.ep_group} etp={self.etp_group}")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One ``new_group`` call of the global creation order."""

    name: str              # family name, e.g. "attn_tp.P"
    index: int             # index of this group inside its family
    ranks: Group
    kind: str              # "ctrl" (always gloo) or "data" (the data backend)


def group_specs(topology: Topology) -> list[GroupSpec]:
    """Every group of the topology in the one global creation order (identical on all ranks)."""
    fams = {
        "world": [topology.world_group],
        "tp": topology.all_tp_groups(),
        "dp": topology.all_dp_groups(),
        "ep": topology.all_ep_groups(),
        "etp": topology.all_etp_groups(),
    }
    out: list[GroupSpec] = []
    for name, fam, kind in _FAMILIES:
        for i, ranks in enumerate(fams[fam]):
            out.append(GroupSpec(name, i, ranks, kind))
    return out


def build_process_groups(topology: Topology, backend: str = "gloo", *,
                         control_timeout_s: float | None = None,
                         data_timeout_s: float | None = None) -> dict[str, Any]:
    """Create every group of :func:`group_specs` (collective over the default group) and
    return ``{name: group}`` for the groups this rank belongs to, plus ``"world"``.

    ``backend`` is the data backend ("gloo" on CPU, "nccl" on CUDA); the ``"control"`` group
    is always a gloo CPU group (the rendezvous runs on it), with ``control_timeout_s`` as the
    gloo-level timeout (pass the rendezvous timeout so a dead peer cannot hang a thread).
    P and D get separate communicators where a phase owns one (SPEC 2, 3.4).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise TopologyError("build_process_groups: torch.distributed is not initialised "
                            "(call ainfer_pd.launch.init_distributed first)")
    if dist.get_world_size() != topology.world_size or dist.get_rank() != topology.rank:
        raise TopologyError(f"topology (rank {topology.rank} of {topology.world_size}) does not match "
                            f"torch.distributed (rank {dist.get_rank()} of {dist.get_world_size()})")

    def _td(s: float | None):
        return None if s is None else _dt.timedelta(seconds=float(s))

    groups: dict[str, Any] = {WORLD: dist.group.WORLD}
    for spec in group_specs(topology):
        if spec.kind == "ctrl":
            kw = {"backend": "gloo"}
            if control_timeout_s is not None:
                kw["timeout"] = _td(control_timeout_s)
        else:
            kw = {"backend": backend}
            if data_timeout_s is not None:
                kw["timeout"] = _td(data_timeout_s)
        pg = dist.new_group(list(spec.ranks), **kw)
        if topology.rank in spec.ranks:
            groups[spec.name] = pg
    return groups
