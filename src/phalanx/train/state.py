"""What a run's training state is, defined once: the model and optimizer (this rank's shards), the LR schedule's
counters, the progress (optimizer steps taken and samples consumed — the data position: the sample order is a
pure function of the seed and that count) and this rank's RNG streams.

`TrainState` is a view over the live objects a `Trainer` owns (nothing is copied). It reads and writes them in
the two forms training state takes:

  checkpoint   `checkpoint_items()`: the state dict DCP saves (sharded, resharded on load);
               `load_checkpoint()`: restore from one. Its keys are the on-disk format (phalanx-dcp-v1):
               "model_optim" (model + optimizer), "train" (step, samples_consumed, world_size, lr_scheduler)
               and "rng/rank<r>" (each saving rank's RNG).
  local        `local_tensors()`: this rank's shard of every parameter and optimizer-state tensor, by key;
               `counters()`: everything else; `load_local()` writes both back into a trainer built on the same
               shard layout (`phalanx.resilience.restore.ShardState` packs them into host memory for a peer).

Knows nothing about where state is kept (files, peers' memory), the training loop, the controller or recovery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5 layout
    from torch.distributed._tensor import DTensor


@dataclass
class Progress:
    """Where the run is: the optimizer steps taken and the samples consumed (one integer each)."""

    step: int = 0
    samples_consumed: int = 0


class ModelOptimState(Stateful):
    """Model + optimizer as one DCP item (sharded, reshardable)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def load_state_dict(self, state):
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=True))
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a view: writes reach the parameter). For a DTensor, its local tensor as
    `to_local()` returns it, read directly: `to_local()` runs an autograd function, ~15 µs a call, and buddy
    snapshots take every parameter and optimizer-state tensor each step."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if local is not None else t.to_local()
    return t


@dataclass
class TrainState:
    """The training state of one rank, as references to the trainer's live objects."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    progress: Progress
    # The sharded parameters by name, captured while the model is sharded (FSDP swaps in unsharded tensors
    # during forward/backward; the optimizer keeps these same objects).
    sharded_params: dict[str, nn.Parameter]

    # ---- the pieces that are not tensors --------------------------------------------------------------------
    def scheduler_counters(self) -> dict:
        """The LR scheduler's counters; its lambdas are code, not state."""
        counters = self.scheduler.state_dict()
        counters.pop("lr_lambdas", None)
        return counters

    def restore(self, step: int, samples_consumed: int, scheduler: dict) -> None:
        """Set the progress (in place: whoever holds the trainer's `progress` sees it) and the schedule's counters
        (keeping our lambdas)."""
        self.progress.step, self.progress.samples_consumed = step, samples_consumed
        lambdas = [None] * len(self.scheduler.lr_lambdas)
        self.scheduler.load_state_dict({**scheduler, "lr_lambdas": lambdas})

    # ---- as a checkpoint (DCP) ------------------------------------------------------------------------------
    def checkpoint_items(self, rank: int, world_size: int) -> dict:
        """The state dict DCP saves: model and optimizer sharded, the counters, this rank's RNG."""
        return {
            "model_optim": ModelOptimState(self.model, self.optimizer),
            "train": {
                "step": self.progress.step,
                "samples_consumed": self.progress.samples_consumed,
                "world_size": world_size,
                "lr_scheduler": self.scheduler_counters(),
            },
            f"rng/rank{rank}": rng_state(),
        }

    def load_checkpoint(self, load: Callable[[dict], None], rank: int, world_size: int) -> int:
        """Restore from a checkpoint: `load(items)` fills a state dict in place from it (collective: every rank
        calls this). Returns the world size of the run that saved it; the RNG is restored only when that is
        this world size (per-rank RNG streams exist only for the ranks the saving run had)."""
        items = self.checkpoint_items(rank, world_size)
        probe = {"train": dict(items["train"])}  # the world size first
        load(probe)
        saved_world = probe["train"]["world_size"]
        rng_key = f"rng/rank{rank}"
        if saved_world != world_size:
            items.pop(rng_key)
        load(items)
        train = items["train"]
        self.restore(train["step"], train["samples_consumed"], train["lr_scheduler"])
        if rng_key in items:
            set_rng_state(items[rng_key])
        return saved_world

    # ---- as this rank's local shards (peer restore) ---------------------------------------------------------
    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's shard of every parameter ("param/<name>") and optimizer-state tensor
        ("optim/<name>/<state key>"), detached, in a fixed order. Valid at any step boundary, and after a fault
        mid-step: the sharded tensors are only written by the optimizer step, which completes or never starts."""
        tensors = []
        for name, p in self.sharded_params.items():
            tensors.append((f"param/{name}", _local(p).detach()))
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append((f"optim/{name}/{key}", _local(value).detach()))
        return tensors

    def local_key(self) -> tuple:
        """What `local_tensors` lists, as (storage address, dtype, shape) in the same order, read without making a
        tensor or a name (`local_tensors` detaches 156 tensors of the tiny model: ~0.5 ms). Buddy snapshots
        compare it each snapshot to keep their capture plan while the tensors stay where they were."""
        key = []
        for p in self.sharded_params.values():
            t = _local(p)
            key.append((t.data_ptr(), t.dtype, t.shape))
            for name, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    value = _local(value)
                    key.append((name, value.data_ptr(), value.dtype, value.shape))
        return tuple(key)

    def local_param_layout(self) -> dict[str, tuple[str, tuple]]:
        """{"param/<name>": (dtype, local shape)}: what `load_local` needs to find for every parameter."""
        return {f"param/{name}": (str(p.dtype), tuple(_local(p).shape)) for name, p in self.sharded_params.items()}

    def counters(self) -> dict:
        """Everything but the tensors and the progress: the schedule's counters, the optimizer's hyperparameters
        (the scheduled lr lives there) and this rank's RNG."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"scheduler": self.scheduler_counters(), "param_groups": groups, "rng": rng_state()}

    def load_local(self, tensors: dict[str, torch.Tensor], counters: dict, step: int, samples_consumed: int) -> None:
        """Write what `local_tensors` and `counters` gave (on a rank of the same shard layout: the caller checks
        that `tensors` holds every key of `local_param_layout`, with those dtypes and shapes)."""
        with torch.no_grad():
            for name, p in self.sharded_params.items():
                _local(p).copy_(tensors[f"param/{name}"])
            self.optimizer.state.clear()
            for name, p in self.sharded_params.items():
                prefix, state = f"optim/{name}/", {}
                for key, t in tensors.items():
                    if not key.startswith(prefix):
                        continue
                    value = t.clone().to(_local(p).device if t.shape else "cpu")
                    if isinstance(p, DTensor) and tuple(t.shape) == tuple(_local(p).shape):
                        value = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape,
                                                   stride=p.stride(), run_check=False)
                    state[key[len(prefix):]] = value
                if state:
                    self.optimizer.state[p] = state
        for group, saved in zip(self.optimizer.param_groups, counters["param_groups"], strict=True):
            group.update(saved)  # the scheduled lr lives here
        self.restore(step, samples_consumed, counters["scheduler"])
        set_rng_state(counters["rng"])
