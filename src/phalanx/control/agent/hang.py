"""The agent's hang rule: which of its workers is hung, from the progress and liveness beat each one writes for
its agent on the node (`phalanx.protocol.write_local`, to the `PHALANX_PROGRESS_FILE` its agent chose).

When one rank of a collective job hangs, every rank stops progressing — the others wait for it — so progress
alone cannot name the culprit; the beat (bumped by a thread of the worker's own, which goes on while its main
thread waits in a collective) can:
  frozen   no progress and no beat for `hang_timeout_s` (the process itself is stuck: SIGSTOP, a stalled
           host): SIGKILLed at once and reported as hung (`frozen`), which the controller treats as a node
           fault. Its peers then fail at once and are stopped.
  stalled  no progress for 2 × `hang_timeout_s` while the beat goes on (every rank waiting: a deadlock, a
           stuck collective): SIGKILLed and reported as hung but alive — a job-level fault, not a node's.
The input never leaves the node (before protocol 6 the controller relayed it from its store in every heartbeat
reply), so the rule judges the same through a controller outage or a cut network, and an agent needs no reply to
keep judging. Workers that write no progress (plain torch.distributed programs) are not judged.
A worker between generations of a checkpointless job (regrouping: from leaving one until it reports the step
it restored in the next it writes no step, its beat going on) is judged frozen by the same rule, never stalled:
its wait is bounded by the regroup's and the recovery's own timeouts.

Pure: decides from numbers, kills nothing (the supervisor does). Must not know: processes, the controller.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hang:
    hang: str  # what the worker's log and the controller are told
    frozen: bool  # the process itself is stuck (a node fault), not waiting alive on its peers


def judge_hang(w, now: float, timeout: float) -> Hang | None:
    """`w`: a worker's `last_step`, `last_change`, `last_beat`, `last_beat_change` (monotonic) as its agent read
    them."""
    silent = now - w.last_change
    if silent <= timeout:
        return None
    beat_silent = now - w.last_beat_change
    if w.last_beat is not None and beat_silent > timeout / 2:
        where = f"after step {w.last_step}" if w.last_step is not None else "while regrouping"
        return Hang(f"frozen: no progress for {silent:.1f} s {where} and no liveness beat for {beat_silent:.1f} s "
                    f"(hang_timeout_s={timeout:g})", frozen=True)
    if silent > 2 * timeout and w.last_step is not None:  # (no step yet: regrouping, bounded on its own)
        return Hang(f"stalled: no progress for {silent:.1f} s after step {w.last_step} while alive (waiting on its "
                    f"peers: a deadlock or a stuck collective; 2 × hang_timeout_s={timeout:g})", frozen=False)
    return None  # alive and waiting: most likely on a frozen peer, which its own agent kills
