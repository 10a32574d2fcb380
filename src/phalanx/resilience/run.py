"""Checkpointless training: a worker process that survives its peers' failures.

`CheckpointlessRun` wraps the unchanged `Trainer` (the way torchft wraps a user's loop) in a loop over
generations:

  join       find this rank in the generation's layout, arrive (every rank, or a newer generation), build
             the process groups on the controller's store under the generation's prefix
  restore    build a Trainer without initialising it; every rank reports what it holds (its carried live
             state, its snapshot copies) in one all_gather; `restore.choose_plan` picks the committed step
             and the transfers; each rank applies its own copy or a verified one from a peer. Any failed
             checksum sends every rank to the disk checkpoint instead (one all_reduce decides). Nothing
             held anywhere (the first start) is the disk path too: the newest checkpoint, or a fresh init
  train      step, report progress, take buddy snapshots; between steps, leave if a newer generation
             was published (`Superseded`)
  on a fault a collective failed (a peer died: gloo reports it within milliseconds, and the error cascades
             as every survivor drops its groups), or the generation was superseded: capture this rank's
             state into host memory, drop every reference to the old process groups (model, optimizer,
             mesh, snapshot thread, the exception's traceback) so their sockets close, and wait for the
             controller's next generation — then join again, without restarting the process

Errors that are not a peer's fault (a bug, a bad batch) are raised: the process exits non-zero and the
controller treats it as an application error (restart from the checkpoint, counted against max_retries).
A survivor that waits longer than `resilience.recovery_timeout_s` for a new generation exits with code 3.

Rank 0 of the generation that restores writes the recovery to `metrics.jsonl` (fault_detected, generation,
pg_rebuilt, state_restored with bytes and seconds, resumed) and tells the controller (`protocol.recovered_key`).
A generation that fails before it restored writes none of it: the next one records the whole recovery, from the
first fault (`failed_generations` counts the attempts).

Which failures are a peer's: `faults.py`; letting go of a generation's groups: `groups.py`. Knows nothing about
the controller beyond `protocol`, how the model is parallelised, or what the training state holds (`Trainer`,
`ShardState`); `phalanx.worker` picks this mode or the restart mode.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx import protocol
from phalanx.resilience.drill import Drill
from phalanx.resilience.faults import is_peer_fault
from phalanx.resilience.groups import release_process_groups
from phalanx.resilience.membership import Membership, NotInGeneration, RankTaken, Superseded
from phalanx.resilience.restore import (LIVE, Copy, Holding, IntegrityError, ShardState, choose_plan, exchange,
                                        shard_layout)
from phalanx.resilience.snapshots import BuddySnapshots, SnapshotShelf

log = logging.getLogger("phalanx.checkpointless")
EXIT_NO_GENERATION = 3
SWITCH_WAIT_S = 2.0  # at most this long for the progress keys of a new generation to be in the store


def last_logged_step(path) -> int | None:
    """The step of the last step record in a metrics.jsonl (its tail is read), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 16)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a rank killed mid-write, or the tail's first, partial line
        if isinstance(record, dict) and "event" not in record and "step" in record:
            return record["step"]
    return None


@dataclass
class Fault:
    """The fault this rank is recovering from: where it was (generation, step of the state it holds) and
    when; `again` counts the generations that failed during the recovery (before this rank trained again)."""
    generation: int
    at: float
    what: str
    step: int | None
    again: int = 0
    world_size: int | None = None  # of the generation it happened in


