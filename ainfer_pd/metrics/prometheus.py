"""A Prometheus scrape endpoint: ``GET /metrics`` over plain asyncio streams (no web framework).

:func:`worker_families` turns one rank's ``worker.metrics()`` (plus its queue lengths) into
``(name, kind, value, labels)`` samples; :func:`render` writes samples in the text exposition
format 0.0.4 (one ``# TYPE`` per family); :class:`MetricsEndpoint` serves whatever its async
``collect()`` callable renders, on the event loop it was started on (the worker's), so reading
the worker's state needs no lock. Anything but ``GET /metrics`` gets 404 / 405.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional

log = logging.getLogger("ainfer_pd.prometheus")

Sample = tuple[str, str, float, dict]
_NAME = re.compile(r"[^a-zA-Z0-9_]")
COUNTERS = frozenset({"finished", "aborted", "failures", "dropped_results", "rendezvous", "kv_evictions",
                      "num_epochs", "prefix_prompt_tokens", "prefix_reused_tokens", "prefill_tokens",
                      "activation_switches"})


def metric_name(prefix: str, key: str) -> str:
    return f"{prefix}_{_NAME.sub('_', key)}"


def numeric_samples(metrics: Mapping[str, Any], prefix: str, labels: dict, counters: Iterable[str] = ()) -> list[Sample]:
    """Every finite number (bools as 0/1) of ``metrics``; lists, dicts and strings are skipped."""
    counters = set(counters) | COUNTERS
    out: list[Sample] = []
    for key in sorted(metrics):
        v = metrics[key]
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
            continue
        kind = "counter" if key in counters or key.endswith(("_count", "_sum")) else "gauge"
        name = metric_name(prefix, key)
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"                      # the exposition convention for counters
        out.append((name, kind, float(v), labels))
    return out


def worker_families(metrics: Mapping[str, Any], *, rank: int, waiting: int, decoding: int,
                    prefix: str = "ainfer_pd") -> list[Sample]:
    """One rank's samples: its metrics, KV blocks used, queue lengths, rendezvous counts (the
    turnstile's, and the lockstep engine's step rendezvous: 0 at world size 1)."""
    labels = {"rank": str(rank)}
    metrics = {"rendezvous": 0, **metrics, "step_rendezvous": metrics.get("step_sync_s_count", 0)}
    out = numeric_samples(metrics, prefix, labels, counters=("step_rendezvous",))
    if "kv_total_blocks" in metrics and "kv_free_blocks" in metrics:
        out.append((f"{prefix}_kv_used_blocks", "gauge",
                    float(metrics["kv_total_blocks"] - metrics["kv_free_blocks"]), labels))
    out.append((f"{prefix}_queue_waiting", "gauge", float(waiting), labels))
    out.append((f"{prefix}_queue_decoding", "gauge", float(decoding), labels))
    return out


def _label_text(labels: dict) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def render(samples: Iterable[Sample]) -> str:
    """Text exposition: samples grouped by family, one ``# TYPE`` line each."""
    fams: dict[str, tuple[str, list]] = {}
    for name, kind, value, labels in samples:
        fams.setdefault(name, (kind, []))[1].append((labels, value))
    lines: list[str] = []
    for name in sorted(fams):
        kind, rows = fams[name]
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{_label_text(lab)} {val!r}" for lab, val in rows)
    return "\n".join(lines) + "\n"


class MetricsEndpoint:
    """``http://host:port/metrics`` (``port`` 0: a free one, see :attr:`port` once started)."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, collect: Callable[[], Awaitable[str]], *, host: str = "127.0.0.1", port: int = 0,
                 read_timeout_s: float = 10.0) -> None:
        self.collect = collect
        self.host = host
        self.requested_port = int(port)
        self.port: Optional[int] = None
        self.read_timeout_s = read_timeout_s
        self._server: Optional[asyncio.base_events.Server] = None
        self.scrapes = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            srv, self._server = self._server, None
            srv.close()
            await srv.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
            if method != "GET":
                status, body = "405 Method Not Allowed", "GET only\n"
            elif path.split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", "try /metrics\n"
            else:
                status, body = "200 OK", await self.collect()
                self.scrapes += 1
            data = body.encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {self.CONTENT_TYPE}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except Exception as exc:  # noqa: BLE001 - a failing collect must not kill the endpoint
            log.warning("metrics scrape failed: %r", exc)
            try:
                msg = f"metrics collection failed: {exc!r}\n".encode()
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: "
                             + str(len(msg)).encode() + b"\r\nConnection: close\r\n\r\n" + msg)
                await writer.drain()
            except ConnectionError:
                pass
        finally:
            writer.close()
