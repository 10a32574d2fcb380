"""Run output: `metrics.jsonl` (one object per step, plus `event` lines of an `EventKind`), the run's
`events.jsonl` (the same events as `Event`s, beside the controller's and the agents', see
phalanx.observability.run_events) and the progress line.

Only rank 0 writes. Its events go through one `EventLog` (source "rank:0"; the job from PHALANX_JOB_ID when an
agent started it) with two sinks: the metrics.jsonl line, exactly `{"time", "event": kind, **fields}` (what
`read_metrics`, the tests and the chaos soak read), then `<events_dir>/events.jsonl` — the job's checkpoint
dir, the run dir every source of a job's events knows. Step records also go to `scalars` when given (the
run's TensorBoard scalars, `phalanx.train.tensorboard`). Knows nothing about models or parallelism.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from phalanx.observability.events import Event, EventKind, EventLog, event_kind
from phalanx.observability.run_events import JsonlSink, events_path
from phalanx.protocol import JOB_ID


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, max_steps: int, events_dir: Path | None = None,
                 source: str = "rank:0", scalars=None):
        """`events_dir`: where the run's events.jsonl is (the trainer gives its checkpoint dir); default `run_dir`.
        `scalars`: also given each step record (`write(record, walltime)`, `close()`), e.g. `TensorBoardScalars`."""
        self.enabled = enabled
        self.max_steps = max_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self.events_path = events_path(run_dir if events_dir is None else events_dir)
        self.console = Console(highlight=False, soft_wrap=True)
        self._file = None
        self.log = EventLog(source, [self._event_line, JsonlSink(self.events_path)])
        self.job = os.environ.get(JOB_ID) or None  # (set by the agent that started this worker)
        self.scalars = scalars if enabled else None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def _event_line(self, event: Event) -> None:
        """The metrics.jsonl sink: the event line in the format metrics.jsonl has always had."""
        self._write({"time": event.time, "event": event.kind.value, **event.fields})

    def step(self, record: dict, *, print_line: bool = True) -> None:
        if not self.enabled:
            return
        now = time.time()
        self._write({"time": now, **record})
        if self.scalars is not None:
            self.scalars.write(record, walltime=now)
        if print_line:
            self.console.print(
                f"[bold]step {record['step']:>5}/{self.max_steps}[/] "
                f"loss [cyan]{record['loss']:.4f}[/] grad_norm {record['grad_norm']:.3f} "
                f"lr {record['lr']:.2e} consumed {record['samples_consumed']} "
                f"iter {record['step_time_s']:.3f}s {record['tokens_per_s']:,.0f} tok/s"
                + (f" mfu {record['mfu']:.1%}" if "mfu" in record else "")
            )

    def event(self, kind: EventKind | str, **fields) -> None:
        kind = event_kind(kind).value  # one vocabulary with the controller's events (checked on every rank)
        if not self.enabled:
            return
        self.log.emit_fields(kind, fields, job=self.job)  # (field names are data: `node` stays a field)
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        self.console.print(f"[magenta]{kind}[/] {escape(details)}")  # details may hold [brackets]

    def close(self) -> None:
        if self.scalars is not None:
            self.scalars.close()
            self.scalars = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a run, in file order."""
    steps, events = [], []
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            (events if "event" in record else steps).append(record)
    return steps, events