class CheckpointlessRun:
    def __init__(self, config, device: torch.device, backend: str, env=None):
        env = os.environ if env is None else env
        self.config, self.device, self.backend = config, device, backend
        self.settings = config.resilience
        self.membership = Membership.from_env(env, stuck_grace_s=config.resilience.stuck_grace_s)
        self.workers_per_node = int(env.get(protocol.LOCAL_WORLD_SIZE, "1"))
        self.generation = int(env[protocol.GENERATION])
        self.process_started_at = float(env.get(protocol.ACTIVATED_AT) or time.time())
        from phalanx.protocol import progress_reporter

        self.reporter = progress_reporter(env)
        self.shelf = SnapshotShelf()
        self.carried: ShardState | None = None
        self.last_record: dict | None = None  # the newest step this rank completed (its metrics record)
        self.fault: Fault | None = None
        self.trainer = None
        self.world_size: int | None = None  # of the generation this rank is in (or last was)
        self.snapshots: BuddySnapshots | None = None
        self.marks: dict[str, float] = {"started": self.process_started_at}  # when each phase ended (wall)
        self.drill = Drill(config.resilience.drill, int(env.get("RANK", "0")), self.generation)
        # Modules, config, data index: long-lived. Frozen, the collection that releases a generation's groups
        # after a fault scans only what that generation built (tenths of a second less on the critical path).
        gc.collect()
        gc.freeze()

    # ---- the loop over generations ----------------------------------------------------------------
    def run(self) -> int:
        while True:
            try:
                self.train_generation(self.generation)
                self.close()
                return 0
            except NotInGeneration as err:
                log.warning("%s; next: exit (the controller replaced this node)", err)
                return 0
            except RankTaken as err:
                log.error("%s; next: exit with code %d", err, EXIT_NO_GENERATION)
                return EXIT_NO_GENERATION
            except Exception as err:  # noqa: BLE001 - classified right here (resilience.faults)
                if not is_peer_fault(err):
                    raise
                newer = err.newer if isinstance(err, Superseded) else None
                what = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            # Outside the except block: the traceback (and the frames holding the old groups) is gone.
            self.leave_generation(what)
            try:
                self.generation = newer or self.membership.wait_for_newer(self.generation,
                                                                          self.settings.recovery_timeout_s)
            except TimeoutError as err:
                log.error("%s; next: exit with code %d (the controller restarts the job from its checkpoint)",
                          err, EXIT_NO_GENERATION)
                return EXIT_NO_GENERATION
            self.marks["published"] = time.time()
            log.info("generation %d published; next: regroup", self.generation)

    def close(self) -> None:
        """Training finished: release the groups before the interpreter exits (a gloo group destroyed by
        interpreter teardown aborts the process)."""
        if self.snapshots is not None:
            self.snapshots.wait()
        self.trainer = self.snapshots = None
        release_process_groups()

    def leave_generation(self, what: str) -> None:
        now = time.time()
        resumed = self.trainer is not None and self.trainer.ready  # trained (or restored) in this generation
        if self.fault is None or (resumed and self.fault.generation != self.generation):
            step = self.trainer.progress.step if resumed else self.carried.step if self.carried is not None else None
            self.fault = Fault(self.generation, now, what, step, world_size=self.world_size)
        else:  # a fault during the recovery from an earlier one: the same recovery goes on, from the same step
            self.fault.again += 1
        step = self.fault.step
        self.marks = {"fault": now}
        log.warning("generation %d ended at step %s (%s); next: keep this process and its state in memory, "
                    "wait for the next generation", self.generation, step, what)
        self.membership.unwatch()
        if self.reporter is not None:  # its agent: regrouping from here on, not a stalled step
            self.reporter.leave()
        try:
            self.membership.report_left(self.generation)
        except (RuntimeError, OSError) as err:  # the controller restarts: told once its store is back
            self.membership.left_untold = self.generation
            log.warning("could not tell the controller this rank left generation %d (%s); next: tell it once its "
                        "store is back", self.generation, err)
        self.shelf.freeze()  # a snapshot exchange still running must not change what we report
        if self.trainer is not None and self.trainer.ready:
            self.carried = ShardState.capture(self.trainer)
            self.last_record = self.trainer.last_record or self.last_record
        self.marks["captured"] = time.time()
        if self.snapshots is not None:
            self.snapshots.release()
        if self.trainer is not None:
            self.trainer.abandon()
        self.trainer = self.snapshots = None
        self.marks["abandoned"] = time.time()
        release_process_groups(self.marks)
        self.marks["left"] = time.time()

    # ---- one generation ------------------------------------------------------------------------------------
    def train_generation(self, generation: int) -> None:
        from phalanx.train.trainer import Trainer

        marks = self.marks
        self.membership.forming(generation)  # until `watch` below: a newer generation makes this rank leave
        placement = self.membership.placement(generation)
        self.membership.arrive(placement, self.settings.regroup_timeout_s)
        self.world_size = placement.world_size
        if self.reporter is not None:  # from here on a freeze is seen: the beat stops under this generation's keys
            self.reporter.switch(generation, placement.rank, wait_s=SWITCH_WAIT_S)
        marks["arrived"] = time.time()
        self.membership.init_process_group(placement, self.backend, self.config.pg_timeout_s,
                                           self.settings.regroup_timeout_s)
        marks["pg"] = time.time()
        if self.fault is not None:
            self.drill.at_regroup()
        self.trainer = trainer = Trainer(self.config, self.device, init_weights=False)
        trainer.checkpoint_requests = self.reporter  # the controller's checkpoint requests (None: not under one)
        marks["trainer"] = time.time()
        self.restore(trainer, placement)
        self.drill.install(trainer)
        trainer.callbacks.add(self.membership)  # a step blocked on a frozen peer ends the process (membership.py)
        self.membership.watch(generation)
        if self.settings.snapshot_interval and trainer.dims.dp_replicate == 1:
            self.snapshots = BuddySnapshots(trainer, self.shelf, interval=self.settings.snapshot_interval,
                                            workers_per_node=self.workers_per_node)
            self.snapshots.after_step(force=True)  # cover every shard again at once after a recovery
        if self.reporter is not None:
            self.reporter.report(trainer.progress.step)
        while not trainer.done:
            if self.membership.superseded.is_set():
                raise Superseded(generation, self.membership.latest())
            record = trainer.advance()
            if self.reporter is not None:
                self.reporter.report(record["step"], record.get("compute_time_s"))
            if self.snapshots is not None:
                self.snapshots.after_step()
            self.membership.at_boundary()  # the step and its save/snapshot done: a newer generation is news now
        self.membership.on_step_start(trainer, trainer.progress.step)  # the final save: collectives, as a step's
        if self.snapshots is not None:
            self.snapshots.wait()
        trainer.finish()  # the final checkpoint is committed on every rank
        self.membership.at_boundary()
        trainer.metrics.close()
        if self.reporter is not None:  # the controller learns the last step before this process exits, even
            self.reporter.flush(protocol.EXIT_FLUSH_S)  # when its store came back (a controller restart) only just now
        if dist.get_rank() == 0:
            try:
                self.membership.report_finished(trainer.progress.step)
            except (RuntimeError, OSError) as err:
                log.warning("could not tell the controller that training finished (%s)", err)

    # ---- agreement and restore -------------------------------------------------------------------------------
    def restore(self, trainer, placement) -> None:
        start = time.time()
        coord, signature = shard_layout(trainer.mesh)
        mine: dict[str, ShardState] = {}
        copies: list[Copy] = []
        if self.carried is not None:
            c = self.carried
            mine[LIVE] = c
            copies.append(Copy(LIVE, c.coord, c.signature, c.step))
        for copy, state in self.shelf.copies():
            mine[copy.source] = state
            copies.append(copy)
        info = {"holding": Holding(placement.rank, coord, signature, tuple(copies)), "rank": placement.rank,
                "node": self.membership.node, "marks": self.marks, "process_started_at": self.process_started_at,
                "record": self.last_record,
                "fault": self.fault.__dict__ if self.fault is not None else None}
        infos: list = [None] * placement.world_size
        dist.all_gather_object(infos, info)
        self.marks["gathered"] = time.time()
        told = self._record_fault(trainer, infos, placement.cause)
        plan = choose_plan([i["holding"] for i in infos])
        received, restore_error = 0, None
        if plan.kind == "memory":
            try:
                want = plan.receive(placement.rank)
                sends = [(t.dst, mine[t.source]) for t in plan.sends(placement.rank)]
                got = exchange(sends, [want.src] if want else [], group=self._transfer_group())
                state = got[want.src] if want else mine[plan.local[placement.rank]]
                received = state.nbytes if want else 0
                state.apply(trainer)
            except IntegrityError as err:
                restore_error = str(err)
            ok = torch.tensor([0.0 if restore_error else 1.0])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if ok.item() < 1:
                plan.kind, plan.reason = "disk", (restore_error or "a peer's transferred state failed "
                                                  "verification") + "; falling back to the newest checkpoint"
        if plan.kind == "disk":
            if self.carried is not None or self.shelf.copies():
                log.warning("checkpointless restore not possible: %s", plan.reason)
            trainer.initialize_weights()
            # the newest valid checkpoint, or a fresh start; after a fault, `resumed` comes after `state_restored`
            trainer.start(announce=told is None)
        trainer.ready = True
        trainer.follow_scaled_lr()  # elastic scale_batch: a peer's state carries its size's learning rate
        moved = torch.tensor([float(received)])
        dist.all_reduce(moved)
        self.marks["restored"] = time.time()
        if told is not None:
            self._record_restored(trainer, plan, infos, start, int(moved.item()), told)
        self.carried = None
        self.shelf.prune_after(trainer.progress.step)

    def _transfer_group(self):
        """States travel in host memory over gloo: the default group on CPU, a gloo group beside NCCL."""
        return None if self.backend == "gloo" else dist.new_group(backend="gloo")

    def _record_fault(self, trainer, infos: list[dict], cause: str = "fault") -> list[dict] | None:
        """Rank 0, after a fault: what happened and how the generation formed, before any state moves. Returns
        those events (None on other ranks and on a first start); `_record_restored` writes them once the state
        is restored, so a generation that fails half-way leaves no partial recovery in metrics.jsonl."""
        faults = [i["fault"] for i in infos if i["fault"] is not None]
        if dist.get_rank() != 0 or not faults:
            return None
        told: list[dict] = []
        # the newest step a survivor completed may never have been logged (the old rank 0 died between its
        # optimizer update and its metrics line): every rank holds the step's reduced record, so log it here
        done = [i["record"] for i in infos if i.get("record")]
        newest = max(done, key=lambda r: r["step"], default=None)
        logged = last_logged_step(trainer.metrics.path)
        if newest is not None and (logged is None or newest["step"] > logged):
            trainer.metrics.step({**newest, "logged_after_fault": True}, print_line=False)
        first = min(faults, key=lambda f: f["at"])
        t0 = first["at"]
        fresh = [i["rank"] for i in infos if i["fault"] is None]
        # the newest step any rank held (survivors may differ by one: a rank whose snapshot thread saw the dead
        # peer first can leave before its optimizer update while the others complete the step); `resumed`'s
        # steps_lost counts from it, so `step - steps_lost` is where training resumed
        held = max((f["step"] for f in faults if f["step"] is not None), default=None)
        if cause == "resize":  # an elastic job's size changed: the controller ended the generation, nothing failed
            self._event(told, "resized", at=first["at"], generation=first["generation"], step=held,
                        from_world_size=first.get("world_size"), world_size=len(infos), what=first["what"],
                        global_batch_size=trainer.config.training.global_batch_size,
                        peak_lr=trainer.config.optimizer.lr)
        else:
            self._event(told, "fault_detected", at=first["at"], generation=first["generation"],
                        step=held, what=first["what"], detected_by=len(faults),
                        failed_generations=1 + max(f.get("again", 0) for f in faults))
        phases = {i["rank"]: {k: round(v - t0, 4) for k, v in i["marks"].items()} for i in infos}
        self._event(told, "generation", generation=self.generation, world_size=len(infos),
                    survivors=len(faults), replacements=fresh,
                    rejoin_started_at=min((i["process_started_at"] for i in infos if i["fault"] is None),
                                          default=None),
                    phases_since_fault_s=phases)
        self._event(told, "pg_rebuilt", generation=self.generation,
                    seconds=round(max(i["marks"]["pg"] - i["marks"]["arrived"] for i in infos), 4),
                    all_arrived_after_fault_s=round(max(i["marks"]["arrived"] for i in infos) - t0, 4))
        return told

    @staticmethod
    def _event(told: list[dict], kind: str, **fields) -> None:
        """A recovery event, written by `_record_restored` to metrics.jsonl and the controller's events."""
        told.append({"event": kind, **fields})

    def _record_restored(self, trainer, plan, infos: list[dict], start: float, moved: int,
                         told: list[dict]) -> None:
        """Rank 0: how the state was restored, then `resumed` (metrics.jsonl), and the whole recovery for the
        controller. Steps lost: the newest step any rank held at the fault minus the step training resumes
        from (never negative: a rank's step is the state it holds, not a generation that never trained)."""
        faults = [i["fault"] for i in infos if i["fault"] is not None]
        first = min(faults, key=lambda f: f["at"])
        held = [f["step"] for f in faults if f["step"] is not None]
        step = trainer.progress.step
        source = ("checkpoint" if plan.kind == "disk" else "buddy-snapshot" if plan.from_snapshot
                  else "peer-memory")
        summary = {"source": source, "step": step, "bytes": moved, "seconds": round(time.time() - start, 4),
                   "transfers": len(plan.transfers), "reason": plan.reason or None}
        self._event(told, "state_restored", **summary)
        resumed = {"step": step, "samples_consumed": trainer.progress.samples_consumed, "world_size": len(infos),
                   "recovery": "checkpointless" if plan.kind == "memory" else "checkpoint",
                   "steps_lost": max(0, max(held) - step) if held else None}
        if plan.kind == "disk" and trainer.resumed_from is not None:
            resumed = {**trainer.resumed_from, **resumed}
        self._event(told, "resumed", **resumed)
        for event in told:
            trainer.metrics.event(event["event"], **{k: v for k, v in event.items() if k != "event"})
        try:
            self.membership.report_recovered(self.generation, {**summary, "generation": self.generation,
                                                               "fault": first["what"], "events": told})
        except (RuntimeError, OSError) as err:
            log.warning("could not tell the controller about the recovery (%s); training goes on", err)


def run_checkpointless(config, device: torch.device, backend: str) -> int:
    return CheckpointlessRun(config, device, backend).run()
