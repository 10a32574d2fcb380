"""Restart-mode training in one worker process, and what every worker needs from its environment: the
device, the config (resolved like `phalanx train`), the default process group from the env, progress reports
to a node agent through the trainer's callbacks.

`run_restart` builds the `Trainer` and trains to the end; a failure ends the process, and a restart resumes
from the newest checkpoint. The process entry point, which picks this mode or checkpointless recovery, is
`phalanx.worker`; `python -m phalanx.train.worker` (the module name agents still run) hands over to it.
Knows nothing about checkpointless recovery (`phalanx.resilience`) or the controller beyond `phalanx.protocol`.
"""

from __future__ import annotations

import os
import shlex
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx import protocol
from phalanx.train.callbacks import Callback
from phalanx.train.config import ConfigError, TrainConfig, load_config

FLUSH_S = 5.0  # at most this long, at exit, for the store to take the last step (a restarting controller)


def select_device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def run_restart(config: TrainConfig, device: torch.device, backend: str) -> int:
    """Restart mode: the default process group from the env, the `Trainer` to the end. A failure ends the
    process (the launcher or the controller restarts the job, which resumes from the newest checkpoint).
    Returns the exit code: 2 for a config or data that cannot run (said in one `error:` line by rank 0)."""
    from phalanx.data import DataError
    from phalanx.parallel import ParallelConfigError
    from phalanx.train.trainer import Trainer

    init_process_group(backend, timedelta(seconds=config.pg_timeout_s))
    try:
        trainer = Trainer(config, device)
        reporter = report_progress(trainer)
        trainer.fit()
        if reporter is not None:  # the controller learns the last step before this process exits (also when
            reporter.report(trainer.progress.step)  # it resumed at the last step and trained none)
            reporter.flush(FLUSH_S)
    except (ConfigError, DataError, ParallelConfigError) as err:
        if dist.get_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def init_process_group(backend: str, timeout: timedelta) -> None:
    """The default group from the env (torchrun, `phalanx train`). Under torchrun restarts, on the agent's
    store, each attempt gets its own key prefix: the store outlives the attempt, and torch (2.13) no longer
    prefixes it per attempt, so restarted ranks would read the dead attempt's gloo addresses and fail with
    "connection refused". Under a node agent (and `phalanx train`), rank 0 serves the rendezvous on
    MASTER_ADDR only, keys under the cluster's namespace (`protocol.env_rendezvous_store`): env://'s rank 0
    would listen on every interface."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = None if agent_store else protocol.env_rendezvous_store(os.environ, timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        return
    if not agent_store or attempt == "0":
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"phalanx/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


class ReportProgress(Callback):
    """Publish the step before each step (before the first: where this run starts, after a resume) and each
    finished step (`ProgressReporter.report`: the store write happens on a background thread)."""

    def __init__(self, reporter):
        self.reporter = reporter

    def on_step_start(self, trainer, step: int) -> None:
        self.reporter.report(step)

    def on_step_end(self, trainer, record: dict) -> None:
        self.reporter.report(record["step"])


def report_progress(trainer):
    """Under a Phalanx node agent, publish each finished step to the seam's progress key (the agent's hang
    detector reads it) and return the reporter; None otherwise."""
    from phalanx.protocol import progress_reporter

    reporter = progress_reporter()
    if reporter is None:
        return None
    trainer.callbacks.add(ReportProgress(reporter))
    return reporter


def resolve_config(argv: list[str], environ) -> TrainConfig:
    """The run's config, resolved as `phalanx train` resolves it (`load_config`): PHALANX_CONFIG names a YAML
    recipe or a JSON config (`phalanx train` and the control plane pass the resolved config.json), or, when it
    is unset, the first argument does; `key.sub=value` overrides come from PHALANX_OVERRIDES (shell-quoted,
    space-separated), then from the remaining arguments. Raises ConfigError."""
    args = [a for a in argv if a != "--standby"]
    path = environ.get(protocol.CONFIG)
    if not path and args and "=" not in args[0]:
        path, args = args[0], args[1:]
    if not path:
        raise ConfigError(f"{protocol.CONFIG} is not set; set it to a training recipe (YAML) or config JSON, e.g. "
                          f"{protocol.CONFIG}=recipes/tiny-llama.yaml, or pass the recipe as the first argument")
    try:
        overrides = shlex.split(environ.get("PHALANX_OVERRIDES", ""))
    except ValueError as err:
        raise ConfigError(f"PHALANX_OVERRIDES: {err}; write key.sub=value pairs separated by spaces") from None
    return load_config(path, overrides + args)


if __name__ == "__main__":  # the name agents run (`protocol.TRAIN_WORKER_MODULE`): the entry is phalanx.worker
    from phalanx.worker import entry

    entry()
