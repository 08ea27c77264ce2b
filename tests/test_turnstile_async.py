"""The async turnstile with a fake P task and a fake D loop (SPEC 3.2, DESIGN 4)."""
from __future__ import annotations

import asyncio
import random

import pytest

from ainfer_pd.errors import (MissingProducerError, RendezvousMismatch, RendezvousTimeout,
                              StaleEpochError, TurnstileTimeout)
from ainfer_pd.metrics.recorder import Recorder
from ainfer_pd.sched.span import SpanInputs, auto_span, fixed_span
from ainfer_pd.turnstile import LocalRendezvous, Rendezvous, Round, TaskState, Turnstile, assert_agree


# ------------------------------------------------------------ test doubles
class EventRecorder(Recorder):
    """A recorder that keeps its control events in memory."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank=rank)
        self.events: list[tuple[str, dict]] = []

    def event(self, name: str, **attrs) -> None:
        self.events.append((name, attrs))

    def names(self) -> list[str]:
        return [n for n, _ in self.events]


class MemoryHub:
    """An in-memory multi-rank rendezvous: rank views meet per (tag, arrival number)."""

    def __init__(self, world_size: int, timeout_s: float = 5.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.slots: dict[tuple[str, int], dict] = {}

    def rank(self, r: int) -> "MemoryRendezvous":
        return MemoryRendezvous(self, r)


class MemoryRendezvous:
    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size
        self.seq: dict[str, int] = {}
        self.arrivals = 0

    async def arrive(self, tag, payload, *, epoch=None, boundary=None):
        n = self.seq.get(tag, 0)
        self.seq[tag] = n + 1
        self.arrivals += 1
        slot = self.hub.slots.setdefault((tag, n), {"payloads": {}, "done": asyncio.Event()})
        slot["payloads"][self.rank] = tuple(payload)
        if len(slot["payloads"]) == self.world_size:
            slot["done"].set()
        try:
            await asyncio.wait_for(slot["done"].wait(), self.hub.timeout_s)
        except TimeoutError:
            missing = tuple(r for r in range(self.world_size) if r not in slot["payloads"])
            raise RendezvousTimeout(f"rendezvous {tag!r} #{n} at epoch {epoch} boundary {boundary}: "
                                    f"ranks {missing} missing", missing_ranks=missing,
                                    epoch=epoch, boundary=boundary) from None
        return [slot["payloads"][r] for r in range(self.world_size)]

    async def close(self):
        pass


async def fake_p(ts: Turnstile, epoch: int, n: int, log: list, *, final: bool = False,
                 d_enqueued: bool = False, hold: asyncio.Event | None = None,
                 skew: random.Random | None = None, exit_delay: float = 0.0) -> None:
    """A P epoch of boundaries 0..n: permit(b), enqueue the segment, publish(b + 1)."""
    async with ts.epoch(epoch, gated=True, d_enqueued=d_enqueued) as ep:
        for b in range(n):
            await ep.permit(b)
            log.append(("P", b, ts.controller.permit))
            if hold is not None and b == 0:
                await hold.wait()  # e.g. waiting for receive counts
            await asyncio.sleep(skew.random() * 0.002 if skew else 0)
            ep.publish(b + 1, final=final and b + 1 == n)
        if n == 0:
            ep.publish(0, final=final)
        if exit_delay:
            await asyncio.sleep(exit_delay)


async def fake_d(ts: Turnstile, stop: asyncio.Event, log: list, rounds: list[Round],
                 skew: random.Random | None = None) -> None:
    """A D loop: one round per iteration while a gated epoch is owed rounds, free otherwise."""
    while True:
        rnd = await ts.before_decode()
        if rnd is None:
            if stop.is_set():
                return
            await asyncio.sleep(0.0005)
            continue
        ctl = ts.controller
        at_endpoint = rnd.ended or (ctl.reached == ctl.permit == rnd.permit) or ctl.final == rnd.boundary
        assert at_endpoint, f"D round {rnd} while P is at {ctl.snapshot()}"
        assert rnd.last or rnd.boundary == rnd.permit
        rounds.append(rnd)
        log.append(("D", rnd.boundary, rnd.permit))
        await asyncio.sleep(skew.random() * 0.002 if skew else 0)  # graph launch
        await ts.after_decode(rnd)


def expected_rounds(n: int, k: int, *, d_enqueued: bool, final: bool) -> list[int]:
    """Permit endpoints of the D rounds of one epoch with final boundary n and fixed span k."""
    p = k if d_enqueued else 0
    ends = []
    while p <= n:
        ends.append(p)
        p += k
    if final and ends and ends[-1] == n:
        return ends
    return ends + [p]  # the tail round: P finished (or left) below the permit


async def run_one_epoch(k: int, n: int, *, final: bool, d_enqueued: bool):
    rec = EventRecorder()
    rdv = LocalRendezvous()
    ts = Turnstile(rendezvous=rdv, span=fixed_span(k), recorder=rec, timeout_s=5)
    log, rounds, stop = [], [], asyncio.Event()
    d = asyncio.create_task(fake_d(ts, stop, log, rounds))
    await fake_p(ts, 1, n, log, final=final, d_enqueued=d_enqueued)
    stop.set()
    await asyncio.wait_for(d, 5)
    return ts, rec, rdv, log, rounds


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 4, 5, 8])
@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("d_enqueued", [False, True])
async def test_d_rounds_happen_only_at_endpoints_and_their_number_matches(k, n, final, d_enqueued):
    ts, rec, rdv, log, rounds = await run_one_epoch(k, n, final=final, d_enqueued=d_enqueued)
    assert [r.permit for r in rounds] == expected_rounds(n, k, d_enqueued=d_enqueued, final=final)
    assert rounds[-1].last and not any(r.last for r in rounds[:-1])
    assert all(r.boundary == r.permit for r in rounds[:-1])
    assert rdv.arrivals == 2 * len(rounds) == rec.counters["rendezvous"]
    assert len(rec.samples["rendezvous_s"]) == 2 * len(rounds)
    assert ts.controller.state is TaskState.DONE and not ts.gated_epoch_active


async def test_p_waits_for_each_permit_and_passes_a_boundary_only_below_it():
    ts, rec, _, log, rounds = await run_one_epoch(2, 7, final=False, d_enqueued=False)
    passes = [(b, p) for who, b, p in log if who == "P"]
    assert [b for b, _ in passes] == list(range(7))
    assert all(b < p for b, p in passes)
    # P passes an endpoint only after the D round at that endpoint.
    for who_idx, (who, b, p) in enumerate(log):
        if who == "D" and b == p:
            assert ("P", b) not in [(w, x) for w, x, _ in log[:who_idx]]
    assert len(rec.samples["p_wait_permit_s"]) == 7
    assert len(rec.samples["d_boundary_wait_s"]) == len(rounds)
    names = rec.names()
    for ev in ("epoch_begin", "publish", "permit_wait", "rdv1", "rdv2", "grant", "epoch_end"):
        assert ev in names
    assert names.index("epoch_begin") < names.index("rdv1") < names.index("rdv2") < names.index("grant")
    assert all({"epoch", "boundary", "permit"} <= set(a) for n, a in rec.events
               if n in ("publish", "rdv1", "rdv2", "grant"))


async def test_an_ungated_epoch_needs_no_rendezvous():
    rec, rdv = EventRecorder(), LocalRendezvous()
    ts = Turnstile(rendezvous=rdv, span=fixed_span(2), recorder=rec)
    async with ts.epoch(0, gated=False, d_enqueued=False) as ep:
        assert not ts.gated_epoch_active
        assert await ts.before_decode() is None
        for b in range(5):
            await ep.permit(b)
            ep.publish(b + 1)
    assert rdv.arrivals == 0 and rec.counters.get("rendezvous", 0) == 0


async def test_with_no_d_rows_the_gate_opens_and_no_rendezvous_happens():
    rec, rdv = EventRecorder(), LocalRendezvous()
    ts = Turnstile(rendezvous=rdv, span=fixed_span(2), recorder=rec, timeout_s=2)
    log: list = []
    p = asyncio.create_task(fake_p(ts, 3, 6, log))
    await asyncio.sleep(0.01)
    assert ts.controller.at_endpoint() and ts.controller.reached == 0  # gated at p = 0
    ts.open_gate()
    await asyncio.wait_for(p, 2)
    assert not ts.gated_epoch_active and await ts.before_decode() is None
    assert rdv.arrivals == 0 and "open_gate" in rec.names()


async def test_open_gate_without_an_epoch_is_a_no_op():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(2))
    ts.open_gate()
    assert ts.controller.snapshot()["state"] == "idle"


async def test_cancelling_p_mid_epoch_cancels_the_epoch_and_frees_the_d_loop():
    rdv = LocalRendezvous()
    ts = Turnstile(rendezvous=rdv, span=fixed_span(2), timeout_s=5)
    log, rounds, stop, hold = [], [], asyncio.Event(), asyncio.Event()
    d = asyncio.create_task(fake_d(ts, stop, log, rounds))
    p = asyncio.create_task(fake_p(ts, 4, 6, log, hold=hold))
    # P passed boundary 0 and is stuck between 0 and 1; D waits for endpoint 2.
    while not (rounds and ts.controller.permit == 2):
        await asyncio.sleep(0.001)
    p.cancel()
    with pytest.raises(asyncio.CancelledError):
        await p
    assert ts.controller.state is TaskState.CANCELLED and ts.controller.epoch is None
    stop.set()
    await asyncio.wait_for(d, 2)
    assert [(r.boundary, r.permit, r.last, r.ended) for r in rounds] == [(0, 0, False, False), (0, 2, True, True)]
    assert not ts.gated_epoch_active


async def test_an_exception_in_p_cancels_the_epoch_and_re_raises():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(2))
    with pytest.raises(KeyError):
        async with ts.epoch(0, gated=False, d_enqueued=False):
            raise KeyError("boom")
    assert ts.controller.state is TaskState.CANCELLED


async def test_a_stale_epoch_is_rejected_and_leaves_the_turnstile_unchanged():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(2))
    async with ts.epoch(5, gated=False, d_enqueued=False):
        pass
    before = ts.snapshot()
    with pytest.raises(StaleEpochError):
        async with ts.epoch(5, gated=True, d_enqueued=True):
            pass
    assert ts.snapshot() == before


async def test_a_handle_used_after_its_epoch_is_rejected():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(2))
    async with ts.epoch(0, gated=False, d_enqueued=False) as ep:
        pass
    with pytest.raises(MissingProducerError):
        await ep.permit(3)


async def test_a_permit_wait_that_times_out_names_epoch_and_boundary_and_cancels_the_epoch():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(2), timeout_s=0.05)
    with pytest.raises(TurnstileTimeout, match=r"epoch 7 boundary 0") as info:
        async with ts.epoch(7, gated=True, d_enqueued=False) as ep:
            await ep.permit(0)  # no D loop grants it
    assert (info.value.epoch, info.value.boundary) == (7, 0)
    assert ts.controller.state is TaskState.CANCELLED


async def test_a_boundary_wait_that_times_out_names_epoch_and_boundary():
    ts = Turnstile(rendezvous=LocalRendezvous(), span=fixed_span(3), timeout_s=0.05)
    async with ts.epoch(9, gated=True, d_enqueued=True) as ep:
        ep.publish(0)  # P never reaches endpoint 3
        with pytest.raises(TurnstileTimeout, match=r"epoch 9 boundary 3 .*P reached 0") as info:
            await ts.before_decode()
    assert info.value.epoch == 9 and info.value.boundary == 3


async def test_a_rendezvous_with_a_missing_rank_times_out_naming_it():
    hub = MemoryHub(2, timeout_s=0.05)
    ts = Turnstile(rendezvous=hub.rank(0), span=fixed_span(2), timeout_s=5)
    async with ts.epoch(2, gated=True, d_enqueued=False) as ep:
        ep.publish(0)
        with pytest.raises(RendezvousTimeout, match="missing") as info:
            await ts.before_decode()
    assert info.value.missing_ranks == (1,) and info.value.epoch == 2 and info.value.boundary == 0


async def test_a_hung_rendezvous_hits_the_turnstile_deadline():
    class Hung:
        rank, world_size = 0, 2

        async def arrive(self, tag, payload, *, epoch=None, boundary=None):
            await asyncio.Event().wait()

        async def close(self):
            pass

    assert isinstance(Hung(), Rendezvous)
    ts = Turnstile(rendezvous=Hung(), span=fixed_span(2), timeout_s=0.05)
    async with ts.epoch(1, gated=True, d_enqueued=False) as ep:
        ep.publish(0)
        with pytest.raises(RendezvousTimeout, match="epoch 1 boundary 0"):
            await ts.before_decode()


async def test_ranks_that_disagree_on_the_permit_raise_a_rendezvous_mismatch():
    hub = MemoryHub(2, timeout_s=2)
    t0 = Turnstile(rendezvous=hub.rank(0), span=fixed_span(2), rank=0)
    t1 = Turnstile(rendezvous=hub.rank(1), span=fixed_span(2), rank=1)
    async with t0.epoch(1, gated=True, d_enqueued=False) as e0, \
            t1.epoch(1, gated=True, d_enqueued=True) as e1:   # rank 1 wrongly starts at p = K
        e0.publish(0)
        e1.publish(0)
        e1.publish(2)
        results = await asyncio.gather(t0.before_decode(), t1.before_decode(), return_exceptions=True)
    assert all(isinstance(r, RendezvousMismatch) for r in results)
    assert "ranks [1]" in str(results[0]) and "epoch 1" in str(results[0])


def test_assert_agree_names_the_ranks_that_differ():
    assert assert_agree([(1, 2, 2)] * 3, "rdv1", 1, 2) == (1, 2, 2)
    with pytest.raises(RendezvousMismatch, match=r"ranks \[1, 3\]") as info:
        assert_agree([(1, 2, 2), (1, 2, 4), (1, 2, 2), (1, 3, 4)], "rdv1", 1, 2)
    assert info.value.differing_ranks == (1, 3)


@pytest.mark.parametrize("seed", range(4))
async def test_skewed_ranks_run_the_same_rounds_even_when_p_leaves_at_different_times(seed):
    """Two ranks, random skew in P and D, P leaving at the permit on one rank only."""
    hub = MemoryHub(2, timeout_s=5)
    rng = random.Random(seed)
    tss = [Turnstile(rendezvous=hub.rank(r), span=fixed_span(2), rank=r, timeout_s=5) for r in range(2)]
    rounds = [[], []]
    stop = asyncio.Event()
    ds = [asyncio.create_task(fake_d(tss[r], stop, [], rounds[r], skew=random.Random(seed * 7 + r)))
          for r in range(2)]
    for epoch, n in enumerate([4, 5, 0, 6]):  # n = 4 and 6 end exactly at a permit endpoint
        await asyncio.gather(*(fake_p(tss[r], epoch, n, [], skew=rng, exit_delay=0.003 * r) for r in range(2)))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*ds), 5)
    sig = [[(x.epoch, x.boundary, x.permit, x.last) for x in rs] for rs in rounds]
    assert sig[0] == sig[1]
    assert [x[0] for x in sig[0]].count(1) == len(expected_rounds(5, 2, d_enqueued=False, final=False))


async def test_rank_zero_decides_the_span_so_permits_stay_equal():
    hub = MemoryHub(2, timeout_s=2)
    # Rank 1's load would pick a different span; rank 0's choice wins at rendezvous 2.
    loads = [SpanInputs(num_d_rows=60, max_d_rows=64, num_p_waiting_tokens=10, p_budget_tokens=2048),
             SpanInputs(num_d_rows=1, max_d_rows=64, num_p_waiting_tokens=9000, p_budget_tokens=2048)]
    recs = [EventRecorder(r) for r in range(2)]
    tss = [Turnstile(rendezvous=hub.rank(r), span=auto_span(), recorder=recs[r], rank=r,
                     load=lambda r=r: loads[r]) for r in range(2)]
    rounds, stop = [[], []], asyncio.Event()
    ds = [asyncio.create_task(fake_d(tss[r], stop, [], rounds[r])) for r in range(2)]
    await asyncio.gather(*(fake_p(tss[r], 0, 5, []) for r in range(2)))
    stop.set()
    await asyncio.wait_for(asyncio.gather(*ds), 5)
    assert [x.permit for x in rounds[0]] == [x.permit for x in rounds[1]] == [0, 1, 2, 3, 4, 5, 6]
    switches = [a for n, a in recs[1].events if n == "span_switch"]
    assert switches and switches[-1]["chosen"] == 1 and {"p_queue_tokens", "d_rows", "permit"} <= set(switches[-1])


async def test_the_span_can_change_between_rounds_and_every_switch_is_logged(caplog):
    rec = EventRecorder()
    backlog = SpanInputs(num_d_rows=2, max_d_rows=64, num_p_waiting_tokens=9000, p_budget_tokens=2048)
    ts = Turnstile(rendezvous=LocalRendezvous(), span=auto_span(), recorder=rec,
                   load=lambda: backlog if ts.rounds >= 2 else SpanInputs())  # a P backlog from round 2 on
    rounds, stop = [], asyncio.Event()
    d = asyncio.create_task(fake_d(ts, stop, [], rounds))
    with caplog.at_level("INFO", logger="ainfer_pd.turnstile.turnstile"):
        await fake_p(ts, 0, 12, [])
    stop.set()
    await d
    assert [r.permit for r in rounds] == [0, 2, 4, 8, 12, 16]
    assert [a["chosen"] for n, a in rec.events if n == "span_switch"] == [4]
    assert "span switch 2 -> 4" in caplog.text
