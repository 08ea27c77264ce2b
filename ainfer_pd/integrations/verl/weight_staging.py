"""verl's weight sync into the server: buckets checked against the served model as they arrive
(:func:`prepare_bucket`, before anything is copied), applied all at once at commit (the worker
checks the whole sync again, completeness included), on every rank of a multi-rank replica.
:class:`WeightSync` is a mixin of :class:`~.server.AInferPDServer` (its Ray actor methods)."""
from __future__ import annotations

import asyncio
from typing import Any, Iterable, Optional

from ...errors import AInferPDError, WeightUpdateError


def name_table(worker: Any):
    """The served model's name table (checkpoint, transformers and engine names), if any."""
    model = getattr(worker, "model", None)
    if model is None or not hasattr(model, "expert_range"):
        return None
    from ...hf.names import name_table as table
    return table(model)


def is_kv_scale(name: str, table: Any) -> bool:
    """``name`` is an FP8 KV pool's K / V scale (``model.layers.N.self_attn.k_scale``, ...:
    :mod:`ainfer_pd.hf.kv_scales`), not a parameter of the name table."""
    from ...hf.kv_scales import kv_scale_of
    return kv_scale_of(name, table.model.cfg.num_layers) is not None


def prepare_bucket(worker: Any, named: Iterable[tuple[str, Any]], *, cast_dtype: bool) -> list:
    """Validate names / shapes (and cast floating dtypes when ``cast_dtype``) of one bucket."""
    import torch
    table = name_table(worker)
    out = []
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"weight {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if table is not None and not is_kv_scale(name, table):      # an FP8 KV scale: the worker checks it
            target = table.lookup(name)
            if target is None:
                close = [n for n in table.hf if n.split(".")[-1] == name.split(".")[-1]][:3]
                raise WeightUpdateError(f"unknown weight name {name!r} (a {table.model.cfg.architecture} model"
                                        + (f"; similar: {close}" if close else "") + ")")
            if tuple(t.shape) != target.shape:
                raise WeightUpdateError(f"weight {name!r}: shape {tuple(t.shape)} != model shape {target.shape}")
            dtype = table.cast_dtype(target, t.dtype)     # FP8 projections: the model dtype (quantized later)
            if t.dtype != dtype:
                if cast_dtype and t.is_floating_point() and dtype.is_floating_point:
                    t = t.to(dtype)
                else:
                    raise WeightUpdateError(f"weight {name!r}: dtype {t.dtype} != model dtype {dtype}")
        out.append((name, t))
    return out


class WeightSync:
    def begin_weight_update(self) -> None:
        self._staged = []

    def stage_weights(self, named_tensors: list) -> int:
        """Validate and stage one bucket; nothing is applied before :meth:`commit_weight_update`."""
        if self._staged is None:
            self._staged = []
        self._staged.extend(prepare_bucket(self.worker, named_tensors, cast_dtype=self.cast_weight_dtype))
        return len(self._staged)

    async def commit_weight_update(self, global_steps: Optional[int] = None) -> int:
        staged, self._staged = self._staged or [], None
        if not staged:
            return 0
        await self.wait_for_requests_to_drain()
        if self.ranks is None:
            await self.worker.update_weights(staged)
        else:
            # followers map the same tensors (shared memory / CUDA IPC handles: no second copy);
            # each keeps its own experts; ``staged`` stays alive until every rank has copied
            from ...weight_transfer import share_bucket
            await self._all_ranks_weights(staged, [share_bucket(staged)])
        await self.clear_kv_cache()
        if global_steps is not None:
            self.global_steps = global_steps
        return len(staged)

    def abort_weight_update(self) -> None:
        self._staged = None

    async def update_weights(self, named_tensors: list, global_steps: Optional[int] = None) -> int:
        """One-shot update (all-or-nothing): ``[(name, tensor), ...]``."""
        self.begin_weight_update()
        try:
            self.stage_weights(named_tensors)
        except AInferPDError:
            self.abort_weight_update()
            raise
        return await self.commit_weight_update(global_steps)

    async def _all_ranks_weights(self, staged: list, shared: list) -> None:
        results = await asyncio.gather(self.worker.update_weights(staged),
                                       self.ranks.call("update_weights", shared), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                raise res
