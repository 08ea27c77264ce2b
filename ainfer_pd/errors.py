"""Every error the library raises on purpose.

All of them subclass :class:`AInferPDError`, so a trainer can catch the library's
failures without catching its own bugs.
"""
from __future__ import annotations


class AInferPDError(Exception):
    """Base class of every error ainfer-pd raises on purpose."""


class ConfigError(AInferPDError, ValueError):
    """A configuration (YAML, dataclass field, topology) is invalid."""


class TopologyError(ConfigError):
    """World size, attention-DP and expert-parallel widths do not fit together."""


class NotBuiltError(ConfigError):
    """The configuration asks for something the engine does not build; ``missing`` names the piece."""

    def __init__(self, message: str, *, missing: str = "") -> None:
        super().__init__(message)
        self.missing = missing


class UnsupportedModelError(ConfigError):
    """A Hugging Face ``config.json`` asks for something this engine does not compute: an unknown
    ``model_type``, a ``rope_scaling`` type, or another field that changes the math (named)."""


class CheckpointError(ConfigError):
    """A checkpoint directory cannot be loaded: a missing shard, a tensor whose shape disagrees
    with ``config.json``, missing or unexpected tensors, or pickle-only weights (refused)."""


class InvalidRequestError(AInferPDError, ValueError):
    """A request is malformed: empty prompt, token out of vocabulary, bad sampling values."""


class ContextLengthError(InvalidRequestError):
    """Prompt plus ``max_new_tokens`` exceeds the model's context limit."""


class UnknownTrajectoryError(AInferPDError, KeyError):
    """The trajectory id is unknown or was released."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class TrajectoryBusyError(AInferPDError):
    """A trajectory already has a turn in flight (two concurrent ``continue_`` calls)."""


class RequestAborted(AInferPDError):
    """The request was aborted (``abort``/``sleep``/shutdown) before it finished."""


class CapacityError(AInferPDError):
    """The KV cache cannot hold a request even after evicting every idle trajectory."""


class WeightUpdateError(AInferPDError, ValueError):
    """``update_weights`` got an unknown name, or a tensor of the wrong shape or dtype."""


class WorkerClosedError(AInferPDError):
    """The worker is not running (not entered, shut down, or failed)."""


class LifetimeError(AInferPDError):
    """A result tried to write into a KV reservation of another lifetime."""


class TurnstileError(AInferPDError):
    """The turnstile controller rejected a transition (see subclasses)."""


class StaleEpochError(TurnstileError):
    """An epoch id is older than, or equal to, one already begun (stale or duplicate)."""


class MissingProducerError(TurnstileError):
    """A permit or boundary was asked for with no P epoch (producer) active."""


class NonMonotonicBoundaryError(TurnstileError):
    """A boundary was published out of order."""


class PermitExceededError(TurnstileError):
    """P tried to reach an endpoint beyond the current permit."""


class DistributedError(AInferPDError):
    """A distributed wait failed."""


class CollectiveFailedError(DistributedError):
    """A data collective failed in the transport (a peer of its group died, closed its
    connection or failed); ``group_ranks`` lists the global ranks of that group (the transport
    does not say which one is gone)."""

    def __init__(self, message: str, *, group_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.group_ranks = tuple(group_ranks)


class RendezvousTimeout(DistributedError, TimeoutError):
    """A rendezvous did not complete in time; the message names the missing ranks."""

    def __init__(self, message: str, *, missing_ranks: tuple[int, ...] = (),
                 epoch: int | None = None, boundary: int | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.epoch = epoch
        self.boundary = boundary


class RendezvousMismatch(DistributedError):
    """Ranks disagreed on (epoch, boundary, permit) at a rendezvous."""


class StallError(DistributedError):
    """The watchdog saw no progress: a device-progress cycle (or a dead peer)."""


class DeviceStallError(StallError):
    """A single-rank engine's device stopped: work was submitted to its streams and no stream item
    completed for ``parallel.stall_timeout_s`` (a device hang: kernels that never finish). The
    message names each stream's oldest unfinished item (stream, label, lane, phase, epoch, how
    long it has been unfinished); ``unfinished`` holds them as dicts."""


class BackendUnavailableError(AInferPDError, ImportError):
    """An optional backend (DeepEP, CUDA, verl) is not installed on this host."""


class OwnershipAuditError(AInferPDError):
    """Phase-owned communication state is shared between phases."""


class RankFailedError(DistributedError):
    """A spawned rank raised, died, or did not finish in time (``ainfer_pd.launch.spawn``).

    ``failures`` maps rank -> a one-line reason (remote traceback in the message);
    ``unfinished`` lists the ranks killed on timeout; ``results`` holds each rank's return
    value or exception (``None`` where none came back).
    """

    def __init__(self, message: str, *, failures: dict | None = None,
                 unfinished: tuple[int, ...] = (), results: list | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.unfinished = tuple(unfinished)
        self.results = list(results or [])


class EpochActiveError(TurnstileError):
    """A P epoch was begun while another one is still active on this rank."""


class EndpointNotReachedError(TurnstileError):
    """A permit was granted before P reached the current permit endpoint (D must wait first)."""


class InvalidSpanError(TurnstileError, ValueError):
    """A turnstile span outside the validated range 1..4."""


class TurnstileTimeout(TurnstileError, TimeoutError):
    """A turnstile wait (permit or boundary) did not finish in time; names epoch and boundary."""

    def __init__(self, message: str, *, epoch: int | None = None, boundary: int | float | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.boundary = boundary


class DispatchStateError(AInferPDError):
    """An expert dispatch was used outside its lifecycle order (see subclasses)."""


class DispatchPendingError(DispatchStateError):
    """The dispatcher buffer already holds a pending dispatch (at most one per buffer)."""


class BufferRetiredError(DispatchStateError):
    """A cancelled dispatch retired the buffer; it is reusable only after ``quiesce()``."""


class DispatchCancelledError(DispatchStateError):
    """The dispatch was cancelled; its data must never be used or written anywhere."""


class PeerLostError(DistributedError):
    """A peer rank died or stopped responding (its heartbeat stopped) while this rank waited
    on it; ``ranks`` names the lost ranks."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class EpochFailedError(AInferPDError):
    """A P epoch failed on this rank; the turns it carried end with this error."""


