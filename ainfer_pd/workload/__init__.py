"""Workload: paper-shaped trace generator and the closed-loop replay client."""
from .trace import (CELLS, PAPER_PERCENTILES, Conversation, QuantileDistribution, Trace, Turn,
                    cell_wait_factor, check_percentiles, decode_only_trace, load_jsonl, make_trace,
                    p_heavy_trace, paper_trace, save_jsonl)
from .replay import ReplayResult, RequestRecord, TrajectoryRecord, conversation_token_ids, replay

__all__ = [
    "CELLS", "PAPER_PERCENTILES", "Conversation", "QuantileDistribution", "Trace", "Turn",
    "cell_wait_factor", "check_percentiles", "decode_only_trace", "load_jsonl", "make_trace",
    "p_heavy_trace", "paper_trace", "save_jsonl",
    "ReplayResult", "RequestRecord", "TrajectoryRecord", "conversation_token_ids", "replay",
]
