"""``python -m benchmarks.nccl_harness`` / ``torchrun ... -m benchmarks.nccl_harness``."""
import sys

from benchmarks.nccl_harness.launcher import main

sys.exit(main())
