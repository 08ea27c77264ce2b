"""The speculator's empty-draft backoff (ainfer_pd.spec.backoff): a row whose draft came back empty
is not drafted again until its re-probe (the wait doubling up to a cap), a batch of rows all in
backoff is not worth drafting (the D loop stays overlapped, no host drafting), a row that drafts
again is reset, a new turn is probed at once, and the plans and skipped rows are counted."""
from __future__ import annotations

import pytest

from ainfer_pd import SamplingParams
from ainfer_pd.config_spec import SpecConfig
from ainfer_pd.engine.loop.state import Trajectory, Turn
from ainfer_pd.errors import SpecInputError
from ainfer_pd.spec.adaptive import VerifyCosts
from ainfer_pd.spec.backoff import MAX_REST, MAX_WAIT, NO_BACKOFF, Backoff, Rest, after_draft
from ainfer_pd.spec.speculator import SpecBatch, Speculator

CHEAP = VerifyCosts.from_times({B: {1: 1.0, 2: 1.001, 3: 1.002, 5: 1.004} for B in (1, 4, 16)})


class _Rec:
    def count(self, name: str, value: float = 1.0) -> None:
        pass


def _turn(tid: str, context: list[int]) -> Turn:
    return Turn(f"r-{tid}", Trajectory(tid), SamplingParams(max_new_tokens=1000), list(context), [], 0, None, 0.0)


def _spec(adaptive: bool = False) -> Speculator:
    return Speculator(SpecConfig(method="suffix", adaptive=adaptive, num_draft_tokens=4), 4096,
                      CHEAP if adaptive else None, _Rec())


def _step(t: Turn, token: int) -> None:
    """The iteration emitted ``token`` for the row (a zero-length draft: one token)."""
    t.out_tokens.append(token)


FRESH = iter(range(10_000, 20_000))     # tokens no context has seen: no earlier match, no draft


def test_the_wait_doubles_up_to_the_cap_and_a_draft_resets_it():
    b, waits = NO_BACKOFF, []
    for n in range(10):
        b = after_draft(b, 100 + n, 0)
        waits.append(b.wait)
    assert waits == [1, 2, 4, 8, 16, 32, 32, 32, 32, 32] and MAX_WAIT == 32
    b = after_draft(NO_BACKOFF, 50, 0)
    assert not b.probes(50) and not b.probes(51) and b.probes(52)     # one iteration skipped
    assert after_draft(Backoff(8, 70), 70, 3) == NO_BACKOFF
    with pytest.raises(SpecInputError, match="drafted"):
        after_draft(NO_BACKOFF, 10, -1)


def test_a_row_with_no_draft_is_not_drafted_again_until_its_re_probe():
    spec = _spec()
    t = _turn("a", list(range(1, 40)))                   # no repeat: no draft
    drafted = []
    spec.drafter.draft = (lambda orig: lambda tid, k: drafted.append(tid) or orig(tid, k))(spec.drafter.draft)
    probed_at = []
    for i in range(40):
        n = len(drafted)
        assert spec.plan([t]) is None
        if len(drafted) > n:
            probed_at.append(i)
        _step(t, next(FRESH))
    # probed, 1 skipped, probed, 2 skipped, probed, 4 skipped, ... 8, 16
    assert probed_at == [0, 2, 5, 10, 19, 36]
    m = spec.metrics()
    assert m["spec_empty_plans"] == 40 and m["spec_rows_skipped"] == 40 - len(probed_at)


def test_a_batch_of_rows_all_in_backoff_is_not_worth_drafting():
    for adaptive in (False, True):
        spec = _spec(adaptive)
        rows = [_turn(f"r{i}", [100 * i + j for j in range(30)]) for i in range(4)]
        assert spec.worth_drafting(rows)                     # never probed: worth a try
        assert spec.plan(rows) is None                       # nobody had a draft: all in backoff
        for t in rows:
            _step(t, next(FRESH))
        assert not spec.worth_drafting(rows)
        # one row out of backoff (a periodic context: it drafts) makes the batch worth drafting
        rows.append(_turn("p", [7, 8, 9] * 6))
        assert spec.worth_drafting(rows)
        batch = spec.plan(rows)
        assert batch is not None and batch.drafts[:4] == [[]] * 4 and batch.drafts[4]
        assert spec.metrics()["spec_rows_skipped"] == 4


