"""The harness around the library: the ``ainfer-pd`` command line and what it runs.

:mod:`.cli` (``replay | bench | trace | trace-check | selftest | timeline``), :mod:`.bench`
(policies x cells x repeats), :mod:`.replay` (the closed-loop client), :mod:`.world` (the replay
over N rank processes, torchrun), :mod:`.soak`, :mod:`.selftest` and :mod:`.audit_check` (the
SPEC section 7 acceptance list), the traces (:mod:`.trace`: :mod:`.trace_schema` and
:mod:`.trace_gen`), the run reports (:mod:`.report`, :mod:`.plots`, :mod:`.tracecheck`,
:mod:`.timeline_cli`).

This layer imports the library; the library never imports it.
"""
