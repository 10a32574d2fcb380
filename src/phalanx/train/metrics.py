"""Run output: `metrics.jsonl` (one object per step, plus `event` lines of an `EventKind`) and the progress line.

Only rank 0 writes. Knows nothing about models or parallelism.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from phalanx.observability.events import EventKind, event_kind


class MetricsWriter:
    def __init__(self, run_dir: Path, *, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.max_steps = max_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console = Console(highlight=False, soft_wrap=True)
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def step(self, record: dict, *, print_line: bool = True) -> None:
        if not self.enabled:
            return
        self._write({"time": time.time(), **record})
        if print_line:
            self.console.print(
                f"[bold]step {record['step']:>5}/{self.max_steps}[/] "
                f"loss [cyan]{record['loss']:.4f}[/] grad_norm {record['grad_norm']:.3f} "
                f"lr {record['lr']:.2e} consumed {record['samples_consumed']} "
                f"iter {record['step_time_s']:.3f}s {record['tokens_per_s']:,.0f} tok/s"
            )

    def event(self, kind: EventKind | str, **fields) -> None:
        kind = event_kind(kind).value  # one vocabulary with the controller's events
        if not self.enabled:
            return
        self._write({"time": time.time(), "event": kind, **fields})
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        self.console.print(f"[magenta]{kind}[/] {escape(details)}")  # details may hold [brackets]

    def close(self) -> None:
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