def test_a_row_that_gets_a_draft_again_is_reset():
    spec = _spec()
    t = _turn("a", [1, 2, 3, 4, 5, 6])
    assert spec.plan([t]) is None and spec.backoff["a"][1].wait == 1
    for tok in (10, 11):                                  # skipped once, then probed empty again
        _step(t, tok)
        assert spec.plan([t]) is None
    assert spec.backoff["a"][1].wait == 2
    for tok in (1, 2, 3):                                 # the context now ends with a repeat of 1 2 3
        _step(t, tok)
    assert spec.probes(t)
    batch = spec.plan([t])
    assert batch is not None and batch.drafts[0][:2] == [4, 5]
    assert "a" not in spec.backoff and spec.probes(t)     # reset: drafted every iteration again


def test_a_new_turn_of_a_row_in_backoff_is_probed_at_once_and_forget_drops_the_backoff():
    spec = _spec()
    t = _turn("a", [1, 2, 3, 4, 5, 6])
    spec.plan([t])
    _step(t, 20)
    assert not spec.probes(t)
    nxt = Turn("r-a2", t.traj, SamplingParams(max_new_tokens=1000), t.context + t.out_tokens + [30], [], 0, None, 0.0)
    assert spec.probes(nxt)
    spec.plan([nxt])
    assert spec.backoff["a"][1].wait == 2                 # the trajectory's wait carries over
    spec.release("a")
    assert not spec.backoff


def test_a_device_drafter_s_rows_never_back_off():
    """An MTP row's empty draft is transient (no hidden state stashed yet): it is drafted again at
    the next iteration, and a batch of such rows stays worth drafting."""
    class Device:
        def __init__(self) -> None:
            self.asked = []

        async def prepare(self, rows, caps) -> None:
            pass

        def draft(self, tid, k):
            self.asked.append(tid)
            return []

        def extend(self, tid, tokens, group=""):
            pass

        def forget(self, tid):
            pass

        release = forget

    d = Device()
    spec = Speculator(SpecConfig(method="suffix", adaptive=False, num_draft_tokens=4), 4096, None, _Rec(), d)
    t = _turn("m", list(range(1, 40)))
    for _ in range(5):
        assert spec.worth_drafting([t])
        assert spec.plan([t]) is None
        _step(t, next(FRESH))
    assert d.asked == ["m"] * 5 and spec.num_rows_skipped == 0 and not spec.backoff


def test_measured_host_time_stops_speculating_and_fades_until_it_is_tried_again():
    spec = _spec(adaptive=True)                          # CHEAP: a verify costs ~a plain iteration
    t = _turn("h", [5, 6, 7, 8] * 10)                    # repeats: the suffix drafter has drafts
    assert spec.worth_drafting([t])
    spec.overhead.observe_host(0.5)
    assert spec.overhead.host_s == 0.5
    spec.overhead.observe_host(1.5)
    assert spec.overhead.host_s == pytest.approx(0.7 * 0.5 + 0.3 * 1.5)
    spec.overhead.observe_host(100.0)                             # host time 30x a plain iteration (1 s at B 1)
    assert not spec.worth_drafting([t])
    tries = 1
    while not spec.worth_drafting([t]):                  # each idle iteration forgets a little
        tries += 1
        assert tries < 400
    assert 100 < tries < 400
    assert spec.metrics()["spec_host_ms"] == pytest.approx(1e3 * spec.overhead.host_s)
    batch = spec.plan([t])
    assert batch is not None and batch.host_s > 0


def test_the_stale_probe_settles_only_for_a_row_with_a_draft_and_books_the_empty_ones():
    """Overlapped, before the iteration in flight is read: rows whose known tokens give no draft
    book an empty probe (backoff) and give no reason to settle; a periodic row does; a row in
    backoff or at its cap is not probed; a device drafter always settles."""
    spec = _spec()
    rows = [_turn(f"r{i}", [100 * i + j for j in range(30)]) for i in range(3)]
    assert not spec.stale_hit(rows)
    assert all(spec.backoff[t.tid][1].wait == 1 for t in rows)
    assert not spec.stale_hit(rows) and all(spec.backoff[t.tid][1].wait == 1 for t in rows)   # in backoff: skipped
    periodic = _turn("p", [7, 8, 9] * 6)
    assert spec.stale_hit(rows + [periodic]) and "p" not in spec.backoff
    full = _turn("f", [7, 8, 9] * 6)
    full.params = SamplingParams(max_new_tokens=1)
    assert spec.cap(full) == 0 and not spec.stale_hit([full]) and "f" not in spec.backoff

    class Device:
        async def prepare(self, rows, caps) -> None:
            pass

        def draft(self, tid, k):
            raise AssertionError("a device drafter is not probed on stale tokens")

        def extend(self, tid, tokens, group=""):
            pass

        release = forget = lambda self, tid: None

    dev = Speculator(SpecConfig(method="suffix", adaptive=False, num_draft_tokens=4), 4096, None, _Rec(), Device())
    assert dev.stale_hit(rows)


