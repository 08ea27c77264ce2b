"""Registers ainfer-pd with verl 0.9.x; importing this module is the whole registration.

Loaded by verl at ``import verl`` through either

* the ``verl.plugins`` entry point declared by ainfer-pd's ``pyproject.toml``
  (``VERL_USE_EXTERNAL_PLUGINS`` unset/``auto``, or naming ``ainfer_pd``), or
* ``VERL_USE_EXTERNAL_MODULES=ainfer_pd.integrations.verl.register``.

It registers

* ``RolloutReplicaRegistry["ainfer_pd"]`` -> :class:`.replica.AInferPDReplica` (lazy loader),
* ``_ROLLOUT_REGISTRY[("ainfer_pd", "async")]`` -> :class:`.rollout.AInferPDServerAdapter`,
* the agent loop ``ainfer_pd_tool_agent`` (:mod:`.agent_loop`).

This module runs inside ``import verl``; it must only import verl submodules that do not
import back the partially-initialised top-level package's attributes at load time.
"""
from __future__ import annotations

ROLLOUT_NAME = "ainfer_pd"
AGENT_LOOP_NAME = "ainfer_pd_tool_agent"
ADAPTER_FQN = "ainfer_pd.integrations.verl.rollout.AInferPDServerAdapter"


def _load_replica():
    from .replica import AInferPDReplica
    return AInferPDReplica


def register() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_FQN
    from . import agent_loop  # noqa: F401  (@register("ainfer_pd_tool_agent"))


register()
