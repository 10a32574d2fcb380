"""Hooks into the training loop: what code outside the `Trainer` (the worker's progress reporting, the fault
drills of checkpointless recovery) runs at fixed points of it, instead of replacing the trainer's methods.

A callback is any object with methods named after some of the points (subclass `Callback`, whose points are
all no-ops, or not: a module that must not import training code can still add one); `Callbacks` holds a
trainer's callbacks and calls them in the order they were added. The points:

  on_step_start(trainer, step)    before a step is computed; `step`: the steps already taken
  on_step_end(trainer, record)    the step's update is applied and its record (loss, ...) made; before it is
                                  logged and before a checkpoint is saved for it
  before_save(trainer, step)      a checkpoint of `step` is about to be saved (every save: periodic and final)

An exception a callback raises propagates out of the trainer's loop like the trainer's own. Knows nothing
about what the callbacks do (progress keys, drills), the controller or recovery.
"""

from __future__ import annotations


class Callback:
    """Base class: every point is a no-op."""

    def on_step_start(self, trainer, step: int) -> None:
        pass

    def on_step_end(self, trainer, record: dict) -> None:
        pass

    def before_save(self, trainer, step: int) -> None:
        pass


class Callbacks:
    """A trainer's callbacks, called in the order they were added."""

    def __init__(self) -> None:
        self.items: list = []

    def add(self, callback) -> object:
        self.items.append(callback)
        return callback

    def _call(self, point: str, *args) -> None:
        for callback in self.items:
            method = getattr(callback, point, None)
            if method is not None:
                method(*args)

    def on_step_start(self, trainer, step: int) -> None:
        self._call("on_step_start", trainer, step)

    def on_step_end(self, trainer, record: dict) -> None:
        self._call("on_step_end", trainer, record)

    def before_save(self, trainer, step: int) -> None:
        self._call("before_save", trainer, step)
