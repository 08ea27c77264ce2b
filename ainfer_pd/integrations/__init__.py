"""Integrations of ainfer-pd with RL trainers.

Each sub-package imports its trainer lazily: ``import ainfer_pd.integrations`` never
imports a trainer. ``ainfer_pd.integrations.verl`` plugs ainfer-pd into verl 0.9.x
(install with ``pip install 'ainfer-pd[verl]'``).
"""
