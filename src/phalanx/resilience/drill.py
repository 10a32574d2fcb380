"""Fault drills: a worker kills itself (SIGKILL) at a chosen moment of a step, to exercise recovery from
exactly there — inside forward, inside backward while gradients are being reduced, after its own optimizer
update, as a checkpoint save starts, or during the regroup that follows a first fault. The `network` drill
kills nothing: the rank's collective fails as a dropped connection would make it, every process lives on.

The drill is armed from `resilience.drill` in the training config and fires at most once, only in a process
that started in the job's first generation (a replacement redoing the same step does not die again).

It can also be armed from the `PHALANX_DRILL` environment variable (JSON: `rank`, `step`, `at`, and
`action`: `kill` (the default), `slow` or `straggle` with `seconds`), which a job's env reaches on every rank
(restart-mode workers install only `straggle`). `slow` kills nothing: the rank announces itself in its log
(`=== phalanx drill: slow ... ===`) and sleeps there — a rank that is slow but alive, or a hold that lets
`phalanx chaos` land an outside fault (a node killed, a health check failed, the controller restarted)
exactly inside that moment. `straggle` makes the rank a straggler: from step `step` on, every step computes
`seconds` more (CPU busy work at the step's first `at` moment, as a slower device would: it shows in the
rank's compute time while its peers only wait on it), until the process ends (a replacement of the first
generation's process is not slow: the node was).

Knows the trainer only as "has `model.model.layers`, `optimizer`, `progress` and `callbacks`"; nothing about
recovery, generations or the controller. Imports no training code (the CLI's chaos commands import it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger("phalanx.drill")
ENV_VAR = "PHALANX_DRILL"
MOMENTS = ("forward", "backward", "optimizer", "checkpoint", "regroup", "network")
ACTIONS = ("kill", "slow", "straggle")


@dataclass(frozen=True)
class DrillSpec:
    """What `PHALANX_DRILL` arms (the config's `resilience.drill` has the same `rank`, `step`, `at`)."""

    rank: int
    step: int = 1
    at: str = "forward"
    action: str = "kill"
    seconds: float = 0.0

    def __post_init__(self):
        if self.at not in MOMENTS or self.action not in ACTIONS or self.rank < 0 or self.step < 1 \
                or self.seconds < 0:
            raise ValueError(f"{ENV_VAR}: not a drill: {self}; at is one of {', '.join(MOMENTS)}, action one of "
                             f"{', '.join(ACTIONS)}, rank >= 0, step >= 1, seconds >= 0")

    def to_env(self) -> str:
        return json.dumps({"rank": self.rank, "step": self.step, "at": self.at, "action": self.action,
                           "seconds": self.seconds})


def spec_from_env(env: Mapping[str, str]) -> DrillSpec | None:
    text = env.get(ENV_VAR)
    return DrillSpec(**json.loads(text)) if text else None


def _die(what: str) -> None:
    print(f"=== phalanx drill: SIGKILL {what} ===", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _slow(what: str, seconds: float) -> None:
    print(f"=== phalanx drill: slow rank: sleeping {seconds:g} s {what} ===", file=sys.stderr, flush=True)
    time.sleep(seconds)


def _burn(seconds: float) -> None:
    """Busy CPU work for `seconds` of this process's CPU time (a sleep would not count as compute)."""
    start = time.process_time()
    while time.process_time() - start < seconds:
        sum(range(1000))


def _fail_collective(what: str) -> None:
    import torch.distributed as dist

    print(f"=== phalanx drill: network failure {what} (the process lives on) ===", file=sys.stderr, flush=True)
    raise dist.DistNetworkError(f"drill: connection dropped {what}")


def _grad_hook(out, fire) -> None:
    tensor = out[0] if isinstance(out, tuple) else out
    if tensor.requires_grad:
        tensor.register_hook(lambda grad: fire())


class _BeforeSave:
    """A trainer callback (`phalanx.train.callbacks`; duck-typed, so that this module imports no training code)."""

    def __init__(self, fire):
        self.fire = fire

    def before_save(self, trainer, step: int) -> None:
        self.fire()


class Drill:
    def __init__(self, spec, rank: int, generation: int, env: Mapping[str, str] | None = None):
        """`spec`: the config's `resilience.drill`; when None, `PHALANX_DRILL` from `env` (os.environ)."""
        if spec is None:
            spec = spec_from_env(os.environ if env is None else env)
        self.spec = spec
        self.action = getattr(spec, "action", "kill")
        self.seconds = getattr(spec, "seconds", 0.0)
        self.armed = spec is not None and generation == 1 and rank == spec.rank
        self._straggled: int | None = None  # the step the straggle drill last slowed

    def install(self, trainer) -> None:
        """Hook the step moments into this generation's trainer (a fresh one per generation): torch's own hooks
        inside forward, backward and the optimizer step (a drill must land *inside* them, between collectives),
        the trainer's `before_save` callback for a checkpoint."""
        if not self.armed or self.spec.at == "regroup":
            return
        at, step = self.spec.at, self.spec.step

        def now() -> bool:  # the step being computed is progress.step + 1; a save happens after it counted
            return trainer.progress.step + (0 if at == "checkpoint" else 1) == step

        def fire(*_args, **_kwargs):
            if self.armed and self.action == "straggle":  # once in every step from `step` on, never disarmed
                current = trainer.progress.step + 1
                if current >= step and current != self._straggled:  # (a step's later micro-batches: done)
                    if self._straggled is None:
                        print(f"=== phalanx drill: straggler: {self.seconds:g} s more compute in every step from "
                              f"step {step} on ===", file=sys.stderr, flush=True)
                    self._straggled = current
                    _burn(self.seconds)
                return
            if self.armed and now():
                self.armed = False
                if self.action == "slow":  # the hook returns None: the inputs and gradients stay as they are
                    _slow(f"during {at} of step {step}", self.seconds)
                    return
                if at == "network":
                    _fail_collective(f"in the forward of step {step}")
                _die(f"during {at} of step {step}")

        blocks = list(trainer.model.model.layers)  # Transformer → DecoderStack (HF naming)
        if at in ("forward", "network"):
            blocks[-1].register_forward_pre_hook(fire)
        elif at == "backward":  # the gradient of the first block's output: later blocks are done and reduced
            blocks[0].register_forward_hook(lambda _m, _i, out: _grad_hook(out, fire))
        elif at == "optimizer":
            trainer.optimizer.register_step_post_hook(fire)
        elif at == "checkpoint":
            trainer.callbacks.add(_BeforeSave(fire))

    def at_regroup(self) -> None:
        """Called by a survivor once it has joined a later generation's process group."""
        if self.armed and self.spec.at == "regroup":
            self.armed = False
            if self.action == "slow":
                _slow("while regrouping", self.seconds)
                return
            _die("while regrouping")
