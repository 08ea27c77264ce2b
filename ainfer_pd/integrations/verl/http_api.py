"""The optional token-in / token-out HTTP endpoint of the verl server (``http: true``)."""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Any


async def start_http(server: Any, host: str) -> tuple[Any, int, asyncio.Task]:
    """Serve ``GET /health`` and ``POST /generate`` for ``server`` on ``host`` (a free port);
    returns the uvicorn server (set ``should_exit`` to stop it), the port and its serving task
    (the caller owns it: await it after ``should_exit``)."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"ok": server.worker is not None}

    @app.post("/generate")
    async def http_generate(body: dict) -> dict:
        out = await server.generate(body["prompt_ids"], body.get("sampling_params", {}),
                                    body.get("request_id", f"http-{time.monotonic_ns()}"),
                                    session_id=body.get("session_id"))
        return out.model_dump()

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.ensure_future(http.serve(sockets=[sock]))
    return http, port, task
