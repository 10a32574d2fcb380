"""Fault drills: a worker kills itself (SIGKILL) at a chosen moment of a step, to exercise recovery from
exactly there — inside forward, inside backward while gradients are being reduced, after its own optimizer
update, as a checkpoint save starts, or during the regroup that follows a first fault. The `network` drill
kills nothing: the rank's collective fails as a dropped connection would make it, every process lives on.

The drill is armed from `resilience.drill` in the training config and fires at most once, only in a process
that started in the job's first generation (a replacement redoing the same step does not die again).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger("phalanx.drill")


def _die(what: str) -> None:
    print(f"=== phalanx drill: SIGKILL {what} ===", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_collective(what: str) -> None:
    import torch.distributed as dist

    print(f"=== phalanx drill: network failure {what} (the process lives on) ===", file=sys.stderr, flush=True)
    raise dist.DistNetworkError(f"drill: connection dropped {what}")


def _grad_hook(out, fire) -> None:
    tensor = out[0] if isinstance(out, tuple) else out
    if tensor.requires_grad:
        tensor.register_hook(lambda grad: fire())


class Drill:
    def __init__(self, spec, rank: int, generation: int):
        self.spec = spec
        self.armed = spec is not None and generation == 1 and rank == spec.rank

    def install(self, trainer) -> None:
        """Hook the step moments into this generation's trainer (a fresh one per generation)."""
        if not self.armed or self.spec.at == "regroup":
            return
        at, step = self.spec.at, self.spec.step

        def now() -> bool:  # the step being computed is progress.step + 1; a save happens after it counted
            return trainer.progress.step + (0 if at == "checkpoint" else 1) == step

        def fire(*_args, **_kwargs):
            if self.armed and now():
                self.armed = False
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
            save = trainer.save_checkpoint

            def save_or_die() -> None:
                fire()
                save()

            trainer.save_checkpoint = save_or_die

    def at_regroup(self) -> None:
        """Called by a survivor once it has joined a later generation's process group."""
        if self.armed and self.spec.at == "regroup":
            self.armed = False
            _die("while regrouping")
