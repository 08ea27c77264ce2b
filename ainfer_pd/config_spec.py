"""The speculative-decoding section of the config (``spec``; issue 38, ``docs/SPECULATIVE.md``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ConfigError

SPEC_METHODS = ("none", "suffix", "mtp")
MAX_DRAFT_TOKENS = 8
"""The widest verification (K + 1 = 9 positions per row)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecConfig:
    method: str = "none"
    """none | suffix | mtp. ``suffix``: model-free drafts from the trajectory's own context and its
    GRPO siblings' (``ainfer_pd.spec.suffix``), verified inside the D iteration. ``mtp``: greedy
    drafts from the checkpoint's multi-token-prediction layer (glm4_moe ``num_nextn_predict_layers``
    >= 1, the first one; ``ainfer_pd.spec.mtp``), chained ``num_draft_tokens`` deep; it needs
    ``model.num_mtp_layers`` >= 1 and, on several ranks, ATP 1 (attention DP with expert
    parallelism: every rank runs every catch-up and chain); each decode graph replays the pass and the MTP
    layer's catch-up after it (``engine.runtime.mtp_graphs``), the chain runs eagerly. ``suffix``
    runs on several ranks too: each replica leader drafts and offers its drafts, every rank
    computes the world's K from the offers and pads a drafting iteration to the positions the
    ranks have at it (``ainfer_pd.spec.verify_shape``); there every rank measures the verify table
    and all share the world's (``ainfer_pd.spec.world_costs``)."""
    num_draft_tokens: int = 4
    """The most drafts a row verifies in one D iteration (K <= this)."""
    adaptive: bool = True
    """Choose K per iteration from the measured verify cost at the batch's size and the rows' recent
    acceptance (``spec.adaptive.choose``: K = 0 unless it beats plain decoding); false: every row
    with a draft verifies up to ``num_draft_tokens`` of it whatever the cost (for tests and for
    measuring the verify curve)."""
    siblings: bool = True
    """Draft from the trajectory's GRPO siblings (trajectories sharing its ``group``) as well as
    from its own context."""
    verify_costs: dict = field(default_factory=dict)
    """The verify cost table, ``{batch: {width: seconds}}`` (width = K + 1, with width 1 present);
    empty (the default): measured when the engine starts (``engine.runtime.verify_costs``; on
    several ranks by every rank, its passes padded as a real iteration's, each entry then the most
    any rank measured)."""
    draft_costs: dict = field(default_factory=dict)
    """``mtp`` only: the MTP layer's draft chain, ``{batch: {k: seconds}}`` for k drafts, at every
    batch size of ``verify_costs``; empty (the default): measured when the engine starts with the
    verify table (``engine.runtime.verify_costs.measure_draft_costs``; a given verify table without
    it: the chain counted as free, with a warning). ``spec.adaptive`` counts it with the
    verify (a suffix drafter runs on the host and costs the device nothing)."""

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"spec.method={self.method!r}: expected one of {SPEC_METHODS}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"spec.num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        for B, row in self.verify_costs.items():
            if isinstance(B, bool) or not isinstance(B, int) or B < 1 or not isinstance(row, dict) or 1 not in row:
                raise ConfigError(f"spec.verify_costs: {B!r}: expected a batch size >= 1 mapping widths to "
                                  f"seconds, width 1 included, got {row!r}")
            for w, t in row.items():
                if isinstance(w, bool) or not isinstance(w, int) or w < 1 or isinstance(t, bool) \
                        or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
                    raise ConfigError(f"spec.verify_costs[{B}]: width {w!r} -> {t!r} (need an int >= 1 -> seconds > 0)")
        for B, row in self.draft_costs.items():
            if isinstance(B, bool) or not isinstance(B, int) or B < 1 or not isinstance(row, dict) or not row:
                raise ConfigError(f"spec.draft_costs: {B!r}: expected a batch size >= 1 mapping draft counts to "
                                  f"seconds, got {row!r}")
            for k, t in row.items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 1 or isinstance(t, bool) \
                        or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
                    raise ConfigError(f"spec.draft_costs[{B}]: {k!r} drafts -> {t!r} (need an int >= 1 -> seconds >= 0)")
        if self.draft_costs and self.verify_costs and set(self.verify_costs) - set(self.draft_costs):
            raise ConfigError(f"spec.draft_costs lacks batch sizes {sorted(set(self.verify_costs) - set(self.draft_costs))}"
                              " of spec.verify_costs")
        if self.draft_costs and self.method != "mtp":
            raise ConfigError(f"spec.draft_costs is the MTP chain's cost table; spec.method={self.method!r} drafts "
                              "on the host")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def mtp(self) -> bool:
        """Drafts come from the model's MTP layer (built and loaded only then)."""
        return self.method == "mtp"
