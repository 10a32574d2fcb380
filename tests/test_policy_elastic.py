"""Elastic jobs' policy over a real SQLite store with fake agents and a fake clock (tests/fakes.py): which size a
job starts with, how `job scale`, a fault with no spare, free nodes and a higher-priority job change it, and the
refusals. Milliseconds each; tests/test_elastic.py runs the same paths with real processes and checks the
training itself (loss, data order, parameters).
"""

from __future__ import annotations

import pytest

from fakes import FakeCluster
from test_policy import make  # noqa: F401  (fixture: fake clusters, closed after the test)
from phalanx.control.policy.admission import JobRequestError
from phalanx.control.policy.elastic import LEAVE_GRACE_S
from phalanx.control.state.jobs import JobState
from phalanx.protocol.elastic import ElasticSettings, split_batch

J = JobState


def config(**elastic) -> dict:
    return {"parallel": {"dp_shard": 1}, "training": {"global_batch_size": 12, "micro_batch_size": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 4, "stable_period_s": 0, "scale_up_delay_s": 0, **elastic}}


def submit_elastic(c: FakeCluster, priority: int = 0, **elastic):
    return c.jobs.submit(kind="train", nodes=1, config=config(**elastic), checkpoint_dir=str(c.paths.root / "ckpt"),
                         cwd=str(c.paths.root), priority=priority)


def sizes(c: FakeCluster, job: str) -> list[int]:
    return [len(g.nodes) for g in c.generations(job)]


def resize_reasons(c: FakeCluster, job: str) -> list[str]:
    return [e["reason"] for e in c.events(job=job) if e["kind"] == "resize" and e["reason"].startswith("resize")]


