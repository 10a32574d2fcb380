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
