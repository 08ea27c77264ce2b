"""The named worker configs shipped with the package (``*.yaml``: topologies, the tiny CPU models,
the H200 shapes). Read them through :mod:`ainfer_pd.config_files`; the repository's top-level
``configs`` is a link to this folder, so ``configs/tiny-cpu.yaml`` works from a checkout."""
