"""The engine's loop: one step (:mod:`ainfer_pd.sched.step`) over a coordinator, a P driver (the
epoch and its walk) and a D driver (one iteration, with an optional previous one in flight), the
timings they keep, the multi-rank parts, and the mixed-chunked reference loop."""
