"""What of the engine lives on the device, and giving it back while the trainer runs.

verl's colocated mode (``hybrid_engine``) trains on the GPUs the rollout decodes on, so between
rollouts the worker must hand its GPU memory back. Levels (as the issue and verl's vLLM adapter
mean them):

* level 0: drop the retained KV of idle trajectories (the pool stays allocated);
* level 1: also free the KV pool and the decode CUDA graphs (their private memory pools);
* level 2: also move the weights to pinned host memory (``keep_weights``) or drop them (the
  next complete weight sync refills them: verl syncs right after ``wake_up(["weights"])``).

``wake_up(tags)`` restores what the tags name ("weights", "kv_cache"; both when None). The
weights come back into fresh device storage and the pool is reallocated, so captured graphs
would point at freed memory: they are dropped at sleep and recaptured at wake (the cost is
measured: ``benchmarks/sleep_wake_bench.py``). The parameter *objects* stay the same, so
trainers holding references and the weight-sync name table keep working.

Mechanism here; the policy of how many KV blocks fit a memory budget is :func:`kv_blocks_for_budget`
(:func:`kv_blocks_from_memory` applies it to the device).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ...errors import ConfigError

log = logging.getLogger("ainfer_pd.residency")

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


def kv_blocks_for_budget(total_bytes: int, utilization: float, weight_bytes: int, block_bytes: int,
                         reserve_bytes: int) -> int:
    """KV blocks that fit ``utilization`` of the device's memory next to the weights and a
    reserve for activations, graph pools and the CUDA context (verl's ``gpu_memory_utilization``:
    the rollout's whole share of the GPU, weights included). At least 16."""
    budget = int(total_bytes * utilization) - weight_bytes - reserve_bytes
    return max(16, budget // block_bytes)


def kv_block_bytes(cfg) -> int:
    """Bytes of one KV block of ``cfg`` over every layer (K and V; the MTP layer's too under
    ``spec.method: mtp``): 1 byte an element with ``cache.kv_dtype: fp8_e4m3`` (its per-layer
    scales are not per block), else the model dtype's."""
    from ..attention.kv_fp8 import kv_element_bytes
    mc, cc = cfg.model, cfg.cache
    return (mc.num_layers + int(cfg.spec.mtp)) * 2 * cc.block_size * mc.num_kv_heads * mc.head_dim \
        * kv_element_bytes(cc.kv_dtype, mc.torch_dtype)


def rank_weight_bytes(cfg) -> int:
    """Bytes of this rank's weights under ``cfg``: its experts only (FP8: 1 byte + scales), the MTP
    layer's with ``spec.method: mtp``."""
    mc = cfg.model
    weights = mc.rank_weight_bytes(cfg.parallel.expert_parallel)
    if cfg.spec.mtp:
        from ..model.mtp_layer import mtp_weight_bytes
        weights += mtp_weight_bytes(mc, cfg.parallel.expert_parallel)
    return weights


def kv_sizing_inputs(cfg) -> tuple:
    """What of ``cfg`` a pool sized from the device (``cache.num_blocks`` 0) depends on, besides the
    memory free when it is sized: configs with equal inputs get equal pools from equal memory."""
    cc = cfg.cache
    return (kv_block_bytes(cfg), rank_weight_bytes(cfg), cc.gpu_memory_fraction, cc.gpu_memory_utilization)


def collect_device_memory(device: torch.device | None = None) -> None:
    """Give the driver back what this process's CUDA memory holds for nothing: garbage still in
    reference cycles (a released worker's runner <-> graph objects, whose private pools go with
    them) is collected, then the caching allocator's unused blocks are freed. Before it, memory a
    closed worker left behind counts as in use to ``cudaMemGetInfo`` (on the H100 a second worker in
    one ladder process sized its KV pool ~1 GB smaller than the first). No-op without CUDA."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def release_kv_state(runner) -> None:
    """Drop what of ``runner`` is bound to its KV pool (no work in flight): the decode graphs
    (their runner <-> graphs cycle broken, so their private pool goes with the last reference), the
    P graphs, the pool, the D loop's penalty masks (rebuilt from the histories) and routing
    replay's per-slot ids."""
    if runner.graphs is not None:
        runner.graphs.release()
    runner.graphs = None
    runner.release_prefill_graphs()
    runner.kv_cache = None
    runner.seen_masks.release()
    if runner.routed is not None:
        runner.routed.release()


CPU_KV_BLOCKS = 2048
"""The KV pool of a CPU stand-in worker whose config leaves ``cache.num_blocks`` at 0 (no device
memory to size it from)."""


def kv_blocks_for_device(cfg, device_kind: str) -> int:
    """The KV pool of a worker of ``cfg`` on a ``device_kind`` ("cuda" | "cpu") device:
    ``cache.num_blocks`` when set, else sized from the CUDA device's memory
    (:func:`kv_blocks_from_memory`), else :data:`CPU_KV_BLOCKS`."""
    if cfg.cache.num_blocks:
        return cfg.cache.num_blocks
    if device_kind == "cuda":
        blocks = kv_blocks_from_memory(cfg)
        tokens, need = blocks * cfg.cache.block_size, cfg.model.max_context_len
        if tokens < need:         # not one trajectory at full length: refused at start, not turn by turn
            raise ConfigError(f"the KV pool sized from the device memory holds {tokens} tokens ({blocks} blocks), "
                              f"fewer than one trajectory at model.max_context_len {need}: raise "
                              f"cache.gpu_memory_fraction / cache.gpu_memory_utilization, or set cache.num_blocks")
        return blocks
    log.info("cache.num_blocks 0 on the CPU stand-in: %d KV blocks", CPU_KV_BLOCKS)
    return CPU_KV_BLOCKS


def kv_blocks_from_memory(cfg) -> int:  # pragma: no cover - CUDA only
    """KV blocks for ``cfg`` (a :class:`~ainfer_pd.config.WorkerConfig` without ``cache.num_blocks``)
    on the current CUDA device: :func:`kv_blocks_for_budget` under ``cache.gpu_memory_utilization``,
    else ``cache.gpu_memory_fraction`` of the memory free after this rank's weights, measured once
    what earlier workers of the process left behind is collected (:func:`collect_device_memory`)."""
    cc = cfg.cache
    collect_device_memory()
    free, total = torch.cuda.mem_get_info()
    per_block, weights = kv_block_bytes(cfg), rank_weight_bytes(cfg)
    if cc.gpu_memory_utilization > 0:
        return kv_blocks_for_budget(total, cc.gpu_memory_utilization, weights, per_block, reserve_bytes=2 << 30)
    return max(16, int((free - weights) * cc.gpu_memory_fraction) // per_block)


@dataclass
class ResidencyState:
    kv: bool = True            # the KV pool (and the decode graphs) are allocated
    weights: str = "device"    # device | host | dropped


class Residency:
    """Moves one runner's weights, KV pool and decode graphs off and back onto its device."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.state = ResidencyState()
        self._had_graphs = False
        self._host: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._buffer: torch.Tensor | None = None
        self.host_allocations = 0
        """How many times the pinned host buffer was allocated (once, unless the weights grew)."""

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _params(self) -> list[torch.nn.Parameter]:
        seen, out = set(), []
        for p in self.runner.model.parameters():          # tied embeddings: one Parameter, once
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    # ------------------------------------------------------------------ release
    def release_kv(self) -> None:
        """Free the KV pool and the decode graphs (the retained KV must already be dropped)."""
        if not self.state.kv:
            return
        r = self.runner
        self._had_graphs = self._had_graphs or r.graphs is not None
        release_kv_state(r)
        self.state.kv = False
        self._collect()

    def release_weights(self, keep: bool) -> None:
        """Weights to pinned host memory (``keep``: one pinned buffer, each parameter a view into
        it) or dropped (an empty placeholder each).

        The pinned buffer is allocated at the first ``sleep(2)`` and kept across sleeps (issue 34,
        item 9: page-locking a fresh 61 GB buffer at every sleep took 29 s of a 29 s ``sleep(2)`` on
        the Qwen3-30B-A3B shape); later sleeps only copy into it. :meth:`free_host_buffer` gives
        it back."""
        if self.state.weights != "device":
            return
        pin = self.device.type == "cuda"
        params = self._params()
        self._shapes = {id(p): tuple(p.shape) for p in params}
        if keep:
            offs = self._offsets(params)
            buf = self.reserve_host_buffer()
            for p, o in zip(params, offs):
                n = p.numel() * p.element_size()
                host = buf[o:o + n].view(p.dtype).view(p.shape)
                host.copy_(p.data, non_blocking=pin)
                self._host[id(p)] = host
        if pin:
            torch.cuda.synchronize(self.device)
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.state.weights = "host" if keep else "dropped"
        self._collect()

    @staticmethod
    def _offsets(params: list) -> list[int]:
        offs, total = [], 0
        for p in params:
            offs.append(total)
            total += -(-p.numel() * p.element_size() // 256) * 256
        return offs + [total]

    def reserve_host_buffer(self) -> torch.Tensor:
        """The host buffer of sleep level 2 (pinned on CUDA), allocated now unless one of the
        size is kept already (a ``sleep(2)`` after this one only copies into it). Needs the
        weights on the device (their sizes)."""
        params = self._params()
        if any(p.numel() == 0 for p in params):
            raise RuntimeError("the weights are not on the device")
        total = self._offsets(params)[-1]
        pin = self.device.type == "cuda"
        buf = self._buffer
        if buf is None or buf.numel() < total or (pin and not buf.is_pinned()):
            self._buffer = None                   # the old one goes before the new one is pinned
            buf = self._buffer = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
            self.host_allocations += 1
        return buf

    def free_host_buffer(self) -> int:
        """Give the pinned host buffer back (unless the weights are in it now); returns its bytes."""
        if self._buffer is None or self.state.weights == "host":
            return 0
        n = self._buffer.numel()
        self._buffer = None
        return n

    def host_bytes(self) -> int:
        """Bytes of the (pinned) host buffer kept for sleep level 2."""
        return 0 if self._buffer is None else int(self._buffer.numel())

    # ------------------------------------------------------------------ restore
    def restore_weights(self) -> bool:
        """Back into fresh device storage; returns False when they were dropped (the storage is
        allocated uninitialised: the next complete weight sync fills it). The pinned host buffer
        stays for the next sleep."""
        if self.state.weights == "device":
            return True
        was = self.state.weights
        pin = self.device.type == "cuda"
        shapes = self._shapes
        for p in self._params():
            if was == "host":
                host = self._host.pop(id(p))
                # on CPU the buffer is reused at the next sleep: the parameter needs its own storage
                p.data = host.to(self.device, non_blocking=True) if pin else host.clone()
            else:
                p.data = torch.empty(shapes[id(p)], dtype=p.dtype, device=self.device)
        if pin:
            torch.cuda.synchronize(self.device)
        self._host.clear()
        self.state.weights = "device"
        # a weight-name table built while the weights were released holds their (0,) shapes
        # (issue 34, item 12): the next user rebuilds it from the restored parameters
        if getattr(self.runner.model, "_name_table", None) is not None:
            object.__setattr__(self.runner.model, "_name_table", None)
        return was == "host"

    def restore_kv(self) -> bool:
        """Reallocate the KV pool; returns whether decode graphs must be recaptured."""
        if self.state.kv:
            return False
        r = self.runner
        r.kv_cache = r.new_kv_cache()
        self.state.kv = True
        return self._had_graphs

    # ------------------------------------------------------------------ helpers
    def _collect(self) -> None:
        collect_device_memory(self.device)

    def device_bytes(self) -> int:
        """Bytes the caching allocator holds on this device (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_reserved(self.device))
