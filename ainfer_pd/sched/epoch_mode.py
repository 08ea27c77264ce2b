"""Policies as data: what a scheduler policy means for one P epoch (pure).

The engines read an :class:`EpochMode` (and a policy's :class:`PolicyTraits`), never the policy
name. :func:`epoch_mode` maps (policy, D present, multiplexing active) to the mode of one epoch:

==================  =========  ==========================================================
policy              turnstile  a gated epoch (D present and the activation on)
==================  =========  ==========================================================
normal              no         never gated; D waits while P is admissible or running
global-complete     yes        one boundary; its final publish after P *completed*
global-enqueue      yes        one boundary; its final publish once P is *enqueued*
fine-grained        yes        a boundary per expert notification and layer end; span policy
==================  =========  ==========================================================

An epoch that is not gated while decode rows exist is *exclusive*: D waits for it (strict P
priority); under ``normal`` every epoch is exclusive.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..errors import ConfigError

__all__ = ["PolicyTraits", "EpochMode", "EpochFinal", "policy_traits", "epoch_mode", "mode_of", "POLICIES",
           "TURNSTILE_POLICIES"]


class EpochFinal(StrEnum):
    """When a gated epoch publishes its final boundary."""

    LAYER = "layer"          # per-layer boundaries: the last layer end is final
    ENQUEUE = "enqueue"      # one boundary: published once P is fully enqueued
    COMPLETE = "complete"    # one boundary: published once P completed


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    turnstile: bool
    """P epochs may be multiplexed with D through the turnstile."""
    per_layer: bool
    """Boundaries at every expert notification and layer end (and the span policy picks K)."""
    final: EpochFinal | None
    """When a gated epoch publishes its final boundary; None without a turnstile."""
    p_priority: bool
    """D runs only while no P is admissible or running (``normal``)."""
    multi_rank: bool = True
    """The policy runs on several ranks (the lockstep step); the mixed-chunked reference does not."""
    mixed_steps: bool = False
    """No P epochs of its own: each step is one batch of decode rows plus a prefill chunk."""


_TRAITS = {
    "normal": PolicyTraits(turnstile=False, per_layer=False, final=None, p_priority=True),
    "global-complete": PolicyTraits(turnstile=True, per_layer=False, final=EpochFinal.COMPLETE, p_priority=False),
    "global-enqueue": PolicyTraits(turnstile=True, per_layer=False, final=EpochFinal.ENQUEUE, p_priority=False),
    "fine-grained": PolicyTraits(turnstile=True, per_layer=True, final=EpochFinal.LAYER, p_priority=False),
    # the single-rank reference loop: no P epochs of its own (mixed steps), no turnstile
    "mixed-chunked": PolicyTraits(turnstile=False, per_layer=False, final=None, p_priority=False,
                                  multi_rank=False, mixed_steps=True),
}

POLICIES = tuple(_TRAITS)
"""Every scheduler policy, in the ladder's order (the one registry: config validation and the bench read it)."""
TURNSTILE_POLICIES = tuple(p for p, t in _TRAITS.items() if t.turnstile)


@dataclass(frozen=True, slots=True)
class EpochMode:
    gated: bool
    """The epoch goes through the turnstile (stops at its boundaries for D rounds)."""
    exclusive: bool
    """D waits for the epoch."""
    per_layer: bool
    """Gated at every boundary (fine-grained); else one boundary."""
    final: EpochFinal | None
    """Gated epochs: when the final boundary is published (see :class:`PolicyTraits`); else None."""


def policy_traits(policy: str) -> PolicyTraits:
    try:
        return _TRAITS[policy]
    except KeyError:
        raise ConfigError(f"scheduler.policy={policy!r}: expected one of {tuple(_TRAITS)}") from None


def epoch_mode(policy: str, has_d: bool, active: bool) -> EpochMode:
    """The mode of one P epoch under ``policy`` when decode rows exist (``has_d``) and the
    multiplexing activation is on (``active``)."""
    return mode_of(policy_traits(policy), has_d, active)


def mode_of(t: PolicyTraits, has_d: bool, active: bool) -> EpochMode:
    """:func:`epoch_mode` from a policy's traits."""
    gated = t.turnstile and has_d and active
    return EpochMode(gated=gated, exclusive=t.p_priority or (has_d and not gated),
                     per_layer=gated and t.per_layer, final=t.final if gated else None)
