"""Issue 34, item 16: a weight sync of a multi-rank worker is one collective act. Every rank takes
part and checks the same manifest (names, shapes, dtypes, partial; a digest), or the sync fails,
typed, on every rank, nothing written anywhere; a rank that never joins is named by the timeout.
Real rank processes over gloo (the tiny model, ADP2 / EP2)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import torch

from ainfer_pd import RolloutWorker, SamplingParams
from ainfer_pd.engine.model.model import build_model
from ainfer_pd.errors import (WeightSyncError, WeightSyncMismatchError, WeightSyncTimeout, WeightUpdateError,
                              WorkerAsleepError)
from tests._dist_util import run_ranks
from tests.conftest import rand_ids, tiny_cfg

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _cfg(world_size: int):
    return tiny_cfg(**{"parallel.world_size": world_size, "parallel.attn_dp": world_size,
                       "parallel.expert_parallel": world_size, "parallel.expert_backend": "torch",
                       "parallel.rendezvous_timeout_s": 60.0, "scheduler.policy": "fine-grained"})


async def _cut(name: str, world_size: int) -> None:
    """Every rank reaches this point before any goes on (over the store, off the engine's groups)."""
    from ainfer_pd.launch import get_store
    store = get_store()
    await asyncio.to_thread(store.add, f"test/{name}", 1)
    async with asyncio.timeout(60):
        while int(await asyncio.to_thread(store.add, f"test/{name}", 0)) < world_size:
            await asyncio.sleep(0.01)


def _mine(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """This rank's part of a whole model of ``seed`` in the engine's names (its expert shard)."""
    lo, hi = model.expert_range
    full = dict(build_model(dataclasses.replace(model.cfg, seed=seed)).named_parameters())
    out = []
    for n, p in model.named_parameters():
        t = full[n].detach().clone()
        if n.rsplit(".", 1)[-1] in ("w13", "w2") and t.dim() == 3:
            t = t[lo:hi].clone()
        out.append((n, t))
    return out


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _equal(model, snap) -> bool:
    return all(torch.equal(p, snap[n]) for n, p in model.named_parameters())


async def _outcome(aw) -> tuple[str, float, object]:
    t0 = time.monotonic()
    try:
        res = await aw
        return "ok", time.monotonic() - t0, res
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - judged by the parent
        return type(exc).__name__, time.monotonic() - t0, exc


async def _rank_main(rank: int, world_size: int, prompt: list[int]):
    w_cfg = _cfg(world_size)
    log: dict = {}
    async with RolloutWorker(w_cfg) as w:
        new1, new2 = _mine(w.model, 101), _mine(w.model, 102)
        start = _snapshot(w.model)
        # A: only rank 0 syncs: it times out naming rank 1; nothing written anywhere
        if rank == 0:
            log["alone"] = await _outcome(w.update_weights(new1, timeout_s=3.0))
        await _cut("a", world_size)
        log["alone_unchanged"] = _equal(w.model, start)
        # A': rank 1 calls late: it joins the failed sync (and raises it), then both are aligned again
        if rank == 1:
            log["late"] = await _outcome(w.update_weights(new1, timeout_s=3.0))
        await _cut("a2", world_size)
        log["late_unchanged"] = _equal(w.model, start)
        # B: both sync the same weights: it succeeds on both
        log["both"] = await _outcome(w.update_weights(new1))
        log["both_written"] = all(torch.equal(dict(w.model.named_parameters())[n], t) for n, t in new1)
        await _cut("b", world_size)
        after_b = _snapshot(w.model)
        # C: the manifests differ (rank 1 sends one tensor in float64): mismatch on both ranks
        bad = list(new2)
        if rank == 1:
            bad[0] = (bad[0][0], bad[0][1].double())
        log["mismatch"] = await _outcome(w.update_weights(bad))
        log["mismatch_unchanged"] = _equal(w.model, after_b)
        await _cut("c", world_size)
        # D: rank 1's own part is malformed: it raises its own error, rank 0 a WeightSyncError at
        # once (not after the timeout), naming rank 1
        part = list(new2)
        if rank == 1:
            part[1] = (part[1][0], part[1][1].flatten()[:-1])
        log["peer_failed"] = await _outcome(w.update_weights(part, timeout_s=30.0))
        log["peer_failed_unchanged"] = _equal(w.model, after_b)
        await _cut("d", world_size)
        log["final"] = await _outcome(w.update_weights(new2))
        await _cut("f", world_size)
        out = await w.generate(prompt[rank::world_size] + prompt, SamplingParams(max_new_tokens=6, **GREEDY))
        await w.release(out.trajectory_id)
        log["tokens"] = out.token_ids
        await _cut("g", world_size)
        # E: rank 1 is asleep (sleep 2): the sync fails typed on both, then succeeds after wake_up
        if rank == 1:
            await w.sleep(2)
        await _cut("e0", world_size)
        log["asleep"] = await _outcome(w.update_weights(new1, timeout_s=30.0))
        await _cut("e1", world_size)
        if rank == 1:
            await w.wake_up()
        await _cut("e2", world_size)
        log["woken"] = await _outcome(w.update_weights(new1))
        await _cut("h0", world_size)
        # H: rank 0's call is cancelled while it waits for rank 1: the sync fails for rank 1 too
        # (when it joins), nothing written; the next sync of both succeeds
        snap = _snapshot(w.model)
        if rank == 0:
            task = asyncio.ensure_future(w.update_weights(new2, timeout_s=30.0))
            await asyncio.sleep(0.5)
            task.cancel()
            log["cancelled"] = await _outcome(task)
        await _cut("h1", world_size)
        if rank == 1:
            log["after_cancel"] = await _outcome(w.update_weights(new2, timeout_s=30.0))
        log["cancel_unchanged"] = _equal(w.model, snap)
        await _cut("h2", world_size)
        log["after_cancel_both"] = await _outcome(w.update_weights(new2))
    return {k: ((v[0], v[1], repr(v[2]), getattr(v[2], "ranks", None)) if isinstance(v, tuple) else v)
            for k, v in log.items()}


def test_item16_a_sync_is_one_collective_act_over_every_rank():
    from tests.test_engine_core import recompute_greedy
    prompt = rand_ids(random.Random(16), 24)
    res = run_ranks(_rank_main, 2, prompt, timeout_s=240)
    r0, r1 = res
    # A: alone -> timeout naming rank 1, within its bound; nothing written
    kind, took, msg, ranks = r0["alone"]
    assert kind == WeightSyncTimeout.__name__ and ranks == (1,), r0["alone"]
    assert 2.5 < took < 15, took
    assert r0["alone_unchanged"] and r1["alone_unchanged"]
    # A': the late rank raises the failed sync at once
    kind, took, msg, _ = r1["late"]
    assert kind == WeightSyncTimeout.__name__ and took < 5, r1["late"]
    assert r0["late_unchanged"] and r1["late_unchanged"]
    # B: together it succeeds
    assert r0["both"][0] == r1["both"][0] == "ok" and r0["both_written"] and r1["both_written"], (r0["both"], r1["both"])
    # C: mismatch on both, named, nothing written
    for r in (r0, r1):
        assert r["mismatch"][0] == WeightSyncMismatchError.__name__, r["mismatch"]
        assert "float64" in r["mismatch"][2] and r["mismatch_unchanged"]
    # D: the peer's failure reaches rank 0 at once, naming it; rank 1 raises its own error
    assert r0["peer_failed"][0] == WeightSyncError.__name__ and r0["peer_failed"][3] == (1,), r0["peer_failed"]
    assert r0["peer_failed"][1] < 20
    assert r1["peer_failed"][0] == WeightUpdateError.__name__, r1["peer_failed"]
    assert r0["peer_failed_unchanged"] and r1["peer_failed_unchanged"]
    # E: a sleeping rank fails the sync on both; after wake_up it succeeds
    assert r1["asleep"][0] == WorkerAsleepError.__name__, r1["asleep"]
    assert r0["asleep"][0] == WeightSyncError.__name__ and r0["asleep"][3] == (1,), r0["asleep"]
    assert r0["final"][0] == r1["final"][0] == "ok", (r0["final"], r1["final"])
    assert r0["woken"][0] == r1["woken"][0] == "ok", (r0["woken"], r1["woken"])
    # H: a cancelled call fails the sync for its peer, typed, naming it
    assert r0["cancelled"][0] == "CancelledError", r0["cancelled"]
    assert r1["after_cancel"][0] == WeightSyncError.__name__ and r1["after_cancel"][3] == (0,), r1["after_cancel"]
    assert r1["after_cancel"][1] < 5 and r0["cancel_unchanged"] and r1["cancel_unchanged"]
    assert r0["after_cancel_both"][0] == r1["after_cancel_both"][0] == "ok"
    # the ranks serve the synced weights: greedy tokens equal one rank holding them
    cfg = tiny_cfg()
    new = build_model(dataclasses.replace(cfg.model, seed=102))
    for rank, r in enumerate(res):
        assert r["tokens"] == recompute_greedy(new, cfg, prompt[rank::2] + prompt, 6)[0], rank