class SamplingError(AInferPDError):
    """This request's next-token distribution was not a distribution (NaN, +inf or no finite
    mass, e.g. non-finite logits); only this request fails, the rest of its batch goes on."""


class SpecInputError(AInferPDError, ValueError):
    """A speculative-decoding function (:mod:`ainfer_pd.spec`) got malformed input: a token that is
    not a token id, a draft longer than the verification's width, logits and rows that disagree, a
    cost table without its one-token time."""


class WrongEventLoopError(AInferPDError, RuntimeError):
    """The worker was used from an event loop (or thread) other than the one that entered
    ``async with RolloutWorker(...)``; a worker belongs to one loop for its whole life."""


class WorkerAsleepError(AInferPDError):
    """The worker gave its device memory back (``sleep(level >= 1)``, or weights dropped and not
    yet synced): call ``wake_up`` (and sync the weights) first."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that already names a request in flight on this server (verl's ``request_id``):
    the second request is refused, the first goes on."""


class UnsupportedOptionError(ConfigError, InvalidRequestError):
    """A rollout or sampling option (verl's ``rollout.*`` key: a configuration error; a
    ``sampling_params`` key: an invalid request) asks for something this engine does not do;
    ``key`` names it."""

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class WeightSyncError(WeightUpdateError, DistributedError):
    """A weight sync of a multi-rank worker failed on every rank (issue 34, item 16): a sync is one
    collective act, and this rank's call was refused because a peer's part of it failed, was
    refused, or disagreed. ``ranks`` names the ranks at fault; nothing was written on any rank."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class WeightSyncMismatchError(WeightSyncError):
    """The ranks of one weight sync were given different manifests (names, shapes, dtypes or
    ``partial``); the message names the ranks and the first difference."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A rank did not take part in a weight sync in time; ``missing_ranks`` (also ``ranks``) names
    the ranks that never joined."""

    def __init__(self, message: str, *, missing_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message, ranks=missing_ranks)
        self.missing_ranks = tuple(missing_ranks)


def first_error(exc: BaseException, *, typed_only: bool = False) -> BaseException | None:
    """The error an exception group (a failed TaskGroup) stands for, unwrapped: its first
    :class:`AInferPDError`, else (unless ``typed_only``) its first exception that is not a
    cancellation; None when there is none. A plain exception stands for itself."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            flat.append(e)
    walk(exc)
    typed = [e for e in flat if isinstance(e, AInferPDError)]
    if typed or typed_only:
        return typed[0] if typed else None
    import asyncio
    rest = [e for e in flat if not isinstance(e, asyncio.CancelledError)]
    return rest[0] if rest else None
