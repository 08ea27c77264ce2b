"""``start_profile`` / ``stop_profile`` of the verl server: a ``torch.profiler`` session over
everything this process runs (the engine's stream threads included), written as a Chrome trace.

The trace directory comes from ``engine_kwargs.ainfer_pd.profile_dir``, else verl's
``rollout.profiler.save_path`` when its tool is ``torch``, else ``$TMPDIR/ainfer_pd_profile``;
``start_profile(profile_dir=...)`` overrides it for one session. One file per rank and session:
``{dir}/ainfer_pd_rank{r}_{tag}.pt.trace.json`` (``tag``: verl's ``profile_step`` when given).
CUDA activity is recorded when CUDA is available. Every thread is profiled
(``profile_all_threads``: the engine runs its kernels from its stream threads). Start and stop run
off the event loop, on one thread of the session.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import tempfile
import time
from typing import Any, Optional

from ...errors import InvalidRequestError
from .settings import field, to_plain


def profile_dir_of(engine_kwargs: dict, rollout_config: Any) -> str:
    d = engine_kwargs.get("profile_dir")
    if d:
        return str(d)
    prof = to_plain(field(rollout_config, "profiler"))          # a dataclass, a DictConfig or a dict
    if field(prof, "tool") == "torch" and isinstance(field(prof, "save_path"), str):
        return field(prof, "save_path")
    return os.path.join(tempfile.gettempdir(), "ainfer_pd_profile")


class TorchProfile:
    """One profiling session of this process."""

    def __init__(self, directory: str, *, rank: int = 0, tag: Optional[str] = None) -> None:
        self.directory = directory
        self.rank = rank
        self.tag = tag or time.strftime("%Y%m%d-%H%M%S")
        self._prof = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def _start(self) -> None:
        import torch
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        os.makedirs(self.directory, exist_ok=True)
        prof = profile(activities=acts, record_shapes=False,
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))
        prof.start()
        self._prof = prof

    async def start(self) -> str:
        if self._prof is not None:
            raise InvalidRequestError("a profile is already running: stop_profile first")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ainfer-profile")
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._start)
        except BaseException:
            self._thread.shutdown(wait=False)
            self._thread = None
            raise
        return self.directory

    def _stop(self) -> str:
        prof, self._prof = self._prof, None
        prof.stop()
        path = os.path.join(self.directory, f"ainfer_pd_rank{self.rank}_{self.tag}.pt.trace.json")
        prof.export_chrome_trace(path)
        return path

    async def stop(self) -> str:
        """Stop and write the trace; returns its path."""
        if self._prof is None:
            raise InvalidRequestError("no profile is running: start_profile first")
        pool, self._thread = self._thread, None
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, self._stop)
        finally:
            pool.shutdown(wait=False)
