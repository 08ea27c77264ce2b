"""The config sections the model runner reads (issue 35, item 5: a component takes its own config
sections, not the whole :class:`~ainfer_pd.config.WorkerConfig`).

:class:`~.runner.ModelRunner` takes a :class:`RunnerSections` and exposes it as ``runner.sections``;
whoever holds a runner reads those sections through it (``runner.sections.model``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...config import WorkerConfig
from ...config_model import ModelConfig
from ...config_sections import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig
from ...config_spec import SpecConfig
from ...errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerSections:
    model: ModelConfig
    """The model built, its dtype and context limit (the warm-up lengths, the graph buckets)."""
    cache: CacheConfig
    """The KV pool's dtype and the routed-experts buffer beside it (``routed_experts``)."""
    device: DeviceConfig
    """The attention and MoE backends, the decode and P graphs' buckets."""
    scheduler: SchedulerConfig
    """The batch limits the graphs are sized to (``max_decode_batch``, ``max_prefill_tokens``)."""
    spec: SpecConfig
    """Speculative decoding: a verify pass has 1 + ``num_draft_tokens`` decode rows per turn."""
    parallel: ParallelConfig
    """Expert parallelism: the routed experts this rank holds (``expert_parallel.expert_shard``)."""

    @property
    def verify_width(self) -> int:
        """The rows of one turn a verify pass's decode attention reads the turn's keys once for
        (:func:`..attention.plan.verify_group_width`; 1 without speculation)."""
        from ..attention.plan import verify_group_width
        s, mc = self.spec, self.model
        return verify_group_width(1 + s.num_draft_tokens, mc.num_heads // mc.num_kv_heads) if s.enabled else 1

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> "RunnerSections":
        return cls(model=cfg.model, cache=cfg.cache, device=cfg.device, scheduler=cfg.scheduler, spec=cfg.spec,
                   parallel=cfg.parallel)

    @classmethod
    def expect(cls, sections: Any) -> "RunnerSections":
        """``sections`` itself; a :class:`ConfigError` naming the fix for anything else (a whole
        WorkerConfig included)."""
        if not isinstance(sections, cls):
            raise ConfigError(f"ModelRunner takes RunnerSections (RunnerSections.from_config(cfg)), "
                              f"got {type(sections).__name__}")
        return sections
