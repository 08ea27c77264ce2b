"""verl replicas on CPU (issue 15): startup time of a 1-rank vs a 2-rank (ADP2 / EP2) replica launched
through verl's replica class (a Ray actor; rank 1 its child process), and the wall time of a short
agent-loop rollout (``ainfer_pd_tool_agent``, verl's LLMServerClient + router, a scripted tool).

    python benchmarks/verl_replica_bench.py [--episodes 4] [--turns 3] [--max-tokens 16] [--repeats 2]

Prints one line per (ranks, repeat) and a summary (median). CPU only: the figures show the cost
of the extra rank (process start, gloo world, lockstep steps), not a GPU speed-up.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = {1: str(ROOT / "configs" / "tiny-cpu.yaml"), 2: str(ROOT / "configs" / "tiny-2rank-cpu.yaml")}


def rollout_config(cfg_path: str, turns: int):
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    rc = RolloutConfig(name="ainfer_pd", tensor_model_parallel_size=1, n_gpus_per_node=1, nnodes=1,
                       prompt_length=512, response_length=256, free_cache_engine=True,
                       engine_kwargs={"ainfer_pd": {"config": cfg_path}})

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not (k == "_target_" and not v)}
        return x
    d = strip(OmegaConf.to_container(OmegaConf.structured(rc)))
    d["_target_"] = "verl.workers.config.RolloutConfig"
    d["multi_turn"]["format"] = "ainfer_pd_bench"
    d["multi_turn"]["max_assistant_turns"] = turns
    d["multi_turn"]["max_tool_response_length"] = 256
    return OmegaConf.create(d)


async def one(ranks: int, args) -> tuple[float, float, int]:
    import hydra
    import ray
    import verl  # noqa: F401  (the verl.plugins entry point registers ainfer_pd)
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    from verl.workers.rollout.router import get_router_handle

    from ainfer_pd.integrations.verl.scripted import scripted_tool, word_tokenizer

    rc = rollout_config(CONFIGS[ranks], args.turns)
    cls = get_rollout_replica_class("ainfer_pd")
    replica = cls(replica_rank=0, config=rc, model_config={}, gpus_per_node=1, name_suffix=f"bench{time.time_ns()}")
    t0 = time.perf_counter()
    await replica.init_local(RolloutMode.HYBRID)
    startup = time.perf_counter() - t0
    server = replica.server_handle
    try:
        cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": rc, "model": {}}, "data": {}})
        client = LLMServerClient(cfg, load_balancer_handle=get_router_handle(servers={replica.server_address: server}))
        tok, tl = word_tokenizer(), scripted_tool("ainfer_pd_bench")

        def new_loop():                      # one agent loop per episode (as verl's workers run them)
            return hydra.utils.instantiate(
                _agent_loop_registry["ainfer_pd_tool_agent"], trainer_config=DictConfigWrap(cfg),
                server_manager=client, tokenizer=tok, processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
                data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([tl]))
        sp = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": args.max_tokens,
              "ignore_eos": True}
        # warm-up turn (first-call costs: Ray method resolution, the router)
        await server.generate.remote([3, 4, 5, 6], dict(sp, max_tokens=2), "warm")
        t1 = time.perf_counter()
        outs = await asyncio.gather(*[
            new_loop().run(dict(sp), raw_prompt=[{"role": "user", "content": " ".join(f"t{20 + (i * 7 + j) % 400}"
                                                                               for j in range(48))}])
            for i in range(args.episodes)])
        rollout = time.perf_counter() - t1
        tokens = sum(int(sum(o.response_mask)) for o in outs)
        ranks_ms = (await server.metrics.remote())["server"].get("rank_start_ms")
        if ranks_ms is not None:
            print(f"  (inside the actor: ranks started and joined in {ranks_ms / 1000:.2f} s)", flush=True)
    finally:
        await replica.shutdown()
        for s in replica.servers:
            ray.kill(s)
    return startup, rollout, tokens


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    res: dict[int, list] = {1: [], 2: []}
    try:
        for rep in range(args.repeats):
            for ranks in (1, 2):
                s, r, n = await one(ranks, args)
                res[ranks].append((s, r, n))
                print(f"ranks={ranks} repeat={rep} startup_s={s:.2f} rollout_s={r:.2f} "
                      f"({args.episodes} episodes x {args.turns} turns, {n} generated tokens)", flush=True)
    finally:
        ray.shutdown()
    for ranks, rows in res.items():
        print(f"summary ranks={ranks}: startup median {statistics.median(x[0] for x in rows):.2f} s, "
              f"rollout median {statistics.median(x[1] for x in rows):.2f} s, tokens {rows[0][2]}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    asyncio.run(main())