def test_a_stale_probe_s_foretold_token_is_booked_as_one_draft_judged():
    """The stale probe's draft foretells the token in flight: once read, the plan books it in the
    row's acceptance (accepted when equal, rejected otherwise), as a verify of one draft would; a
    row that samples away from its drafts then loses its rate without ever verifying."""
    spec = _spec(adaptive=True)
    hit, miss = _turn("h", [7, 8, 9] * 6), _turn("m", [4, 5, 6] * 6)
    assert spec.stale_hit([hit, miss]) and set(spec._stale) == {"h", "m"}
    _step(hit, 7)                       # the period's next token: as foretold
    _step(miss, next(FRESH))            # sampled away from it
    spec.plan([hit, miss])
    prior = 0.5
    assert spec.acc["h"].rate > prior > spec.acc["m"].rate
    assert spec.acc["m"].tried == spec.acc["h"].tried and not spec._stale
    before = dict(spec.acc)
    spec.plan([hit, miss])              # nothing foretold since: nothing booked
    assert spec.acc == before


def test_worth_drafting_counts_rows_not_probed_as_plain_rows():
    """Rows in backoff are left out of the choice but still count in the batch: one probing row
    among many is not worth a verify that costs every row a wider pass, alone it is."""
    costs = VerifyCosts.from_times({B: {1: 1.0, 2: 1.08, 3: 1.1, 5: 1.15} for B in (1, 4, 16)})
    spec = Speculator(SpecConfig(method="suffix", adaptive=True, num_draft_tokens=4), 4096, costs, _Rec())
    quiet = [_turn(f"q{i}", [100 * i + j for j in range(30)]) for i in range(12)]
    assert not spec.stale_hit(quiet)                       # every one drafted empty: in backoff now
    probing = _turn("p", [7, 8, 9] * 6)
    assert not spec.worth_drafting([probing])              # that fruitless probe rests the speculator once
    assert spec.worth_drafting([probing])
    assert not spec.worth_drafting([probing] + quiet)


def test_probing_rows_agrees_with_probes_and_cap_row_by_row():
    """``probing_rows`` (the per-iteration pass, inlined) keeps exactly the rows that
    :meth:`Speculator.probes` drafts now with ``cap`` > 0, with those caps: rows in backoff, past
    it, at their length limit, a new turn of a backed-off trajectory."""
    from ainfer_pd.spec.speculator import probing_rows
    spec = _spec()
    rows = [_turn(f"r{i}", [100 * i + j for j in range(30)]) for i in range(6)]
    spec.stale_hit(rows)                                  # all drafted empty: in backoff
    _step(rows[1], next(FRESH)), _step(rows[1], next(FRESH))       # past its wait
    rows[2].params = SamplingParams(max_new_tokens=1)     # cap 0
    rows[3] = _turn("r3", list(rows[3].context))          # a new turn of r3: probed at once
    want = [(t.tid, spec.cap(t)) for t in rows if spec.probes(t) and spec.cap(t)]
    got, caps = probing_rows(rows, spec.backoff, spec.k_max, spec.max_context_len, spec.on_device)
    assert [(t.tid, c) for t, c in zip(got, caps)] == want and {t for t, _ in want} == {"r1", "r3"}


def test_measured_device_idle_counts_against_drafting_as_host_time_does():
    """``lost_s`` (the overlap a draft gave up) is added to the host time in the choice: idle 30x
    a plain iteration stops drafting, and it fades with the host time until the batch is tried."""
    spec = _spec(adaptive=True)
    t = _turn("i", [5, 6, 7, 8] * 10)
    assert spec.worth_drafting([t])
    spec.overhead.observe_lost(100.0)
    assert spec.overhead.total_s == 100.0 and spec.overhead.host_s == 0.0
    assert not spec.worth_drafting([t])
    tries = 1
    while not spec.worth_drafting([t]):
        tries += 1
        assert tries < 400
    assert 100 < tries < 400
    assert spec.metrics()["spec_lost_ms"] == pytest.approx(1e3 * spec.overhead.lost_s)


