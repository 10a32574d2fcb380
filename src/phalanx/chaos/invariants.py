"""The invariants a job must keep whatever fault hit it, each a pure function of what the job left behind —
rank 0's `metrics.jsonl` records, the controller's description of the job (`JobClient.describe`: generations,
workers, events), and two process censuses — returning what it found wrong (empty: the invariant holds).

    finished     the job succeeded and rank 0 recorded the end of training (`finished` at the last step)
    losses       every step's loss (first try or redone) equals the failure-free run's, bit for bit (fp32)
    steps_lost   no recovery redid more committed steps than the mode allows
    events       the recovery story is consistent: no negative step counts; generation numbers increase;
                 every `fault_detected` is followed by a `resumed` or a fallback to the checkpoint; a
                 `resumed` is never written before the `fault_detected`/`state_restored` of its recovery;
                 the controller's generations, outcomes, events and last step agree with the run
    generations  the fault ended as many generations as it should (a slow rank or a controller restart none)
    leaks        no worker of the job outlived it; every node runs its agent, its worker template and warm
                 standbys, nothing else; retired nodes left nothing; no port of the job is still listened on; the controller did
                 not open ports it keeps

Knows nothing about how faults are injected or how the job was run.
"""

from __future__ import annotations

import re

from phalanx.chaos.census import Census

FAULT_OUTCOMES = ("node-fault", "process-fault", "stranded", "app-error", "restart-job")
NEGATIVE = re.compile(r"(?:step|steps|lost)[ =:]+(-\d+)|(-\d+) committed step")


def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "event" not in r]


def check_finished(info: dict, records: list[dict], max_steps: int) -> list[str]:
    out = []
    if info["state"] != "succeeded":
        out.append(f"job {info['id']} {info['state']}: {info.get('reason')}")
    finished = [r for r in records if r.get("event") == "finished"]
    if not finished or finished[-1].get("step") != max_steps:
        out.append(f"metrics.jsonl has no `finished` event at step {max_steps}")
    return out


def check_losses(records: list[dict], reference: dict[int, float]) -> list[str]:
    steps = step_records(records)
    out = []
    missing = sorted(set(reference) - {s["step"] for s in steps})
    if missing:
        out.append(f"steps never logged: {missing}")
    extra = sorted({s["step"] for s in steps} - set(reference))
    if extra:
        out.append(f"steps the failure-free run does not have: {extra}")
    diverged = [(s["step"], s["loss"], reference[s["step"]]) for s in steps
                if s["step"] in reference and s["loss"] != reference[s["step"]]]
    if diverged:
        out.append(f"{len(diverged)} step record(s) differ from the failure-free run (step, loss, reference): "
                   f"{diverged[:4]}")
    return out


def recoveries(records: list[dict]) -> list[dict]:
    """Each `resumed` event (a restart from the checkpoint, or a checkpointless continuation) — or a `started`
    after steps were logged (a restart before the first checkpoint: from step 0) — with the step rank 0 had
    logged last before it and the committed steps redone (`lost`; negative: steps committed that rank 0 never
    logged)."""
    out, last = [], 0
    for r in records:
        if "event" not in r:
            last = r["step"]
        elif r["event"] == "resumed" or (r["event"] == "started" and last > 0):
            step = (r.get("step") or 0) if r["event"] == "resumed" else 0
            out.append({"step": step, "last_logged": last, "lost": last - step})
    return out


def check_steps_lost(records: list[dict], allowed: int) -> list[str]:
    return [f"a recovery went back from step {r['last_logged']} to step {r['step']}: {r['lost']} committed "
            f"steps redone, the mode allows {allowed}" for r in recoveries(records) if r["lost"] > allowed]


