"""``RolloutWorker.calibrate_kv_scales``: an FP8 KV pool's per-layer K / V scales from an amax pass
over the caller's prompts (:mod:`ainfer_pd.engine.runtime.kv_calibration`).

A mixin, a base of :class:`~ainfer_pd.worker_control.WorkerControl`: it runs under the control lock
and the stream parking that the weight sync and sleep / wake use (``_control_lock``,
``_with_streams_parked``), and reads the worker's trajectories and engine.
"""
from __future__ import annotations

import math

import torch

from .errors import InvalidRequestError, TrajectoryBusyError, UnsupportedOptionError, WorkerAsleepError
from .worker_input import check_tokens


class KvCalibration:
    """Calibrated FP8 KV scales of a running worker (mixin of :class:`~ainfer_pd.worker_control.WorkerControl`)."""

    async def calibrate_kv_scales(self, prompts: list[list[int]], margin: float = 1.25) -> torch.Tensor:
        """Run the prompts' prefill through the model, record every layer's largest ``|K|`` (post-RoPE,
        as stored) and ``|V|``, and set the FP8 pool's scales to ``amax * margin / 448`` (at least
        2^-24), in place (captured CUDA graphs read them from their next replay). Returns the
        ``[num_layers, 2]`` float32 (K, V) scales (host).

        The passes use a temporary KV cache in the model dtype (no block of the pool is taken) with
        every stream of the device parked; a turn submitted meanwhile waits for them and stores its KV
        under the new scales. Refused, typed, before anything runs: a pool in the model dtype
        (:class:`UnsupportedOptionError`, key ``cache.kv_dtype``); a turn in flight or draining
        (:class:`TrajectoryBusyError` naming its trajectory: KV it stored under the old scales would be
        read under the new ones); a worker asleep; several ranks (:class:`UnsupportedOptionError`:
        the passes run one rank's whole model, the expert exchange and attention-TP collectives of a
        multi-rank worker are not driven outside its engine loops; calibrate a one-rank worker of the
        same model and push the scales in a weight sync by their checkpoint names,
        ``model.layers.N.self_attn.k_scale`` / ``v_scale``). Cached KV (idle trajectories', shared
        prefixes) was stored under the old scales: it is dropped, and their next turns recompute."""
        self._check_open()
        cfg = self.cfg
        ids = _check_prompts(prompts, cfg.model.vocab_size, cfg.model.max_context_len)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) \
                or margin <= 0:
            raise InvalidRequestError(f"margin must be a positive finite number, got {margin!r}")
        if cfg.cache.kv_dtype != "fp8_e4m3":
            raise UnsupportedOptionError(f"calibrate_kv_scales scales an FP8 KV pool; this worker's pool is "
                                         f"cache.kv_dtype={cfg.cache.kv_dtype!r} (no scales)", key="cache.kv_dtype")
        if cfg.parallel.world_size > 1:
            raise UnsupportedOptionError(
                f"calibrate_kv_scales runs on one rank (this worker has {cfg.parallel.world_size}): its passes run the "
                "whole model outside the engine loops, and the expert exchange / attention-TP collectives of several "
                "ranks are not driven there. Calibrate a one-rank worker of the same model and push the returned "
                "scales with update_weights as model.layers.N.self_attn.k_scale / v_scale (every rank takes them)",
                key="parallel.world_size")
        async with self._control_lock("calibrate_kv_scales"):
            self._check_calibration_state()
            # NOTE: no await from the check to the park request: a turn submitted later queues
            # behind the park (its KV is stored under the new scales) and finds no cached KV.
            self.engine.kv.invalidate()
            return await self._with_streams_parked(lambda: self._calibrate(ids, margin), locked=True)

    def _check_calibration_state(self) -> None:
        """The worker is awake and no turn is in flight or draining (else a typed error)."""
        if self._asleep or self._weights_stale or not self.engine.residency.state.kv:
            raise WorkerAsleepError("calibrate_kv_scales needs the worker awake (its KV pool and weights on the "
                                    "device): call wake_up()"
                                    + (" and sync the weights" if self._weights_stale else ""))
        for tid, traj in self.trajectories.items():
            if traj.turn is not None or traj.draining is not None:
                raise TrajectoryBusyError(
                    f"calibrate_kv_scales needs no turn in flight: trajectory {tid!r} has one "
                    f"({'draining' if traj.turn is None else 'running'}); the KV it stored under the old scales would "
                    "be read under the new ones. Await (or abort) its turn first")

    def _calibrate(self, prompts: list[list[int]], margin: float) -> torch.Tensor:
        """The calibration thread (every stream parked): launched work drained, the passes, the scales."""
        from .engine.runtime.kv_calibration import calibrate_kv_scales
        dev = self.engine.device
        if dev.kind == "cuda":        # launched kernels (graph replays) may still run on the P / D streams
            torch.cuda.synchronize(dev.torch_device)
        cfg = self.cfg
        scales = calibrate_kv_scales(self.engine.runner.model, prompts, margin,
                                     max_tokens=cfg.scheduler.max_prefill_tokens, block_size=cfg.cache.block_size)
        if dev.kind == "cuda":
            torch.cuda.synchronize(dev.torch_device)
        return scales


def _check_prompts(prompts: object, vocab_size: int, max_len: int) -> list[list[int]]:
    """A non-empty list of non-empty token-id lists, each inside the vocabulary and shorter than the
    model's context limit (else InvalidRequestError)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}"
                                  + (" (empty)" if isinstance(prompts, (list, tuple)) else ""))
    out = []
    for i, p in enumerate(prompts):
        ids = check_tokens(p, f"prompts[{i}]", vocab_size)
        if not ids:
            raise InvalidRequestError(f"prompts[{i}] is empty")
        if len(ids) >= max_len:
            from .errors import ContextLengthError
            raise ContextLengthError(f"prompts[{i}] has {len(ids)} tokens; the model's context limit is {max_len}")
        out.append(ids)
    return out
