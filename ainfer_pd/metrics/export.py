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
from typing import Any, Mapping

LOG_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("ainfer_pd_log_context", default={})


def prometheus_text(metrics: Mapping[str, Any], *, rank: int = 0, prefix: str = "ainfer_pd") -> str:
    """The numeric entries of ``metrics`` in the text exposition format, labelled with ``rank``
    (the same families as the server's ``/metrics``: :mod:`ainfer_pd.metrics.prometheus`)."""
    from .prometheus import numeric_samples, render
    return render(numeric_samples(metrics, prefix, {"rank": str(rank)}))


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
