"""ainfer-pd as a verl 0.9.x rollout backend (``rollout.name=ainfer_pd``) and agent loop.

Modules: :mod:`.sampling` (pure), :mod:`.server` (Ray actor), :mod:`.replica`
(``RolloutReplica``), :mod:`.rollout` (``BaseRollout`` adapter), :mod:`.agent_loop`
(``ainfer_pd_tool_agent``), :mod:`.register` (registration, the ``verl.plugins`` entry
point). Importing this package imports nothing from verl.
"""
from .sampling import IGNORED_KEYS, to_sampling_params

__all__ = ["IGNORED_KEYS", "to_sampling_params"]
