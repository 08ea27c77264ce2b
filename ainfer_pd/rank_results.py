"""The parent side of :func:`ainfer_pd.launch.spawn` once the rank processes run: wait for their
results until the deadline (:func:`collect_results`), record each rank's value, exception or
death (:func:`record_result`), end the processes (:func:`reap_ranks`) and build the error that
names the ranks that failed (:func:`spawn_failure`)."""
from __future__ import annotations

import time
from typing import Any

from .errors import RankFailedError
from .exception_transport import unpack_exception

__all__ = ["record_result", "collect_results", "reap_ranks", "spawn_failure"]


def record_result(r: int, procs: list, conns: list, results: list, failures: dict[int, str], pending: set) -> None:
    """Rank ``r``'s result (or exception, or death) into ``results`` / ``failures``."""
    try:
        kind, value = conns[r].recv()
    except (EOFError, OSError):
        procs[r].join(1.0)
        code = procs[r].exitcode
        why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        results[r] = RankFailedError(f"rank {r} died ({why}) before returning a result")
        failures[r] = f"died ({why})"
    else:
        if kind == "ok":
            results[r] = value
        else:
            results[r] = unpack_exception(r, value)
            failures[r] = value["repr"]
    pending.discard(r)


def collect_results(procs: list, conns: list, results: list, failures: dict[int, str], pending: set,
                    deadline: float, fail_grace_s: float) -> None:
    """Wait for the pending ranks until the deadline (shortened to ``fail_grace_s`` once a rank
    failed); every rank that finished leaves ``pending``."""
    import multiprocessing.connection as mpc

    while pending:
        now = time.monotonic()
        if now >= deadline:
            break
        by_obj: dict[Any, tuple[str, int]] = {}
        for r in pending:
            by_obj[conns[r]] = ("conn", r)
            by_obj[procs[r].sentinel] = ("proc", r)
        ready = mpc.wait(list(by_obj), timeout=deadline - now)
        for obj in ready:
            kind, r = by_obj[obj]
            if r not in pending:
                continue
            if kind == "conn" or conns[r].poll():
                record_result(r, procs, conns, results, failures, pending)
            else:  # exited; a result may still be in flight in the pipe
                if conns[r].poll(0.2):
                    record_result(r, procs, conns, results, failures, pending)
                else:
                    record_result(r, procs, conns, results, failures, pending)  # EOF -> died
        if failures:
            deadline = min(deadline, time.monotonic() + fail_grace_s)


def reap_ranks(procs: list, conns: list, grace_s: float) -> None:
    """Give every rank process ``grace_s`` to exit, then terminate / kill it; close the pipes."""
    grace_end = time.monotonic() + grace_s
    for p in procs:
        if p.is_alive():
            p.join(max(0.0, grace_end - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for c in conns:
        c.close()


def spawn_failure(world_size: int, results: list, failures: dict[int, str],
                  unfinished: list[int]) -> RankFailedError:
    lines = [f"  rank {r}: {why}" for r, why in sorted(failures.items())]
    detail = ""
    for r in sorted(failures):
        tb = getattr(results[r], "remote_traceback", None)
        if tb:
            detail = f"\nfirst remote traceback (rank {r}):\n{tb}"
            break
    return RankFailedError(
        f"spawn of {world_size} ranks failed ({len(failures)} failed, unfinished: {unfinished}):\n"
        + "\n".join(lines) + detail,
        failures={r: w for r, w in failures.items()}, unfinished=tuple(unfinished), results=results)
