"""Phase-owned communication state lives on the phase's context (SPEC 3.4)."""
import pytest

from ainfer_pd.phase import Phase, PhaseComm, PhaseContext


def test_a_context_starts_local_and_its_comm_state_is_installed_once():
    p, d = PhaseContext(Phase.PREFILL, None), PhaseContext(Phase.DECODE, None)
    assert p.comm is not d.comm and p.comm.hooks is None            # one rank: local passes
    p.comm.install("P collectives", "P dispatcher", "P hooks")
    assert (p.comm.collectives, p.comm.dispatcher, p.comm.hooks) == ("P collectives", "P dispatcher", "P hooks")
    assert d.comm == PhaseComm()                                     # the other phase's state is untouched
    with pytest.raises(RuntimeError, match="installed once"):
        p.comm.install("again", None, "again")
