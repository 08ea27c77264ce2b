"""Multi-turn agentic traces (SPEC section 5): the data and its JSONL form
(:mod:`.trace_schema`) and the generators (:mod:`.trace_gen`: paper-shaped, GRPO long-context,
controls), re-exported here as the one import path
(``from ainfer_pd.tools.trace import Trace, make_trace``).
"""
from .trace_gen import (CONTEXT_KNOTS, GRPO_CONTEXT_LIMIT, GRPO_GROUP_SIZE, GRPO_GROUPS,  # noqa: F401
                        GRPO_MAX_TURNS, GRPO_MIN_TURNS, grpo_agentic_trace, grpo_percentile_targets)
from .trace_gen import (GEN_TOKENS_KNOTS, NEW_TOKENS_KNOTS, PAPER_CONTINUATIONS,  # noqa: F401
                        PAPER_CONVERSATIONS, PAPER_INPUT_TOKENS, PAPER_MAX_TURNS, PAPER_OUTPUT_TOKENS,
                        PAPER_PERCENTILES, PAPER_REQUESTS, SHORT_CONVERSATION_FRACTION,
                        TOOL_WAIT_KNOTS, QuantileDistribution, check_percentiles, decode_only_trace,
                        make_trace, p_heavy_trace, paper_trace)
from .trace_schema import (CELLS, Conversation, Trace, Turn, cell_wait_factor, load_jsonl,  # noqa: F401
                           save_jsonl)
