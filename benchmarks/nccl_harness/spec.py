"""What one harness run is (:class:`HarnessSpec`, picklable, identical on every rank) and the
turnstile rounds a completed run must show (:func:`expected_rounds`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ainfer_pd.comm.backend import check_backend
from ainfer_pd.comm.ordering import ConflictRegistry, check_ordering
from ainfer_pd.errors import ConfigError, TopologyError

__all__ = ["SKEW_MODES", "HarnessSpec", "expected_rounds", "registry_for"]

SKEW_MODES = ("random", "fixed", "crossed")


@dataclass(frozen=True)
class HarnessSpec:
    """One harness run (picklable; identical on every rank)."""

    world_size: int = 4
    attn_dp: int = 2
    ordering: str = "selective"
    residency_slots: int = 1
    epochs: int = 2
    segments: int = 3
    d_iters: int = 10
    """D iterations at least (the D loop also runs until every P epoch is served)."""
    span: int = 1
    matmul: int = 48
    """Compute = ``reps`` matmuls of [m, m] x [m, m] (float32)."""
    p_reps: int = 3
    d_reps: int = 1
    rows: int = 8
    """Rows of the collective tensors (x ``matmul`` columns)."""
    seed: int = 0
    backend: str = "gloo"
    """Data backend of the attention collectives: gloo (CPU stand-in) | nccl (cuda:LOCAL_RANK)."""
    register_pairs: bool = False
    """Register the conflicting pairs even where the groups do not cross (one rank, ATP1, ADP1):
    exercises the selective route and the trace-check of the D -> P order."""
    rendezvous: str = "auto"
    """auto (make_rendezvous: shm on one host, single-rank at world size 1) | gloo (GlooRendezvous
    over the gloo control group, also at world size 1)."""
    skew_ms: float = 0.0
    skew_mode: str = "random"
    """random: uniform(0, skew_ms) before every launch; fixed: odd ranks sleep skew_ms;
    crossed: the adversarial start - ranks with even ``dp_rank + tp_rank`` delay their first D
    launch by skew_ms, the others their first P launch, so neighbours in every group reach
    their first collectives in opposite phase orders (with ``none`` and one residency slot the
    SPEC 2 cycle forms deterministically, whatever the host's timing)."""
    jitter_ms: float = 1.0
    """Natural launch jitter: uniform(0, jitter_ms) before every launch."""
    phase_offset_ms: float = 3.0
    """Replicas out of phase: even replicas start P this late, odd replicas start D this late."""
    epoch_gap_ms: float = 2.0
    """``none``: host pause between P epochs."""
    p_delay_ms: float = 0.0
    kill_rank: int | None = None
    kill_after_d: int = 4
    stall_s: float = 2.0
    rendezvous_timeout_s: float = 5.0
    coll_timeout_s: float = 30.0
    fast_rendezvous: bool = True
    run_dir: str | None = None
    tag: str = "run"

    def validate(self, *, need_runtime: bool = True) -> None:
        """:class:`ConfigError` for bad values; with ``need_runtime`` also
        :class:`BackendUnavailableError` when this host cannot run ``backend``."""
        check_ordering(self.ordering)
        check_backend(self.backend, need_runtime=need_runtime)
        if self.skew_mode not in SKEW_MODES:
            raise ConfigError(f"skew_mode must be {'|'.join(SKEW_MODES)}, got {self.skew_mode!r}")
        if self.rendezvous not in ("auto", "gloo"):
            raise ConfigError(f"rendezvous must be auto|gloo, got {self.rendezvous!r}")
        min_slots = 0 if self.backend == "nccl" else 1
        if self.residency_slots < min_slots:
            raise ConfigError(f"residency_slots must be >= {min_slots} with backend {self.backend} "
                              f"(0 = no residency gate, CUDA only), got {self.residency_slots}")
        if self.segments < 1 or self.epochs < 0 or self.d_iters < 0 or self.span < 1:
            raise ConfigError("segments and span must be >= 1, epochs and d_iters >= 0")
        if self.stall_s <= 0 or self.rendezvous_timeout_s <= 0 or self.coll_timeout_s <= 0:
            raise ConfigError("stall_s, rendezvous_timeout_s and coll_timeout_s must be > 0")
        if self.world_size < 1 or self.attn_dp < 1 or self.world_size % self.attn_dp:
            raise TopologyError(f"world_size={self.world_size} must be a positive multiple of attn_dp={self.attn_dp}")


def expected_rounds(spec: HarnessSpec) -> int | None:
    """Turnstile rounds of a completed run: every epoch of S segments with span K passes
    boundaries 0, K, 2K, .. and its final boundary S (one D round each)."""
    if spec.ordering == "none":
        return 0
    k, s = spec.span, spec.segments
    per_epoch = len(range(0, s, k)) + 1
    return spec.epochs * per_epoch


def registry_for(topo: Any, spec: HarnessSpec) -> ConflictRegistry:
    """The conflicting pairs of this run (``register_pairs``: also where nothing crosses)."""
    return ConflictRegistry.for_topology(topo, force=spec.register_pairs)