def test_the_rest_doubles_after_each_fruitless_try_up_to_its_cap_and_a_paying_verify_resets_it():
    r = Rest()
    assert not r.tick()
    r.fruitless()                                        # rests the next 1 iteration, then 2, 4, ...
    for wait in (1, 2, 4, 8, 16, 32, MAX_REST):
        assert r.resting() and [r.tick() for _ in range(wait)] == [True] * wait
        assert not r.resting() and not r.tick()
        r.fruitless()
    r.paid()
    assert not r.resting() and not r.tick()
    never = Rest(max_wait=0)
    never.fruitless()
    assert not never.tick()


def test_a_fruitless_try_rests_the_speculator_with_no_check_at_all():
    """Adaptive host drafting: a batch the table stops, then a plan with no verify, rest the whole
    speculator (``worth_drafting`` answers no without looking at the rows: they are never probed),
    the overhead still fading at each iteration; a verify that accepted a draft ends the rest."""
    spec = _spec(adaptive=True)
    t = _turn("h", [5, 6, 7, 8] * 10)
    looked = []
    real = Speculator._worth
    spec._worth = lambda rows, world_rows: looked.append(len(rows)) or real(spec, rows, world_rows)
    spec.overhead.observe_host(100.0)
    assert not spec.worth_drafting([t]) and looked == [1]          # the table: K = 0, fruitless
    before = spec.overhead.total_s
    assert not spec.worth_drafting([t]) and looked == [1]          # resting: no check
    assert spec.overhead.total_s < before                          # it fades all the same
    spec.overhead = type(spec.overhead)()                          # the overhead forgotten
    assert spec.worth_drafting([t]) and len(looked) == 2
    batch = spec.plan([t])
    assert batch is not None
    spec.observe(batch, [0])                                       # accepted nothing: fruitless
    assert spec.rest.resting() and not spec.worth_drafting([t]) and len(looked) == 2
    while not spec.worth_drafting([t]):
        pass
    spec.observe(spec.plan([t]), [1])                              # a draft accepted: no rest
    assert not spec.rest.resting() and spec.rest.wait == 0


def test_only_a_verify_that_paid_for_itself_ends_the_rest():
    """Adaptive: a verify ends the speculator's rest only when its booked rows emitted more tokens than
    plain decoding would have in its time at the table's price; one accepted draft among four rows
    verifying at 1.9x a plain pass bought less than it cost (5 tokens for 4 x 1.9) and rests it
    like a verify that accepted nothing. Not adaptive: any accepted draft."""
    dear = VerifyCosts.from_times({B: {1: 1.0, 2: 1.9, 3: 2.8, 5: 4.6} for B in (1, 4, 16)})
    rows = [_turn(f"v{i}", [3, 4, 5] * 8) for i in range(4)]
    for accepted, pays in (([1, 0, 0, 0], False), ([0, 0, 0, 0], False), ([1, 1, 1, 1], True),
                           ([1, 0, None, None], False), ([1, 1, None, None], True)):
        spec = Speculator(SpecConfig(method="suffix", adaptive=True, num_draft_tokens=4), 4096, dear, _Rec())
        spec.observe(SpecBatch(rows, [[9]] * 4, 1, 1.2), accepted)
        assert spec.rest.resting() is not pays, accepted
    plain = _spec(adaptive=False)
    plain.rest = Rest()                                  # a rest to end (not adaptive: never rests itself)
    plain.rest.fruitless()
    plain.observe(SpecBatch(rows, [[9]] * 4, 1, 1.0), [1, 0, 0, 0])
    assert not plain.rest.resting()


def test_the_stale_probe_settles_only_for_drafts_the_cost_table_would_verify():
    """Adaptive: a stale draft found is not enough to give the overlap up; its rows' drafts (what
    follows the token in flight) must pay at the table's cost with the overhead in it. Expensive
    verifies keep the overlap (and rest the speculator); cheap ones settle."""
    dear = VerifyCosts.from_times({B: {1: 1.0, 2: 1.9, 3: 2.8, 5: 4.6} for B in (1, 4, 16)})
    for costs, settles in ((CHEAP, True), (dear, False)):
        spec = Speculator(SpecConfig(method="suffix", adaptive=True, num_draft_tokens=4), 4096, costs, _Rec())
        rows = [_turn(f"p{i}", [7 + i, 8, 9] * 6) for i in range(2)]
        assert spec.stale_hit(rows) is settles and len(spec._stale) == 2
        assert spec.rest.resting() is not settles
