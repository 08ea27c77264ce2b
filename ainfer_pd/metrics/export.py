"""Operator-facing output: Prometheus text exposition and structured log records.

``prometheus_text(metrics, rank=...)`` renders the numeric entries of ``worker.metrics()``
(counters, sums, means, fractions) in the Prometheus text format; lists are skipped.
``configure_logging(rank)`` installs a formatter whose records carry ``rank``, ``epoch`` and
``boundary`` (the engine updates :data:`LOG_CONTEXT` as it moves), JSON per line.
"""
from __future__ import annotations

import contextvars
import json
import logging
import math
import re
from typing import Any, Mapping

LOG_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("ainfer_pd_log_context", default={})

_NAME = re.compile(r"[^a-zA-Z0-9_]")


def prometheus_text(metrics: Mapping[str, Any], *, rank: int = 0, prefix: str = "ainfer_pd") -> str:
    lines: list[str] = []
    for key in sorted(metrics):
        v = metrics[key]
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            continue
        name = f"{prefix}_{_NAME.sub('_', key)}"
        kind = "counter" if key.endswith(("_count", "_sum")) or key in ("rendezvous", "finished", "aborted",
                                                                       "failures", "dropped_results") else "gauge"
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f'{name}{{rank="{rank}"}} {float(v)!r}')
    return "\n".join(lines) + "\n"


def set_log_context(**fields: Any) -> None:
    LOG_CONTEXT.set({**LOG_CONTEXT.get(), **fields})


class JsonFormatter(logging.Formatter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        ctx = LOG_CONTEXT.get()
        rec = {"t": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "rank": self.rank, "epoch": ctx.get("epoch"), "boundary": ctx.get("boundary"),
               "msg": record.getMessage()}
        return json.dumps(rec)


def configure_logging(rank: int = 0, level: int = logging.INFO) -> logging.Handler:
    """Structured JSON lines on stderr for the ``ainfer_pd`` loggers (idempotent per process)."""
    logger = logging.getLogger("ainfer_pd")
    for h in list(logger.handlers):
        if isinstance(h.formatter, JsonFormatter):
            logger.removeHandler(h)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(rank))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
