import asyncio, time, json
from ainfer_pd import RolloutWorker, WorkerConfig
from ainfer_pd.tools.soak import soak, verify_against_fresh
async def main():
    base = WorkerConfig.from_yaml("configs/tiny-cpu.yaml")
    cfg = base.replace(**{"scheduler.policy": "fine-grained", "cache.num_blocks": 512, "mux.activation_threshold": 1})
    t = time.perf_counter()
    async with RolloutWorker(cfg) as w:
        res = await soak(w, num_trajectories=300, turns=3, seed=1, cancel_p=0.1, abort_p=0.1)
        m = w.metrics(); leak = w.kv_leak_free() and w.engine.kv.num_free_blocks == 512
    wall = time.perf_counter() - t
    bad = await verify_against_fresh(base, res.outputs)
    print(json.dumps({"trajectories": 300, "requests": res.requests, "completed": res.completed, "aborted": res.aborted,
                      "cancelled": res.cancelled, "failed": res.failed, "reconciles": res.reconciles,
                      "worker_finished": m["finished"], "worker_aborted": m["aborted"], "kv_evictions": m["kv_evictions"],
                      "dropped_results": m["dropped_results"], "kv_back_to_initial": leak,
                      "completed_turns_differing_from_fault_free": bad, "wall_s": round(wall, 1)}))
asyncio.run(main())
