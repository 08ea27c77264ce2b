"""A diagnostic of the NCCL layer, outside the library: the crossed-order stall (SPEC 2) and its
fix (SPEC 3.3) on real ranks with a synthetic schedule (torch matmuls and the attention
collectives), the real turnstile and rendezvous, and the library's phase collectives
(:class:`ainfer_pd.comm.collectives.RankCollectives`), on the CPU stand-in (gloo) or one GPU per
rank (NCCL). The engine itself does not use it: ``ainfer-pd selftest`` and the crossed-order
tests run the real engine.

* :mod:`.spec`: what one run is (:class:`~.spec.HarnessSpec`), the stream of each collective and
  what a completed run must show (rounds, overlap);
* :mod:`.harness`: one run on one rank (:class:`~.harness.RankRun`: the synthetic schedule, the
  watchdog, the outcome);
* :mod:`.ranks`: one rank's runs over its process groups and the parent side
  (:func:`~.ranks.run_harness`);
* :mod:`.cuda_device`: the CUDA stand-ins of the harness (residency gate, completion poller,
  the collective's stream item whose completion comes from CUDA events);
* :mod:`.launcher`: the command line, ``python -m benchmarks.nccl_harness`` (or under
  ``torchrun -m benchmarks.nccl_harness``).
"""
