"""The recovery plan (pure logic): which step a regrouped job continues from, and who sends what."""

from phalanx.resilience.restore import Copy, Holding, Transfer, choose_plan

SIG4 = (("dp_shard", 4),)
SIG2 = (("dp_shard", 2),)


def shard(i, n=4):
    return (("dp_shard", i),)


def live(i, step, sig=SIG4):
    return Copy("live", shard(i), sig, step)


def test_first_start_has_nothing_in_memory_so_it_loads_from_disk():
    plan = choose_plan([Holding(r, shard(r), SIG4) for r in range(4)])
    assert plan.kind == "disk" and plan.step is None and "first start" in plan.reason


def test_hsdp_replacement_takes_the_shard_from_the_other_replica():
    # HSDP 2 x 2: ranks 0,1 = replica 0 (shards 0,1); ranks 2,3 = replica 1. Rank 1 was replaced.
    holdings = [Holding(0, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(1, shard(1), SIG2),
                Holding(2, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(3, shard(1), SIG2, (live(1, 7, SIG2),))]
    plan = choose_plan(holdings)
    assert plan.kind == "memory" and plan.step == 7
    assert plan.transfers == [Transfer(3, 1, "live", shard(1))]
    assert plan.local == {0: "live", 2: "live", 3: "live"} and not plan.from_snapshot


def test_an_update_every_shard_holds_is_kept_and_taken_by_the_ranks_that_missed_it():
    # The fault hit inside step 8's last reduction: ranks 0 and 3 applied it, rank 2 did not.
    holdings = [Holding(0, shard(0), SIG2, (live(0, 8, SIG2),)), Holding(1, shard(1), SIG2),
                Holding(2, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(3, shard(1), SIG2, (live(1, 8, SIG2),))]
    plan = choose_plan(holdings)
    assert plan.step == 8
    assert sorted((t.src, t.dst) for t in plan.transfers) == [(0, 2), (3, 1)]


def test_a_half_applied_update_is_rolled_back_when_a_shard_lacks_it():
    # Shard 1's only survivor (rank 3) missed step 8, so the job continues from 7, where all shards are held.
    holdings = [Holding(0, shard(0), SIG2, (live(0, 8, SIG2),)), Holding(1, shard(1), SIG2),
                Holding(2, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(3, shard(1), SIG2, (live(1, 7, SIG2),))]
    plan = choose_plan(holdings)
    assert plan.step == 7 and [(t.src, t.dst) for t in plan.transfers] == [(2, 0), (3, 1)]


def test_fsdp_rolls_back_to_the_newest_snapshot_every_shard_has():
    # FSDP 4, buddies on the next node: rank r's snapshot copy lives on rank r+1. Rank 2 died at step 9.
    # Snapshots: own copies at 6 and 8; rank 3 holds rank 2's copy only up to 6 (8 was still in flight).
    def snaps(r, own_steps, peer_of, peer_steps):
        return tuple([live(r, 9)] + [Copy(f"own@{s}", shard(r), SIG4, s) for s in own_steps]
                     + [Copy(f"peer@{s}", shard(peer_of), SIG4, s) for s in peer_steps])

    holdings = [Holding(0, shard(0), SIG4, snaps(0, (6, 8), 3, (6, 8))),
                Holding(1, shard(1), SIG4, snaps(1, (6, 8), 0, (6, 8))),
                Holding(2, shard(2), SIG4),  # the replacement
                Holding(3, shard(3), SIG4, snaps(3, (6, 8), 2, (6,)))]
    plan = choose_plan(holdings)
    assert plan.kind == "memory" and plan.step == 6 and plan.from_snapshot
    assert plan.transfers == [Transfer(3, 2, "peer@6", shard(2))]
    assert plan.local == {0: "own@6", 1: "own@6", 3: "own@6"}


def test_both_holders_gone_falls_back_to_disk_and_says_which_shard():
    holdings = [Holding(0, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(1, shard(1), SIG2),
                Holding(2, shard(0), SIG2, (live(0, 7, SIG2),)), Holding(3, shard(1), SIG2)]
    plan = choose_plan(holdings)
    assert plan.kind == "disk" and "(('dp_shard', 1),)" in plan.reason and "checkpoint" in plan.reason


def test_a_state_of_another_layout_is_never_used():
    # A survivor's state from a 4-way sharding cannot serve a 2-way one.
    holdings = [Holding(0, shard(0), SIG2, (live(0, 7, SIG4),)), Holding(1, shard(1), SIG2, (live(1, 7, SIG4),))]
    assert choose_plan(holdings).kind == "disk"


def test_more_replicas_than_before_are_served_from_the_existing_ones_with_the_load_spread():
    # Elastic growth: 1 replica of 2 shards (ranks 0, 1) → 3 replicas; 4 new ranks need shards 0 and 1.
    holdings = [Holding(0, shard(0), SIG2, (live(0, 5, SIG2),)), Holding(1, shard(1), SIG2, (live(1, 5, SIG2),))]
    holdings += [Holding(r, shard(r % 2), SIG2) for r in range(2, 6)]
    plan = choose_plan(holdings)
    assert plan.step == 5
    assert sorted((t.src, t.dst) for t in plan.transfers) == [(0, 2), (0, 4), (1, 3), (1, 5)]
