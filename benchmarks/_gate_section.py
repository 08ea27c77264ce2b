"""A GPU-gate section run as a subprocess (``_gate_nccl``, ``_gate_spec``): its JSON of checks and
figures recorded through the gate's ``check`` / ``fig``, and ``<name>_section_completes`` saying the
subprocess ended cleanly (with its log's tail when it did not)."""
from __future__ import annotations

import json
from pathlib import Path


def record(name: str, rc: int, js: Path, log: Path, check, fig) -> None:
    res = json.loads(js.read_text()) if js.exists() else {}
    for check_name, (ok, detail) in res.get("checks", {}).items():
        check(check_name, ok, detail)
    for fig_name, value in res.get("figures", {}).items():
        fig(fig_name, value)
    tail = " | ".join(log.read_text().splitlines()[-6:]) if log.exists() else "no log"
    check(f"{name}_section_completes", rc == 0 and bool(res.get("checks")),
          f"rc {rc}, {len(res.get('checks', {}))} checks" + ("" if rc == 0 else f"; log tail: {tail[-600:]}"))
