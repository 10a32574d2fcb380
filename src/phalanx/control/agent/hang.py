"""The agent's hang rule: which of its workers is hung, from the progress and liveness beat the controller
relays (`phalanx.protocol.progress_key`, `alive_key`).

Hang detection: the controller relays each rank's progress and liveness beat (`protocol.progress_key`,
`protocol.alive_key`) in every reply. When one rank of a collective job hangs, every rank stops progressing —
the others wait for it — so progress alone cannot name the culprit; the beat can:
  frozen   no progress and no beat for `hang_timeout_s` (the process itself is stuck: SIGSTOP, a stalled
           host): SIGKILLed at once and reported as hung (`frozen`), which the controller treats as a node
           fault. Its peers then fail at once and are stopped.
  stalled  no progress for 2 × `hang_timeout_s` while the beat goes on (every rank waiting: a deadlock, a
           stuck collective): SIGKILLed and reported as hung but alive — a job-level fault, not a node's.
Nothing is judged while the relay is down (the controller unreachable: `relay_down()`), and the clocks
restart with the first reply after any gap (an outage, a restarted controller with an empty store), so an
outage is never taken for a hang. After a gap, a worker whose beat has not been relayed yet (its reporter is
still reconnecting to the restarted store) is judged frozen only after 2 × `hang_timeout_s`, not 1. Workers that never report progress (plain torch.distributed programs)
are not judged.
A worker between generations of a checkpointless job (regrouping: no step yet in the new generation, its
beat already there) is judged frozen by the same rule, never stalled: its wait is bounded by the regroup's
own timeout.

Pure: decides from numbers, kills nothing (the supervisor does). Must not know: processes, the controller.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hang:
    hang: str  # what the worker's log and the controller are told
    frozen: bool  # the process itself is stuck (a node fault), not waiting alive on its peers


def judge_hang(w, now: float, timeout: float) -> Hang | None:
    """`w`: a worker's relayed `last_step`, `last_change`, `last_beat`, `last_beat_change` (monotonic), and
    `beat_since_gap` (a beat was relayed since the relay's last gap)."""
    silent = now - w.last_change
    if silent <= timeout:
        return None
    beat_silent = now - w.last_beat_change
    reconnecting = not w.beat_since_gap and silent <= 2 * timeout
    if w.last_beat is not None and beat_silent > timeout / 2 and not reconnecting:
        where = f"after step {w.last_step}" if w.last_step is not None else "while regrouping"
        return Hang(f"frozen: no progress for {silent:.1f} s {where} and no liveness beat for {beat_silent:.1f} s "
                    f"(hang_timeout_s={timeout:g})", frozen=True)
    if silent > 2 * timeout and w.last_step is not None:  # (no step yet: regrouping, bounded on its own)
        return Hang(f"stalled: no progress for {silent:.1f} s after step {w.last_step} while alive (waiting on its "
                    f"peers: a deadlock or a stuck collective; 2 × hang_timeout_s={timeout:g})", frozen=False)
    return None  # alive and waiting: most likely on a frozen peer, which its own agent kills