def _blocks(records: list[dict]) -> list[list[dict]]:
    """Runs of consecutive events with no step record between them: one recovery's events are one run."""
    blocks, current = [], []
    for r in records:
        if "event" in r:
            current.append(r)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def check_metrics_events(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        if "event" not in r:
            if not isinstance(r.get("step"), int) or r["step"] < 1:
                out.append(f"a step record with step {r.get('step')!r}")
            continue
        for key in ("step", "steps_lost", "samples_consumed", "generation", "bytes"):
            value = r.get(key)
            if isinstance(value, (int, float)) and value < 0:
                out.append(f"`{r['event']}` with {key}={value}")
    generations = [r["generation"] for r in records if r.get("event") == "generation"]
    if any(b <= a for a, b in zip(generations, generations[1:])):
        out.append(f"generation numbers do not increase: {generations}")
    for block in _blocks(records):
        # one recovery's events end at its `resumed`; several recoveries may follow each other with no step
        # in between (a second fault during the first's recovery)
        segments, current = [], []
        for r in block:
            current.append(r)
            if r["event"] == "resumed":
                segments.append(current)
                current = []
        if current:
            segments.append(current)
        told = {"fault_detected", "state_restored"}
        for a, b in zip(segments, segments[1:]):
            kinds_a, kinds_b = [r["event"] for r in a], [r["event"] for r in b]
            if not told & set(kinds_a) and told & set(kinds_b) and kinds_b[-1] != "resumed":
                out.append(f"`resumed` (step {a[-1].get('step')}) written before the "
                           f"{' and '.join(f'`{k}`' for k in sorted(told & set(kinds_b)))} of the same recovery: "
                           f"{kinds_a + kinds_b}")
        for segment in segments:
            fault = next((r for r in segment if r["event"] == "fault_detected"), None)
            new = next((r for r in segment if r["event"] == "generation"), None)
            if fault and new and fault.get("generation") is not None and fault["generation"] >= new["generation"]:
                out.append(f"fault_detected in generation {fault['generation']} followed by generation "
                           f"{new['generation']}")
    for i, r in enumerate(records):
        if r.get("event") == "fault_detected":
            later = records[i + 1:]
            if not any(e.get("event") == "resumed" or (e.get("event") == "state_restored" and
                                                       e.get("source") == "checkpoint") for e in later):
                out.append(f"fault_detected at step {r.get('step')} (generation {r.get('generation')}) is never "
                           f"followed by `resumed` or a fallback to the checkpoint")
    return out


def check_controller_events(info: dict, mode: str, max_steps: int | None = None) -> list[str]:
    out = []
    if max_steps is not None and info["state"] == "succeeded" and info.get("last_step") != max_steps:
        out.append(f"the job succeeded at step {max_steps} but the controller recorded step {info.get('last_step')} "
                   f"last: {info.get('reason')!r}")
    gens = info["generations"]
    numbers = [g["generation"] for g in gens]
    if numbers != list(range(1, len(gens) + 1)):
        out.append(f"generations are not numbered 1..n: {numbers}")
    starts = [g["started_at"] for g in gens]
    if starts != sorted(starts):
        out.append("generations did not start in order")
    for g in gens[:-1]:
        if g["outcome"] not in FAULT_OUTCOMES:
            out.append(f"generation {g['generation']} was followed by another but ended {g['outcome']!r} "
                       f"({g.get('end_reason')})")
    if info["state"] == "succeeded" and gens and gens[-1]["outcome"] != "succeeded":
        out.append(f"the job succeeded but its last generation ended {gens[-1]['outcome']!r}")
    for g in gens:
        for key in ("start_step", "last_step"):
            if isinstance(g.get(key), int) and g[key] < 0:
                out.append(f"generation {g['generation']} has {key}={g[key]}")
        for key, value in (g.get("restored") or {}).items():
            if key in ("step", "steps_lost", "bytes", "generation") and isinstance(value, (int, float)) \
                    and value < 0:
                out.append(f"generation {g['generation']}'s restore summary has {key}={value}")
    stray = sorted({w["generation"] for w in info["workers"]} - set(numbers))
    if stray:
        out.append(f"worker records of generations that do not exist: {stray}")
    events = sorted(info["events"], key=lambda e: (e["time"], e.get("id", 0)))
    for e in events:
        m = NEGATIVE.search(e.get("reason") or "")
        if m:
            out.append(f"controller event `{e['kind']}` with a negative step count: {e['reason']!r}")
    started = [e for e in events if e["kind"] == "generation"]
    if len(started) != len(gens):
        out.append(f"{len(started)} `generation` events for {len(gens)} generations")
    if mode == "checkpointless":
        restored_at: dict[int, float] = {}
        for e in events:
            g = re.search(r"generation (\d+)", e.get("reason") or "")
            if e["kind"] == "state_restored" and g:
                restored_at.setdefault(int(g.group(1)), e["time"])
        for i, e in enumerate(events):
            if e["kind"] == "fault_detected" and not any(x["kind"] == "state_restored" for x in events[i + 1:]):
                out.append(f"controller event fault_detected ({e['reason']!r}) is never followed by "
                           f"state_restored")
            g = re.search(r"generation (\d+)", e.get("reason") or "")
            if e["kind"] == "resumed" and g and not (int(g.group(1)) in restored_at
                                                     and restored_at[int(g.group(1))] <= e["time"]):
                out.append(f"controller event resumed ({e['reason']!r}) before its state_restored")
    return out


def check_generations(info: dict, at_least: int, at_most: int | None) -> list[str]:
    n = len(info["generations"])
    outcomes = [g["outcome"] for g in info["generations"]]
    if n < at_least:
        return [f"{n} generation(s) {outcomes}: the fault did not take effect (expected at least {at_least})"]
    if at_most is not None and n > at_most:
        return [f"{n} generations {outcomes}: expected at most {at_most} (this fault must not end one)"]
    return []


def check_leaks(before: Census, after: Census, job_pids_alive: dict[int, str], job_ports: list[int]) -> list[str]:
    """`job_pids_alive`: the job's worker pids still running after it ended (pid → command line);
    `job_ports`: ports the job's generations used (their MASTER_PORT)."""
    out = []
    if job_pids_alive:
        out.append(f"workers of the job still running after it ended: "
                   f"{[f'{p}: {c[:80]}' for p, c in sorted(job_pids_alive.items())]}")
    for name, n in sorted(after.nodes.items()):
        others = [p for p in n.members if p not in (n.agent, n.template)]
        if len(others) > n.standbys:
            out.append(f"node {name}: {len(others)} processes besides its agent, its worker template and "
                       f"{n.standbys} warm standby(s): {others}")
    for name, members in sorted(after.retired.items()):
        out.append(f"retired node {name} left processes running: {members}")
    if before.controller and after.controller and \
            len(after.ports_of(after.controller)) > len(before.ports_of(before.controller)):
        out.append(f"the controller listens on more ports than before the trial: "
                   f"{before.ports_of(before.controller)} → {after.ports_of(after.controller)}")
    held = sorted(p for p in job_ports if p in after.listening)
    if held:
        out.append(f"the job's ports still listened on: {[(p, after.listening[p]) for p in held]}")
    before_n, after_n = len(before.pids()), len(after.pids())
    if len(after.nodes) == len(before.nodes) and after_n > before_n:
        out.append(f"the cluster runs {after_n} processes after the trial, {before_n} before")
    return out