# ---- the arithmetic --------------------------------------------------------------------------------------------
def test_split_batch_keeps_the_global_batch_with_uneven_shares_and_refuses_sizes_that_cannot_hold_it():
    assert split_batch(12, 2, 4) == (2, [3, 3, 3, 3])
    assert split_batch(12, 2, 3) == (2, [4, 4, 4])
    assert split_batch(30, 4, 4) == (2, [8, 8, 7, 7])
    assert split_batch(5, 1, 4) is None  # a rank would run a micro-batch with no sample
    for gb in range(1, 40):
        for dp in range(1, 9):
            split = split_batch(gb, 2, dp)
            if split is not None:
                accum, shares = split
                assert sum(shares) == gb and min(shares) >= accum and -(-max(shares) // accum) <= 2
    e = ElasticSettings(min_replicas=1, max_replicas=8, replica_step=2)
    assert e.sizes() == [1, 3, 5, 7] and e.valid_sizes(6, 2, 1) == [1, 3, 5]
    assert e.valid_sizes(6, 1, 1) == [1, 3]  # 5 ranks: one would need 2 micro-batches of 1, the others have 1 sample
    with pytest.raises(ValueError, match="min_replicas=3 is more than elastic.max_replicas=2"):
        ElasticSettings(min_replicas=3, max_replicas=2)


def test_the_sampler_gives_every_sample_exactly_once_across_resizes():
    """Sample ids: steps at 4, 2, 3, 4 replicas read exactly the fixed-size run's global batches, each sample of
    a batch on exactly one rank."""
    from phalanx.data.sampler import GlobalBatchSampler

    def step_ids(dp: int, consumed: int) -> list[int]:
        accum, _ = split_batch(12, 2, dp)
        ids = []
        for rank in range(dp):
            s = GlobalBatchSampler(50, 12, seed=3, dp_rank=rank, dp_size=dp, uneven=True)
            ids += [int(i) for mb in s.local_micro_batches(consumed, 2, accum) for i in mb]
        return ids

    fixed = GlobalBatchSampler(50, 12, seed=3)
    consumed = 0
    for dp in [4] * 3 + [2] * 2 + [3] * 4 + [4] * 3:  # crosses an epoch (50 samples) on the way
        assert step_ids(dp, consumed) == list(fixed.global_batch(consumed))
        consumed += 12


# ---- refusals --------------------------------------------------------------------------------------------------
def test_bad_elastic_requests_are_refused_with_the_field_and_the_job_untouched(make):
    c = make(count=2, spares=0).create()
    with pytest.raises(JobRequestError, match="min_replicas=3 is more than elastic.max_replicas=2"):
        submit_elastic(c, min_replicas=3, max_replicas=2)
    with pytest.raises(JobRequestError, match=r"elastic.min_replicas=3 needs 3 nodes .* group has 2 worker nodes"):
        submit_elastic(c, min_replicas=3, max_replicas=4)
    bad = config()
    bad["training"]["global_batch_size"] = 2
    with pytest.raises(JobRequestError, match=r"\[3, 4\] replica\(s\) cannot hold training.global_batch_size=2 .* "
                                              r"sizes that can: \[1, 2\]"):
        c.jobs.submit(kind="train", nodes=1, config=bad, checkpoint_dir="x", cwd=str(c.paths.root))
    assert c.jobs.records.jobs() == []
    fixed = c.submit(nodes=1)
    with pytest.raises(JobRequestError, match=f"job {fixed.id} is not elastic"):
        c.jobs.scale(fixed.id, 2)
    job = submit_elastic(c, min_replicas=2, max_replicas=4, replica_step=2)
    for replicas, why in ((1, r"--replicas 1 \(below min_replicas\) is not a size .* valid: \[2, 4\]"),
                          (3, r"--replicas 3 is not a size .* valid: \[2, 4\]")):
        with pytest.raises(JobRequestError, match=why):
            c.jobs.scale(job.id, replicas)
    assert c.job(job.id).elastic["target"] is None


# ---- sizes -----------------------------------------------------------------------------------------------------
def test_job_scale_resizes_in_place_survivors_carried_leavers_held_then_released(make):
    c = make(count=4, spares=0).create()
    job = submit_elastic(c)
    c.run_until(lambda: len(c.workers(job.id, 1)) == 4, "4 replicas running")
    assert c.job(job.id).replicas == 4 and c.job(job.id).world_size == 4
    before = {rank: w for rank, (_, w) in c.workers(job.id, 1).items()}
    c.jobs.scale(job.id, 2)
    c.step()
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "resized" and g1.ended_at == g1.stop_at and g2.nodes == g1.nodes[:2]
    assert c.job(job.id).world_size == 2 and c.job(job.id).state == J.RUNNING
    assert resize_reasons(c, job.id) == ["resize 4 → 2 replicas (job scale request (2 replicas)); global batch 12 "
                                         "kept: micro-batches per rank 2 → 3, learning rate unchanged"]
    c.steps(2)
    after = {rank: w for rank, (_, w) in c.workers(job.id, 2).items()}
    assert after[0] is before[0] and after[1] is before[1], "survivors serve the new generation in their processes"
    leavers = [before[2], before[3]]
    assert all(w.state == "running" and not w.stopped for w in leavers), "leaving replicas finish their step"
    for w in leavers:  # they see they have no place in generation 2 and exit 0 by themselves
        c.agents[g1.nodes[w.rank]].exit_worker(w, 0)
    c.steps(2)
    assert not [n for n in g1.nodes[2:] if c.node(n).job], "the leaving nodes are free again"
    # a leaver that never exits is stopped once LEAVE_GRACE_S has passed
    c.jobs.scale(job.id, 4)
    c.step()
    assert sizes(c, job.id) == [4, 2, 4]
    c.jobs.scale(job.id, 3)
    c.step()
    stuck = next(w for rank, (_, w) in c.workers(job.id, 3).items() if rank == 3)
    c.steps(int(LEAVE_GRACE_S / c.interval) - 2)
    assert stuck.state == "running"
    c.steps(4)
    assert stuck.stopped, "held no longer than LEAVE_GRACE_S"


def test_free_nodes_are_grown_onto_only_after_the_delay_and_the_stable_period(make):
    c = make(count=4, spares=0).create()
    other = c.submit(nodes=2)
    c.run_until(lambda: len(c.workers(other.id)) == 2, "the fixed job running")
    job = submit_elastic(c, scale_up_delay_s=10, stable_period_s=30)
    c.run_until(lambda: c.job(job.id).state == J.RUNNING, "the elastic job running")
    assert c.job(job.id).replicas == 2, "starts with what is free"
    started = c.generations(job.id)[0].started_at
    for _, w in c.workers(other.id).values():
        c.agents[w_node(c, other.id, w.rank)].exit_worker(w, 0)
    c.run_until(lambda: c.job(other.id).state == J.SUCCEEDED, "the fixed job done")
    freed = c.clock()
    c.run_until(lambda: len(c.generations(job.id)) == 2, "the elastic job to grow", max_steps=100)
    grew = c.generations(job.id)[1].started_at
    assert grew - freed >= 10 and grew - started >= 30, (grew - freed, grew - started)
    assert sizes(c, job.id) == [2, 4]
    assert "2 idle healthy node(s) free for" in resize_reasons(c, job.id)[0]


def w_node(c: FakeCluster, job: str, rank: int) -> str:
    return c.job(job).nodes[rank]


def test_a_fault_with_no_spare_shrinks_in_place_and_the_job_grows_back_onto_the_replacement(make):
    c = make(count=3, spares=0).create()
    job = submit_elastic(c)
    c.run_until(lambda: len(c.workers(job.id, 1)) == 3, "3 replicas running")
    victim = c.job(job.id).nodes[1]
    c.inject_fault(victim, "kill-node")
    c.run_until(lambda: len(c.generations(job.id)) >= 2, "a new generation")
    g1, g2 = c.generations(job.id)[:2]
    assert g1.outcome == "node-fault" and len(g2.nodes) == 2 and victim not in g2.nodes, "no waiting for a node"
    c.run_until(lambda: c.job(job.id).replicas == 3, "grown back onto the fresh node")
    assert c.generations(job.id)[-2].outcome == "resized" and victim not in c.job(job.id).nodes


def test_a_higher_priority_job_takes_nodes_from_an_elastic_job_above_its_min_and_gives_them_back(make):
    c = make(count=4, spares=0).create()
    job = submit_elastic(c, min_replicas=1)
    c.run_until(lambda: len(c.workers(job.id, 1)) == 4, "4 replicas running")
    low = c.submit(nodes=3, priority=-1)  # lower priority than the elastic job: waits, takes nothing
    c.steps(2)
    assert c.job(low.id).state == J.PENDING and c.job(job.id).replicas == 4
    c.jobs.cancel(low.id)
    urgent = c.submit(nodes=4, priority=5)  # 4 nodes: only 3 above min_replicas=1, so nothing is taken
    c.steps(2)
    assert c.job(job.id).replicas == 4 and c.job(urgent.id).state == J.PENDING
    c.jobs.cancel(urgent.id)
    urgent = c.submit(nodes=1, priority=5)
    c.steps(3)  # (while the leaver finishes its step, nothing more is taken)
    assert c.job(job.id).replicas == 3 and sizes(c, job.id) == [4, 3]
    assert "preempted by job" in resize_reasons(c, job.id)[0]
    for agent, w in c.workers(job.id, 1).values():  # the leaver finishes its step and exits
        agent.exit_worker(w, 0)
    c.run_until(lambda: c.job(urgent.id).state == J.RUNNING, "the urgent job running")
    c.steps(3)
    assert c.job(job.id).replicas == 3, "no growing onto nodes a waiting job needs"
    for _, w in c.workers(urgent.id).values():
        c.agents[w_node(c, urgent.id, w.rank)].exit_worker(w, 0)
    c.run_until(lambda: c.job(job.id).replicas == 4, "grown back once the urgent job ended")


def test_growth_waits_for_the_joining_nodes_warm_standbys(make):
    from phalanx import protocol
    from phalanx.control.policy.elastic import STANDBY_WAIT_S

    c = make(count=3, spares=0, warm_standby=True).create()
    other = c.submit(nodes=1)
    c.run_until(lambda: len(c.workers(other.id)) == 1, "the fixed job running")
    job = submit_elastic(c)
    c.run_until(lambda: c.job(job.id).state == J.RUNNING and c.job(job.id).replicas == 2, "2 replicas")
    (agent, w), = c.workers(other.id).values()
    agent.exit_worker(w, 0)
    c.run_until(lambda: c.job(other.id).state == J.SUCCEEDED, "the fixed job done")
    c.steps(5)
    assert c.job(job.id).replicas == 2, "the freed node's standby is not warm yet"
    for sid in agent.standbys.values():  # the standby says it is warm and waiting
        c.rendezvous.set(protocol.standby_warm_key(sid), "1")
    c.run_until(lambda: c.job(job.id).replicas == 3, "grown once the standby is warm", max_steps=5)
    assert c.generations(job.id)[-1].standbys, "the warm standby takes the joining rank"
    # without the warm word, growth still happens after STANDBY_WAIT_S
    c.jobs.scale(job.id, 2)
    c.step()
    for agent_, w_ in c.workers(job.id, 2).values():
        if agent_.name not in c.job(job.id).nodes:
            agent_.exit_worker(w_, 0)
    c.jobs.records.update_job(job.id, elastic={**c.job(job.id).elastic, "target": None})
    c.steps(10)
    assert c.job(job.id).replicas == 2
    c.run_until(lambda: c.job(job.id).replicas == 3, "grown after the wait",
                max_steps=int(STANDBY_WAIT_S / c.interval) + 10)


def test_scale_batch_lets_the_batch_and_the_learning_rate_follow_the_replica_count(tmp_path):
    from phalanx.train.config import ConfigError, config_from_dict

    e = ElasticSettings(min_replicas=1, max_replicas=4, scale_batch=True)
    assert [e.batch_at(16, r) for r in (1, 2, 4)] == [4, 8, 16] and [e.lr_factor(r) for r in (1, 2, 4)] == [0.25, 0.5, 1]
    assert ElasticSettings(max_replicas=4, scale_batch=True, lr_scaling="sqrt").lr_factor(1) == 0.5
    assert ElasticSettings(max_replicas=4).batch_at(16, 1) == 16 and ElasticSettings(max_replicas=4).lr_factor(1) == 1
    with pytest.raises(ValueError, match="lr_scaling applies only with elastic.scale_batch"):
        ElasticSettings(max_replicas=4, lr_scaling="sqrt")
    tree = {"parallel": {"dp_shard": 1}, "optimizer": {"lr": 1e-3},
            "training": {"global_batch_size": 16, "micro_batch_size": 2},
            "elastic": {"min_replicas": 1, "max_replicas": 4, "scale_batch": True}}
    config = config_from_dict(tree)
    at2 = config.for_world(2)
    assert at2.parallel.dp_replicate == 2 and at2.training.global_batch_size == 8 and at2.optimizer.lr == 5e-4
    assert config.for_world(4).training.global_batch_size == 16 and config.for_world(4).optimizer.lr == 1e-3
    kept = config_from_dict({**tree, "elastic": {"min_replicas": 1, "max_replicas": 4}})
    assert kept.for_world(2).training.global_batch_size == 16 and kept.for_world(2).optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="global_batch_size=18 is the batch at max_replicas=4; make it a multiple"):
        config_from_dict({**tree, "training": {"global_batch_size": 18, "micro_batch_size": 2}})


def test_a_scale_batch_resize_says_how_the_batch_and_the_learning_rate_change(make):
    c = make(count=4, spares=0).create()
    cfg = config(scale_batch=True, lr_scaling="sqrt")
    job = c.jobs.submit(kind="train", nodes=1, config=cfg, checkpoint_dir="x", cwd=str(c.paths.root))
    c.run_until(lambda: len(c.workers(job.id, 1)) == 4, "4 replicas running")
    c.jobs.scale(job.id, 1)
    c.step()
    assert resize_reasons(c, job.id) == ["resize 4 → 1 replicas (job scale request (1 replicas)); global batch 12 → 3 "
                                         "(scale_batch), micro-batches per rank 2 → 2, peak learning rate × 0.5 "
                                         "(sqrt)"]
