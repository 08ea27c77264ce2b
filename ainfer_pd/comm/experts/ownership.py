"""Ownership registry and audit of expert-communication state (SPEC §3.4).

Every mutable object the expert path uses is registered to exactly one phase, or to
the shared set. ``audit()`` proves the two phases are disjoint:

| owner  | kinds |
|--------|-------|
| shared | runtime, topology, links, weights, kv_storage |
| P      | buffer, counters, workspace, stream, events, qp_range |
| D      | the same, plus double_buffer_index |

Phases may own more kinds (e.g. ``process_group``); the shared set may not hold
anything else. Separate buffers with a shared counter, event or QP index is the bug
this catches: memory does not alias, but protocol progress does.

The registry keeps a strong reference to every registered Python object so that an
``id()`` stays unique for as long as the registry lives.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal, Union

from ...errors import ConfigError, OwnershipAuditError
from ...phase import Phase

SHARED: Literal["shared"] = "shared"
Owner = Union[Phase, Literal["shared"]]

SHARED_KINDS = ("runtime", "topology", "links", "weights", "kv_storage")
REQUIRED_KINDS: dict[Phase, tuple[str, ...]] = {
    Phase.PREFILL: ("buffer", "counters", "workspace", "stream", "events", "qp_range"),
    Phase.DECODE: ("buffer", "counters", "workspace", "stream", "events", "qp_range",
                   "double_buffer_index"),
}
# Kinds whose bytes count as the phase's memory cost (streams, events, groups are ~free).
MEMORY_KINDS = ("buffer", "counters", "workspace")


@dataclass(frozen=True, slots=True)
class OwnedObject:
    """One registered object. ``address_range`` is ``[start, end)`` in bytes."""

    kind: str
    name: str
    owner: Owner
    identity: int
    address_range: tuple[int, int] | None = None
    size_bytes: int = 0
    qp_range: tuple[int, int] | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["owner"] = _owner_str(self.owner)
        return d


@dataclass(frozen=True, slots=True)
class Violation:
    code: str
    """shared-identity | address-overlap | qp-overlap | missing-kind | mutable-shared | bad-owner"""
    message: str
    objects: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "objects": list(self.objects)}


@dataclass(frozen=True, slots=True)
class AuditReport:
    ok: bool
    violations: tuple[Violation, ...]
    objects: tuple[OwnedObject, ...]
    bytes_by_owner: dict[str, int] = field(default_factory=dict)

    @property
    def phase_memory_bytes(self) -> int:
        """Memory cost of the second phase's state: the P-owned buffers, counters and
        workspace that an in-place P/D engine adds next to the D state it has anyway."""
        return self.bytes_by_owner.get(Phase.PREFILL.value, 0)

    @property
    def both_phases_bytes(self) -> int:
        return self.bytes_by_owner.get("P", 0) + self.bytes_by_owner.get("D", 0)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the run trace."""
        return {
            "ok": self.ok,
            "violations": [v.to_dict() for v in self.violations],
            "num_objects": len(self.objects),
            "objects": [o.to_dict() for o in self.objects],
            "bytes_by_owner": dict(self.bytes_by_owner),
            "phase_memory_bytes": self.phase_memory_bytes,
            "both_phases_bytes": self.both_phases_bytes,
        }


def _owner_str(owner: Owner) -> str:
    return owner.value if isinstance(owner, Phase) else str(owner)


