"""The training side's seams: trainer callbacks run in order at their points, and `phalanx.train` imports no
recovery code (the worker entry point that picks a mode is `phalanx.worker`)."""

from __future__ import annotations

import subprocess
import sys

from phalanx.train.callbacks import Callback, Callbacks


def test_callbacks_run_in_order_and_may_implement_only_some_points():
    calls = []

    class Full(Callback):
        def on_step_start(self, trainer, step):
            calls.append(("full", "start", step))

        def on_step_end(self, trainer, record):
            calls.append(("full", "end", record["step"]))

    class OnlySave:  # duck-typed: no base class
        def before_save(self, trainer, step):
            calls.append(("save", step))

    callbacks = Callbacks()
    callbacks.add(Full())
    callbacks.add(OnlySave())
    callbacks.on_step_start(None, 3)
    callbacks.on_step_end(None, {"step": 4})
    callbacks.before_save(None, 4)
    assert calls == [("full", "start", 3), ("full", "end", 4), ("save", 4)]


def test_train_imports_no_recovery_code():
    code = ("import sys, phalanx.train.worker, phalanx.train.trainer, phalanx.train.launch, phalanx.train.export; "
            "print(sorted(m for m in sys.modules if m.startswith('phalanx.resilience') or m == 'phalanx.worker'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


class StaggeredRequests:
    """A checkpoint request source as a worker's progress reporter is one: `pending_checkpoint()` returns the newest
    request this rank has read and not served. Rank r reads each request `r` steps after rank 0 does (a reporter
    reads the store on its own schedule); `requests`: {id: the step before which rank 0 reads it}."""

    def __init__(self, trainer, rank: int, requests: dict[int, int]):
        self.trainer, self.rank, self.requests, self.served = trainer, rank, requests, 0

    def pending_checkpoint(self) -> int:
        read = [rid for rid, step in self.requests.items() if self.trainer.progress.step >= step + self.rank]
        return max(read) if read and max(read) > self.served else 0

    def checkpoint_served(self, request: int) -> None:
        self.served = max(self.served, request)


def _train_with_requests(config, requests: dict[int, int]) -> list[int]:
    import torch
    import torch.distributed as dist

    from phalanx.train.trainer import Trainer

    trainer = Trainer(config, torch.device("cpu"))
    trainer.checkpoint_requests = StaggeredRequests(trainer, dist.get_rank(), requests)
    saved = []
    trainer.callbacks.add(type("Saves", (), {"before_save": lambda self, t, step: saved.append(step)})())
    trainer.fit()
    return saved


def test_a_checkpoint_request_is_saved_after_the_first_step_every_rank_has_read_it(tmp_path, demo_data):
    """The ranks of a job read the controller's checkpoint request at different moments; they save together, at
    the end of the first step all of them had read it before (the flag rides on the step's loss all-reduce), once
    per request, beside the interval's saves. A save asked for is marked so in its `checkpoint_saved` event."""
    from conftest import tiny_config
    from distributed import run_distributed
    from phalanx.train.metrics import read_metrics

    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 9}, checkpoint={"interval": 4})
    # request 5: rank 0 reads it before step 3 (after 2 steps), rank 1 a step later: saved after step 4, which is
    # the interval's save too; request 9: read before step 6 (rank 0), step 7 (rank 1): saved after step 7
    per_rank = run_distributed(_train_with_requests, 2, tmp_path, config, {5: 2, 9: 5})
    assert per_rank == [[4, 7, 8, 9]] * 2, per_rank  # 4 and 8: the interval, 9: the last step
    _, events = read_metrics(config.run_dir)
    saves = {e["step"]: (e.get("requested", False), e.get("request")) for e in events
             if e["event"] == "checkpoint_saved"}
    assert saves == {4: (True, 5), 7: (True, 9), 8: (False, None), 9: (False, None)}, saves
