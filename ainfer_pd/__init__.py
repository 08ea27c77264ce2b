"""ainfer-pd: communication-safe in-place P/D multiplexing for agentic MoE rollout."""
from .config import WorkerConfig
from .errors import AInferPDError
from .request import SamplingParams, TurnOutput
from .worker import RolloutWorker

__all__ = ["RolloutWorker", "WorkerConfig", "SamplingParams", "TurnOutput", "AInferPDError"]
__version__ = "0.1.0"