def tensor_range(t) -> tuple[int, int] | None:
    """``[start, end)`` byte range a tensor's elements span (None when empty)."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return (start, start + extent * t.element_size())


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    if a is None or b is None or a[0] >= a[1] or b[0] >= b[1]:
        return False
    return a[0] < b[1] and b[0] < a[1]


class OwnershipRegistry:
    """Collects :class:`OwnedObject` records and audits them."""

    def __init__(self) -> None:
        self._objects: list[OwnedObject] = []
        self._keepalive: list[Any] = []

    # ---- registration -------------------------------------------------------------
    def register(self, kind: str, name: str, owner: Owner, obj: Any = None, *,
                 identity: int | None = None, address_range: tuple[int, int] | None = None,
                 size_bytes: int | None = None, qp_range: tuple[int, int] | None = None,
                 note: str = "") -> OwnedObject:
        """Register ``obj`` (a tensor, stream, event, group, ...) or a bare identity.

        A tensor's address range and size are taken from it unless given.
        """
        if not (isinstance(owner, Phase) or owner == SHARED):
            raise ConfigError(f"owner of {name!r} must be a Phase or 'shared', got {owner!r}")
        if obj is None and identity is None:
            raise ConfigError(f"register({name!r}): give an object or an identity")
        if obj is not None:
            self._keepalive.append(obj)
            if identity is None:
                identity = id(obj)
            if _is_tensor(obj):
                if address_range is None:
                    address_range = tensor_range(obj)
                if size_bytes is None:
                    size_bytes = obj.numel() * obj.element_size()
        rec = OwnedObject(kind=kind, name=name, owner=owner, identity=int(identity),
                          address_range=address_range, size_bytes=int(size_bytes or 0),
                          qp_range=qp_range, note=note)
        self._objects.append(rec)
        return rec

    def add(self, objects: Iterable[OwnedObject], keepalive: Any = None) -> None:
        """Add records produced elsewhere (``dispatcher.owned_objects()``)."""
        self._objects.extend(objects)
        if keepalive is not None:
            self._keepalive.append(keepalive)

    def add_dispatcher(self, dispatcher: Any) -> None:
        self.add(dispatcher.owned_objects(), keepalive=dispatcher)

    @property
    def objects(self) -> tuple[OwnedObject, ...]:
        return tuple(self._objects)

    # ---- audit ------------------------------------------------------------------------
    def audit(self, *, strict: bool = False,
              phases: tuple[Phase, ...] = (Phase.PREFILL, Phase.DECODE)) -> AuditReport:
        """Prove P and D state disjoint; ``strict`` raises :class:`OwnershipAuditError`."""
        objs = list(self._objects)
        violations: list[Violation] = []
        violations += _owner_violations(objs)
        violations += _identity_violations(objs)
        violations += _address_violations(objs)
        violations += _qp_violations(objs)
        violations += _missing_kinds(objs, phases)
        report = AuditReport(ok=not violations, violations=tuple(violations),
                             objects=tuple(objs), bytes_by_owner=_bytes_by_owner(objs))
        if strict and not report.ok:
            raise OwnershipAuditError(
                "phase-owned expert state is not disjoint: "
                + "; ".join(v.message for v in report.violations))
        return report


def _owner_violations(objs: list[OwnedObject]) -> list[Violation]:
    """Only the shared kinds are shared, and they are never owned by a phase."""
    violations: list[Violation] = []
    for o in objs:
        if o.owner == SHARED and o.kind not in SHARED_KINDS:
            violations.append(Violation(
                "mutable-shared",
                f"{o.kind} {o.name!r} is in the shared set; only {SHARED_KINDS} may be shared",
                (o.name,)))
        if isinstance(o.owner, Phase) and o.kind in SHARED_KINDS:
            violations.append(Violation(
                "bad-owner", f"{o.kind} {o.name!r} must be shared, not owned by {o.owner.value}",
                (o.name,)))
    return violations


def _identity_violations(objs: list[OwnedObject]) -> list[Violation]:
    """One identity, one owner."""
    violations: list[Violation] = []
    owners_by_id: dict[int, dict[str, list[OwnedObject]]] = {}
    for o in objs:
        owners_by_id.setdefault(o.identity, {}).setdefault(_owner_str(o.owner), []).append(o)
    for ident, by_owner in owners_by_id.items():
        if len(by_owner) > 1:
            names = tuple(f"{k}:{o.kind}:{o.name}" for k, lst in by_owner.items() for o in lst)
            violations.append(Violation(
                "shared-identity",
                f"object id {ident:#x} is registered to {sorted(by_owner)}: {', '.join(names)}",
                names))
    return violations


def _address_violations(objs: list[OwnedObject]) -> list[Violation]:
    """Address ranges: P vs D, and phase vs shared."""
    violations: list[Violation] = []
    pairs = [(Phase.PREFILL, Phase.DECODE), (Phase.PREFILL, SHARED), (Phase.DECODE, SHARED)]
    for a_owner, b_owner in pairs:
        a_objs = [o for o in objs if o.owner == a_owner and o.address_range]
        b_objs = [o for o in objs if o.owner == b_owner and o.address_range]
        for a in a_objs:
            for b in b_objs:
                if a.identity != b.identity and _overlap(a.address_range, b.address_range):
                    violations.append(Violation(
                        "address-overlap",
                        f"{_owner_str(a_owner)}:{a.name} {_fmt(a.address_range)} overlaps "
                        f"{_owner_str(b_owner)}:{b.name} {_fmt(b.address_range)}",
                        (a.name, b.name)))
    return violations


def _qp_violations(objs: list[OwnedObject]) -> list[Violation]:
    """QP index ranges: P vs D."""
    violations: list[Violation] = []
    p_qps = [o for o in objs if o.owner is Phase.PREFILL and o.qp_range]
    d_qps = [o for o in objs if o.owner is Phase.DECODE and o.qp_range]
    for a in p_qps:
        for b in d_qps:
            if _overlap(a.qp_range, b.qp_range):
                violations.append(Violation(
                    "qp-overlap",
                    f"P:{a.name} QPs {_fmt(a.qp_range)} overlap D:{b.name} QPs {_fmt(b.qp_range)}",
                    (a.name, b.name)))
    return violations


def _missing_kinds(objs: list[OwnedObject], phases: tuple[Phase, ...]) -> list[Violation]:
    """Completeness: every mutable kind of the table, per phase."""
    violations: list[Violation] = []
    for ph in phases:
        have = {o.kind for o in objs if o.owner is ph}
        for kind in REQUIRED_KINDS[ph]:
            if kind not in have:
                violations.append(Violation(
                    "missing-kind", f"phase {ph.value} registered no {kind!r}", ()))
    return violations


def _bytes_by_owner(objs: list[OwnedObject]) -> dict[str, int]:
    """Memory-kind bytes per owner, each (owner, identity) counted once."""
    bytes_by_owner: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    for o in objs:
        key = (_owner_str(o.owner), o.identity)
        if o.kind in MEMORY_KINDS and key not in seen:
            seen.add(key)
            bytes_by_owner[key[0]] = bytes_by_owner.get(key[0], 0) + o.size_bytes
    return bytes_by_owner


def _fmt(r: tuple[int, int] | None) -> str:
    return "none" if r is None else f"[{r[0]:#x}, {r[1]:#x})" if r[1] > 4096 else f"[{r[0]}, {r[1]})"


def _is_tensor(obj: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, torch.Tensor)


def rank_registry(engine) -> OwnershipRegistry:
    """Every mutable object of one rank's engine, registered to P, D or the shared set (SPEC 3.4):
    the expert dispatchers' own state, each phase's engine stream and attention collectives, and
    the shared KV storage, weights and control rendezvous."""
    dist = engine.dist
    reg = dist.dispatchers.registry() if dist.dispatchers is not None else OwnershipRegistry()
    for ctx in (engine.prefill_ctx, engine.decode_ctx):
        reg.register("engine_stream", f"{ctx.phase.value}.engine_stream", ctx.phase, ctx.stream)
    dist.colls.register_owned(reg)               # each phase's attention collectives: its own state
    reg.register("kv_storage", "kv_cache", SHARED, engine.runner.kv_cache)
    for name, p in engine.runner.model.named_parameters():
        reg.register("weights", name, SHARED, p)
    reg.register("runtime", "control_rendezvous", SHARED, dist.rdv)
    return reg


def audit_rank(engine, *, strict: bool = False) -> AuditReport:
    """:func:`rank_registry`'s audit, recorded as the ``ownership_audit`` event."""
    report = rank_registry(engine).audit(strict=strict)
    engine.rec.event("ownership_audit", ok=report.ok, violations=[str(v) for v in report.violations],
                     phase_memory_bytes=report.phase_memory_bytes)
    return report
