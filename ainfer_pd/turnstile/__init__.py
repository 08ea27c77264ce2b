"""Rank-aligned turnstile (SPEC 3.2): pure controller, async mechanism, rendezvous interface."""
from .controller import TaskState, TurnstileController, check_span
from .rendezvous import LocalRendezvous, Rendezvous, assert_agree
from .turnstile import EpochHandle, Round, Turnstile

__all__ = ["TaskState", "TurnstileController", "check_span", "Rendezvous", "LocalRendezvous",
           "assert_agree", "Turnstile", "EpochHandle", "Round"]
