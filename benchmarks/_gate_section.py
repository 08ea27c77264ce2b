"""A GPU-gate section run as a subprocess (``_gate_nccl``, ``_gate_spec``): its JSON of checks and
figures recorded through the gate's ``check`` / ``fig``, and ``<name>_section_completes`` saying the
subprocess ended cleanly (with its log's tail when it did not)."""
from __future__ import annotations

import json
import sys
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


def run_section(name: str, script: Path, args: list[str], out_dir: Path, run_sub, check, fig, timeout: int) -> None:
    """The gate's side: ``script --json OUT/<name>.json *args`` as a subprocess (``run_sub``, the
    gate's), then :func:`record`."""
    js, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    js.unlink(missing_ok=True)
    rc = run_sub(name, [sys.executable, str(script), "--json", str(js), *args], timeout, log)
    record(name, rc, js, log, check, fig)


def finish(res: dict, json_path: str) -> None:
    """The subprocess's side: its checks and figures to ``json_path``, a PASS / FAIL line a check,
    exit 0 only when there are checks and all passed."""
    Path(json_path).write_text(json.dumps(res, indent=1, default=str))
    for name, (ok, detail) in res["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    sys.exit(0 if res["checks"] and all(ok for ok, _ in res["checks"].values()) else 1)
