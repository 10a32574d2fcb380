"""A rank's state moved through memory, with real processes (gloo on CPU): captured on one rank, sent with
its checksums, applied on a freshly built rank of the same shard — training continues bit for bit."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from distributed import run_distributed


def _train_and_swap(run_dir, data, steps_before, steps_after, swap):
    import torch.distributed as dist

    from phalanx.resilience.restore import IntegrityError, ShardState, exchange
    from phalanx.train.trainer import Trainer

    config = tiny_config(run_dir, data, parallel={"dp_replicate": 2, "dp_shard": 2},
                         checkpoint={"interval": 0, "resume": False})
    trainer = Trainer(config, torch.device("cpu"))
    losses = [trainer.train_step()["loss"] for _ in range(steps_before)]
    rank = dist.get_rank()
    out = {"losses": losses}
    if swap:
        # Replica 1 (ranks 2, 3) "loses" its state: a fresh trainer with uninitialised shards receives the
        # state of the matching rank of replica 0 (rank 0 → 2, rank 1 → 3); replica 0 re-applies its own.
        mine = ShardState.capture(trainer)
        out["nbytes"] = mine.nbytes
        del trainer
        fresh = Trainer(config, torch.device("cpu"), init_weights=False)
        sends = [(rank + 2, mine)] if rank < 2 else []
        got = exchange(sends, [rank - 2] if rank >= 2 else [])
        (got[rank - 2] if rank >= 2 else mine).apply(fresh)
        trainer = fresh
        # A corrupted copy is refused before use.
        bad = ShardState.capture(trainer).seal()
        bad.data[len(bad.data) // 2] ^= 0xFF
        try:
            bad.verify()
            out["corruption_caught"] = False
        except IntegrityError as err:
            out["corruption_caught"] = "checksum" in str(err)
        # A copy received without verification (a buddy snapshot) is checked when applied, before any write.
        bad.verified = False
        before = [p.detach().clone() for p in trainer.model.parameters()]
        try:
            bad.apply(trainer)
            out["unverified_refused"] = False
        except IntegrityError:
            out["unverified_refused"] = all(torch.equal(a, p.detach()) for a, p in zip(before, trainer.model.parameters()))
    out["losses"] += [trainer.train_step()["loss"] for _ in range(steps_after)]
    out["step"] = trainer.progress.step
    return out


@pytest.mark.slow
def test_state_from_a_peer_replica_continues_training_bit_exactly(tmp_path, demo_data):
    ref = run_distributed(_train_and_swap, 4, tmp_path / "a", tmp_path / "run-a", demo_data, 3, 3, False)
    got = run_distributed(_train_and_swap, 4, tmp_path / "b", tmp_path / "run-b", demo_data, 3, 3, True)
    assert all(r["losses"] == ref[0]["losses"] for r in ref + got)  # identical floats, every rank, every step
    assert all(r["step"] == 6 for r in got)
    assert all(r["corruption_caught"] for r in got)
    assert all(r["unverified_refused"] for r in got)
    assert got[0]["nbytes"] > 0


def _snapshots_reuse(run_dir, data, steps, frame_head=None):
    import torch.distributed as dist

    from phalanx.resilience import snapshots as snapshots_module
    from phalanx.resilience.restore import ShardState
    from phalanx.resilience.snapshots import BuddySnapshots, SnapshotShelf
    from phalanx.train.trainer import Trainer

    if frame_head is not None:  # a header that outgrows its frame's room: every snapshot goes in full
        snapshots_module.FRAME_HEAD = frame_head

    config = tiny_config(run_dir, data, parallel={"dp_replicate": 1, "dp_shard": 4},
                         checkpoint={"interval": 0, "resume": False})
    trainer = Trainer(config, torch.device("cpu"))
    shelf = SnapshotShelf()
    snapshots = BuddySnapshots(trainer, shelf, interval=1, workers_per_node=1)
    out = {"own_matches": [], "peer_checks": [], "buffers": set(), "plans": 0}
    # as a generation starts (run.py): before the first step the optimizer has no state yet, so the layout the
    # buddy learns in this first, full exchange changes at the next snapshot, which must go in full again
    snapshots.after_step(force=True)
    snapshots.wait()
    plan = snapshots._plan
    for step in range(steps):
        if step == steps // 2:
            # a restore writes the state back: the optimizer's tensors are new objects, so the plan must follow
            snapshots.wait()
            ShardState.capture(trainer).apply(trainer)
        trainer.train_step()
        snapshots.after_step()
        snapshots.wait()
        own, fresh = shelf.own[trainer.progress.step], ShardState.capture(trainer)
        out["own_matches"].append(own.entries == fresh.entries and all(
            torch.equal(own.data[e.offset:e.offset + e.nbytes], fresh.data[e.offset:e.offset + e.nbytes])
            for e in own.entries))
        peer = shelf.peer[trainer.progress.step]
        peer.verify()  # the ward's copy, through a reused buffer, matches the checksum taken where it was captured
        out["peer_checks"].append(peer.verified and (peer.step, peer.samples_consumed, peer.extra["scheduler"])
                                  == (own.step, own.samples_consumed, own.extra["scheduler"]))
        out["buffers"].add(own.data.data_ptr())
        out["plans"] += snapshots._plan is not plan
        plan = snapshots._plan
    out["buffers"] = len(out["buffers"])
    out["full_exchanges"] = snapshots.full_exchanges
    out["rank"] = dist.get_rank()
    snapshots.release()
    return out


@pytest.mark.slow
def test_buddy_snapshots_reuse_buffers_and_their_plan_without_going_stale(tmp_path, demo_data):
    got = run_distributed(_snapshots_reuse, 4, tmp_path / "a", tmp_path / "run", demo_data, 8)
    for r in got:
        assert all(r["own_matches"]), r  # every kept copy equals a fresh capture of the live state, bit for bit
        assert all(r["peer_checks"]), r
        assert r["buffers"] <= 4, r  # the copies cycle through the buffers of dropped ones, not a new one each step
        # worked out again after the first step (the optimizer's state appeared) and after the restore
        assert r["plans"] == 2, r
        # in full: the first exchange and the one after the layout changed; every other snapshot in one frame (a
        # restore gives new tensors in the same places)
        assert r["full_exchanges"] == 2, r


@pytest.mark.slow
def test_buddy_snapshots_whose_header_outgrows_the_frame_go_in_full(tmp_path, demo_data):
    got = run_distributed(_snapshots_reuse, 4, tmp_path / "a", tmp_path / "run", demo_data, 4, 4096)
    for r in got:
        assert all(r["own_matches"]) and all(r["peer_checks"]), r
        assert r["full_exchanges"] == 5, r  # the forced first one and each of the 4 steps
