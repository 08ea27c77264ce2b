"""``python -m ainfer_pd.tools ...``: the ``ainfer-pd`` command line."""
import sys

from .cli import main

sys.exit(main())
