"""Benchmark scripts (run by path: ``python benchmarks/<name>.py``) and the NCCL-layer diagnostic
harness (:mod:`benchmarks.nccl_harness`, run as ``python -m benchmarks.nccl_harness``). A package
so that tests import the harness as ``benchmarks.nccl_harness`` from the repository root."""
