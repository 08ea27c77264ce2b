"""The synthetic multi-rank ordering harness (being retired: the engine runs the crossed topology)."""
