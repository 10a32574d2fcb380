"""The protocol between control plane and workers: one rank formula, typed messages that refuse what they do
not know, and a version that each side checks (an agent, controller or worker of another version gets a
clear error, not a confusing failure later)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from phalanx import protocol
from phalanx.protocol.messages import Heartbeat, HeartbeatReply, RecoverySummary


def test_rank_of_is_node_order_times_slots_plus_local_rank():
    nodes = ["a", "b", "c"]
    assert [protocol.rank_of(nodes, n, i, 2) for n in nodes for i in range(2)] == list(range(6))
    with pytest.raises(ValueError):
        protocol.rank_of(nodes, "z", 0, 2)
    index = {n: i for i, n in enumerate(nodes)}  # the controller's lookup (Job/Generation.node_index): same ranks
    assert [protocol.rank_of(index, n, i, 2) for n in nodes for i in range(2)] == list(range(6))
    with pytest.raises(KeyError):
        protocol.rank_of(index, "z", 0, 2)


@pytest.mark.parametrize("theirs, words", [
    (None, "sent no protocol version"),
    ("x", "not an integer"),
    (protocol.PROTOCOL_VERSION + 1, "upgrade this side"),
    (protocol.PROTOCOL_VERSION - 1, "upgrade the agent"),
])
def test_another_protocol_version_is_refused_with_what_to_upgrade(theirs, words):
    with pytest.raises(protocol.ProtocolMismatch, match=words):
        protocol.check_version(theirs, "agent of node n1")


def test_an_older_agent_is_told_what_to_upgrade_in_the_words_the_controller_uses():
    with pytest.raises(protocol.ProtocolMismatch) as err:
        protocol.check_version(protocol.PROTOCOL_VERSION - 1, "the agent of node n1")  # as api.py words it
    assert "upgrade the agent (" in str(err.value) and "the the" not in str(err.value)


def test_the_same_version_passes():
    protocol.check_version(protocol.PROTOCOL_VERSION, "agent")
    protocol.check_version(str(protocol.PROTOCOL_VERSION), "worker")  # (env variables are strings)


def test_a_heartbeat_with_an_unknown_field_is_refused_naming_it():
    body = {"protocol": protocol.PROTOCOL_VERSION, "handle": "1", "phase": "ready", "sent_at": 0.0, "wrokers": []}
    with pytest.raises(ValidationError, match="wrokers"):
        Heartbeat.model_validate(body)


def test_a_reply_carries_typed_assignments_and_refuses_a_malformed_one():
    reply = {"sent_at": 1.0, "controller": 2.0, "action": "run", "standby": 1,
             "workers": [{"job": "7", "generation": 2, "world_size": 2, "local_world_size": 1,
                          "ranks": [{"rank": 1, "local_rank": 0, "carry": True}]},
                         {"job": "8", "generation": 3, "hold": True}]}
    parsed = HeartbeatReply.model_validate(reply)
    assert parsed.protocol == protocol.PROTOCOL_VERSION
    assert parsed.workers[0].ranks[0].carry
    assert parsed.workers[1].hold and parsed.workers[1].ranks == []
    bad = {**reply, "workers": [{"job": "7", "generation": "two"}]}
    with pytest.raises(ValidationError, match="generation"):
        HeartbeatReply.model_validate(bad)
    with pytest.raises(ValidationError, match="action"):
        HeartbeatReply.model_validate({**reply, "action": "dance"})
    relayed = {**reply, "workers": [{**reply["workers"][0], "progress": {"1": {"step": 5, "beat": 9}}}]}
    with pytest.raises(ValidationError, match="progress"):  # (protocol 5 relayed it; 6 reads it on the node)
        HeartbeatReply.model_validate(relayed)


def test_a_worker_started_by_an_agent_of_another_version_refuses_to_report():
    env = {protocol.STORE_ADDR: "127.0.0.1:1", protocol.JOB_ID: "7", protocol.GENERATION: "1", protocol.RANK: "0",
           protocol.PROTOCOL_ENV: str(protocol.PROTOCOL_VERSION + 1)}
    with pytest.raises(protocol.ProtocolMismatch, match="PHALANX_PROTOCOL"):
        protocol.progress_reporter(env)
    placement = protocol.WorkerPlacement(job_id="7", generation=1, rank=0, world_size=1, local_rank=0,
                                         local_world_size=1, master_addr="127.0.0.1", master_port=1,
                                         store_addr="127.0.0.1:1", checkpoint_dir="c", cluster_token="t")
    assert protocol.worker_env(placement, base={})[protocol.PROTOCOL_ENV] == str(protocol.PROTOCOL_VERSION)


def test_a_recovery_summary_keeps_its_events_and_refuses_a_negative_time():
    s = RecoverySummary.model_validate_json('{"source": "peer", "step": 7, "bytes": 10, "seconds": 0.5, '
                                            '"events": [{"event": "resumed", "step": 7}], "plan": "memory"}')
    dumped = s.model_dump(exclude_none=True)
    assert dumped["events"][0]["event"] == "resumed" and dumped["plan"] == "memory" and "reason" not in dumped
    with pytest.raises(ValidationError, match="seconds"):
        RecoverySummary.model_validate({"source": "peer", "step": 7, "bytes": 10, "seconds": -1})
