"""A CPU platform plugin for verl 0.9 (named as such: verl has no CPU platform of its own).

verl resolves its accelerator through ``verl.plugin.platform`` (``cuda``, ``npu``, ``rocm``); on a
machine without one it falls back to ``nvidia`` and the trainer's workers fail in ``torch.cuda``.
This module registers a ``cpu`` platform so that ``VERL_PLATFORM=cpu`` runs verl's own trainer
(``main_ppo``) on CPU for a smoke run of the ainfer-pd rollout backend:

* torch device ``cpu``; collectives on ``gloo`` (FSDP2 shards on CPU over gloo);
* Ray: each trainer worker still claims one ``GPU`` slot, which ``run_grpo_cpu.sh`` declares as a
  logical Ray resource (``ray_init.num_gpus``), so verl's resource pools and placement groups work
  unchanged. No CUDA device is touched: the visible-devices variable is left alone;
* verl's process groups are ``"cpu:gloo,<device>:<backend>"``, on CPU ``"cpu:gloo,cpu:gloo"``, which
  torch refuses (a device named twice): :func:`torch.distributed.init_process_group` is wrapped to
  drop a repeated ``device:backend`` entry (nothing else changes);
* the device module is ``torch.cpu`` plus what verl calls on ``torch.cuda`` that ``torch.cpu``
  lacks: seeds and RNG state go to torch's CPU generator, ``empty_cache`` has no cache to empty,
  memory counters report the process's resident memory (psutil), ``mem_get_info`` the host's.

Load it in every verl process: ``VERL_USE_EXTERNAL_MODULES=trainer_examples.verl.cpu_platform,...``
(Ray workers inherit the variable) and set ``VERL_PLATFORM=cpu``.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _rss() -> int:
    import psutil
    return int(psutil.Process().memory_info().rss)


class _CPUDeviceModule(types.ModuleType):
    """``torch.cpu`` with the ``torch.cuda`` calls verl makes on its device module."""

    def __init__(self) -> None:
        super().__init__("verl_cpu_device")
        self._peak = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    # device
    def is_available(self) -> bool:
        return True

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device: Any) -> None:
        if device not in (0, "cpu") and not (isinstance(device, torch.device) and device.type == "cpu"):
            raise ValueError(f"the CPU platform has one device, got {device!r}")

    def synchronize(self, device: Any = None) -> None:
        torch.cpu.synchronize()

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    # RNG: torch's CPU generator
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    # memory: the process's resident set (there is no caching allocator to empty)
    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device: Any = None) -> int:
        rss = _rss()
        self._peak = max(self._peak, rss)
        return rss

    memory_reserved = memory_allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        return max(self._peak, self.memory_allocated())

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._peak = 0

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)


_DEVICE_MODULE = _CPUDeviceModule()


def _dedup_backend(backend: Any) -> Any:
    if isinstance(backend, str) and "," in backend:
        return ",".join(dict.fromkeys(p.strip() for p in backend.split(",")))
    return backend


def _wrap_init_process_group() -> None:
    import torch.distributed as dist
    original = dist.init_process_group
    if getattr(original, "_verl_cpu_platform", False):
        return

    def init_process_group(*args: Any, **kwargs: Any):
        if args:
            args = (_dedup_backend(args[0]),) + tuple(args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = _dedup_backend(kwargs["backend"])
        return original(*args, **kwargs)

    init_process_group._verl_cpu_platform = True
    dist.init_process_group = init_process_group


_wrap_init_process_group()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> torch.device:
        # verl uses it as a device (``model.to(device=get_device_id())``): an index would name an
        # accelerator, which a CPU host does not have
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        _DEVICE_MODULE.set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cpu.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None                       # torch's CPU allocator takes no settings

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        with torch.profiler.record_function(msg):
            yield

    def profiler_start(self) -> None:
        return None                       # no device profiler: torch.profiler covers CPU

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"                      # a logical slot per trainer worker (ray_init.num_gpus)

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def get_collective_module(self) -> Any:
        return None

    def cudart(self) -> Any:
        return None
