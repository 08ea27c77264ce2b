"""Every named config in configs/ loads, and the paper topologies have SPEC section 2's numbers."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ainfer_pd.config import WorkerConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# name: (GPUs, EP, ADP, ATP, ETP, crossed)  -- SPEC section 2 table
PAPER = {
    "h1": (4, 1, 2, 2, 4, True),
    "h2": (4, 1, 2, 2, 4, True),
    "h3": (8, 8, 8, 1, 1, False),
    "h4": (8, 8, 8, 1, 1, False),
    "crossed": (8, 8, 2, 4, 1, True),
    "two-node": (16, 16, 8, 2, 1, True),
}


def all_configs():
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def test_expected_configs_exist():
    assert set(PAPER) | {"tiny-cpu", "one-h200"} <= set(all_configs())


@pytest.mark.parametrize("name", all_configs())
def test_config_loads_with_name_and_description(name):
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert raw.get("name") and raw.get("description"), f"{name}.yaml needs name: and description:"
    cfg = WorkerConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert WorkerConfig.from_dict(cfg.to_dict()) == cfg          # round-trips, every key known


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_topology_numbers(name):
    g, ep, adp, atp, etp, crossed = PAPER[name]
    cfg = WorkerConfig.from_yaml(CONFIGS / f"{name}.yaml")
    p, m = cfg.parallel, cfg.model
    assert (p.world_size, p.expert_parallel, p.attn_dp, p.atp, p.etp, p.crossed) == (g, ep, adp, atp, etp, crossed)
    # paper model (SPEC 2): 42 layers, hidden 2560, 512 routed experts, top-8, BF16
    assert (m.num_layers, m.hidden_size, m.num_experts, m.top_k, m.dtype) == (42, 2560, 512, 8, "bfloat16")
    assert cfg.device.device == "cuda"
    if ep > 1:
        assert p.expert_backend == "deepep"
    if name == "two-node":
        assert cfg.scheduler.max_prefill_tokens == 32 * 1024
    mtp_on = name in ("h2", "h4")
    desc = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["description"]
    assert ("MTP ON" in desc) == mtp_on


def test_one_h200_is_paper_shaped_and_fits():
    cfg = WorkerConfig.from_yaml(CONFIGS / "one-h200.yaml")
    m = cfg.model
    assert (m.hidden_size, m.num_experts, m.top_k, m.num_heads, m.num_kv_heads, m.head_dim, m.expert_intermediate) \
        == (2560, 512, 8, 20, 4, 128, 512)
    assert 8 <= m.num_layers <= 12 and m.dtype == "bfloat16" and cfg.device.device == "cuda"
    assert cfg.parallel.world_size == 1 and not cfg.parallel.crossed
    weight_bytes = m.num_params * 2
    assert weight_bytes < 0.5 * 141e9, "weights must leave the H200 room for KV and activations"


def test_cli_set_overrides_and_stream_priority_validation():
    from ainfer_pd.tools.options import load_config
    from ainfer_pd.errors import ConfigError
    cfg = load_config("configs/h200-bench.yaml", ["device.high_priority_stream=P", "scheduler.max_decode_batch=64"])
    assert cfg.device.high_priority_stream == "P" and cfg.scheduler.max_decode_batch == 64
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config("configs/h200-bench.yaml", ["device.high_priority_stream"])
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config("configs/h200-bench.yaml", ["device.no_such_key=1"])
    with pytest.raises(ConfigError, match="high_priority_stream"):
        load_config("configs/h200-bench.yaml", ["device.high_priority_stream=X"])


def test_p_stream_sm_partition_is_validated_and_refused_off_cuda():
    from ainfer_pd.tools.options import load_config
    from ainfer_pd.engine.runtime.device import make_device
    from ainfer_pd.errors import ConfigError
    from ainfer_pd.metrics.recorder import Recorder
    assert load_config("configs/h200-bench.yaml", ["device.p_stream_sms=96"]).device.p_stream_sms == 96
    for bad in ("-8", "true", "1.5"):
        with pytest.raises(ConfigError, match="p_stream_sms"):
            load_config("configs/h200-bench.yaml", [f"device.p_stream_sms={bad}"])
    with pytest.raises(ConfigError, match="no priority"):
        load_config("configs/h200-bench.yaml", ["device.p_stream_sms=96", "device.high_priority_stream=P"])
    with pytest.raises(ConfigError, match="needs a CUDA device; this one is cpu"):
        make_device("cpu", Recorder(), lane_sms={("P", "gated"): 96})
    make_device("cpu", Recorder(), lane_sms={("P", "gated"): 0}).shutdown()   # no partition asked: the stand-in builds


# name -> the piece the engine names when it refuses the config (None: the engine builds it)
ENGINE_SUPPORT = {"h1": "expert tensor parallelism", "h2": "expert tensor parallelism",
                  "h3": "DeepEP", "h4": "DeepEP", "crossed": "DeepEP", "two-node": "DeepEP"}


@pytest.mark.parametrize("name", all_configs())
def test_every_named_config_is_built_or_refused_naming_the_missing_piece(name):
    from ainfer_pd.engine.make import check_engine_support
    from ainfer_pd.errors import NotBuiltError
    cfg = WorkerConfig.from_yaml(CONFIGS / f"{name}.yaml")
    want = ENGINE_SUPPORT.get(name)
    if want is None:
        check_engine_support(cfg)                       # world size 1, or the tiny crossed CPU config
        return
    with pytest.raises(NotBuiltError) as ei:
        check_engine_support(cfg)
    assert want in ei.value.missing and want in str(ei.value)
    # the same topology with the missing piece supplied is built (the crossed path of tiny-crossed-cpu)
    fix = {"parallel.expert_backend": "torch", "parallel.expert_parallel": cfg.parallel.world_size}
    check_engine_support(cfg.replace(**fix))


def test_routing_replay_under_attention_tp_is_refused_by_name():
    from ainfer_pd.engine.make import check_engine_support
    from ainfer_pd.errors import NotBuiltError
    cfg = WorkerConfig.from_yaml(CONFIGS / "tiny-crossed-cpu.yaml")
    check_engine_support(cfg)
    with pytest.raises(NotBuiltError) as ei:
        check_engine_support(cfg.replace(**{"cache.routed_experts": True}))
    assert "routing replay under attention tensor parallelism" in ei.value.missing
    check_engine_support(cfg.replace(**{"cache.routed_experts": True, "parallel.attn_dp": 4}))   # ATP 1: built
