"""What one harness run is (:class:`HarnessSpec`, picklable, identical on every rank) and its pure
rules: the conflicting pairs (:func:`registry_for`), the stream of each collective
(:func:`collective_stream`), the turnstile rounds a completed run must show
(:func:`expected_rounds`) and its overlap figures (:func:`overlap_stats`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ainfer_pd.comm.backend import check_backend
from ainfer_pd.comm.ordering import CollectiveKind, ConflictRegistry, check_ordering
from ainfer_pd.comm.ordering import collective_stream as engine_stream
from ainfer_pd.errors import ConfigError, TopologyError

__all__ = ["SKEW_MODES", "HarnessSpec", "collective_stream", "expected_rounds", "overlap_stats", "registry_for"]

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


def collective_stream(ordering: str, kind: CollectiveKind, registry: ConflictRegistry) -> str:
    """The engine's stream policy (:func:`ainfer_pd.comm.ordering.collective_stream`), except that
    ``global-implicit`` puts every collective of both phases on the harness's own collective
    stream ``C`` (compute stays on P and D: the turnstile order alone is measured)."""
    return "C" if ordering == "global-implicit" else engine_stream(ordering, kind, registry)


def overlap_stats(intervals: list[tuple[str, str, bool, float, float]]) -> dict:
    """Overlap time (s) of registered P collectives with D registered collectives (must be 0
    under selective ordering), and of other P work (P compute) with any D work."""
    from ainfer_pd.tools.tracecheck import overlap_seconds as total

    p_reg = [(a, b) for k, ph, reg, a, b in intervals if ph == "P" and k == "coll" and reg]
    d_reg = [(a, b) for k, ph, reg, a, b in intervals if ph == "D" and k == "coll" and reg]
    p_other = [(a, b) for k, ph, reg, a, b in intervals if ph == "P" and not (k == "coll" and reg)]
    d_all = [(a, b) for k, ph, reg, a, b in intervals if ph == "D"]
    return {"registered_pair_overlap_s": total(p_reg, d_reg), "registered_p_vs_any_d_s": total(p_reg, d_all),
            "other_p_vs_d_overlap_s": total(p_other, d_all),
            "p_busy_s": sum(b - a for k, ph, _, a, b in intervals if ph == "P"),
            "d_busy_s": sum(b - a for k, ph, _, a, b in intervals if ph == "D")}
