"""Operators: Prometheus text metrics, structured logs, no paths in logs, loopback binding."""
import json
import logging

from ainfer_pd import SamplingParams
from ainfer_pd.metrics.export import JsonFormatter, configure_logging, prometheus_text, set_log_context


async def test_metrics_export_in_prometheus_text_format(worker):
    out = await worker.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=3, temperature=0.0))
    text = worker.metrics_text()
    assert '# TYPE ainfer_pd_finished_total counter' in text
    assert 'ainfer_pd_finished_total{rank="0"} 1.0' in text
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.startswith("ainfer_pd_") and name.endswith('{rank="0"}')
    await worker.release(out.trajectory_id)


def test_prometheus_text_skips_lists_and_non_finite_values():
    text = prometheus_text({"a": 1, "b": float("nan"), "c": [1, 2], "d_s_sum": 2.5}, rank=3)
    assert 'ainfer_pd_a{rank="3"} 1.0' in text and "ainfer_pd_b" not in text and "ainfer_pd_c" not in text
    assert "# TYPE ainfer_pd_d_s_sum_total counter" in text


def test_structured_log_records_carry_rank_epoch_and_boundary():
    set_log_context(epoch=7, boundary=3)
    rec = logging.LogRecord("ainfer_pd.engine", logging.WARNING, __file__, 1, "P epoch %d failed", (7,), None)
    data = json.loads(JsonFormatter(rank=2).format(rec))
    assert data == {**data, "rank": 2, "epoch": 7, "boundary": 3, "msg": "P epoch 7 failed", "level": "WARNING"}
    h = configure_logging(rank=1)
    assert isinstance(h.formatter, JsonFormatter)
    logging.getLogger("ainfer_pd").removeHandler(h)


async def test_a_failed_run_leaves_a_timeline_that_shows_where_it_stopped(tmp_path):
    import asyncio
    from ainfer_pd import RolloutWorker
    from ainfer_pd.tools.cli import main
    from tests.conftest import tiny_cfg
    cfg = tiny_cfg(**{"trace_dir": str(tmp_path), "faults": {"p_error_epoch": 1}})
    async with RolloutWorker(cfg) as w:
        res = await asyncio.gather(w.generate([5] * 40, SamplingParams(max_new_tokens=3)), return_exceptions=True)
        assert isinstance(res[0], BaseException)
    data = json.loads((tmp_path / "timeline_rank0.json").read_text())
    assert data["intervals"]
    assert main(["timeline", str(tmp_path)]) == 0
    assert (tmp_path / "timeline_rank0.png").exists()
