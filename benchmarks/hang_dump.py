"""Run ``ainfer_pd.tools.cli`` with every thread's stack dumped after N seconds (hang diagnosis).

    torchrun --standalone --nproc-per-node 1 benchmarks/hang_dump.py 45 replay --config configs/tiny-cuda.yaml ...
"""
import faulthandler
import runpy
import sys

if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
    sys.argv = ["ainfer-pd", *sys.argv[2:]]
    runpy.run_module("ainfer_pd.tools.cli", run_name="__main__")
