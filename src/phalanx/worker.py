"""Entry point of one training worker process, `python -m phalanx.worker` (what agents run,
`protocol.TRAIN_WORKER_MODULE`; the former name `python -m phalanx.train.worker` hands over to it), and restart
mode whole.

Reads the seam's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
PHALANX_CONFIG: a YAML recipe, or the resolved config JSON that `phalanx train` and the control plane pass;
`key.sub=value` overrides from PHALANX_OVERRIDES and the command line, resolved like `phalanx train`) and
picks how the process trains: under an agent with PHALANX_RECOVERY=checkpointless, `phalanx.resilience.run`
(it survives its peers' failures and regroups on the controller's store, generation after generation);
otherwise restart mode, here: `run_restart` builds the `Trainer` on the default process group from the env
(NCCL on GPU, gloo on CPU) and trains to the end; a failure ends the process, and a restart resumes from the
newest checkpoint. Under a node agent every step is published to the seam's progress key by a trainer callback
(`ReportProgress`: the agent's hang rule reads it). Works the same under `phalanx train`, torchrun, srun or a
Phalanx node agent. A config that cannot run: one `error:` line, exit 2. `--standby` starts a warm spare's
worker: torch imported and warmed up, waiting for the rank it must become.

The one module that knows both modes: `phalanx.train` never imports `phalanx.resilience`, and neither imports
this module. Knows nothing about the controller beyond `phalanx.protocol`, or about how checkpointless recovery
works inside `phalanx.resilience.run`.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx import protocol
from phalanx.process import exit_without_teardown
from phalanx.train.callbacks import Callback
from phalanx.train.config import ConfigError, TrainConfig, config_from_dict, load_config

log = logging.getLogger("phalanx.worker")


def run(config_tree: dict | TrainConfig) -> int:
    """Train with `config_tree` in the mode the environment asks for. Returns the exit code."""
    from phalanx.data import DataError
    from phalanx.parallel import ParallelConfigError

    config = config_tree if isinstance(config_tree, TrainConfig) else config_from_dict(config_tree)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    device, backend = select_device()
    if os.environ.get(protocol.RECOVERY) == protocol.CHECKPOINTLESS and os.environ.get(protocol.STORE_ADDR):
        from phalanx.resilience.run import run_checkpointless

        try:
            return run_checkpointless(config, device, backend)
        except (ConfigError, DataError, ParallelConfigError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return 2
    if config.resilience.recovery == protocol.CHECKPOINTLESS:
        log.warning("resilience.recovery=checkpointless needs a Phalanx cluster (phalanx job submit); without "
                    "one a failure ends the run and a restart resumes from the newest checkpoint")
    return run_restart(config, device, backend)


# ---- restart mode ------------------------------------------------------------------------------------------
def run_restart(config: TrainConfig, device: torch.device, backend: str) -> int:
    """Restart mode: the default process group from the env, the `Trainer` to the end. A failure ends the
    process (the launcher or the controller restarts the job, which resumes from the newest checkpoint).
    Returns the exit code: 2 for a config or data that cannot run (said in one `error:` line by rank 0)."""
    from phalanx.data import DataError
    from phalanx.parallel import ParallelConfigError
    from phalanx.resilience.drill import Drill, spec_from_env
    from phalanx.train.trainer import Trainer

    init_process_group(backend, timedelta(seconds=config.pg_timeout_s))
    try:
        trainer = Trainer(config, device)
        reporter = report_progress(trainer)
        drill = spec_from_env(os.environ)  # restart mode installs only the straggler drill (`PHALANX_DRILL`); the
        if drill is not None and drill.action == "straggle":  # chaos soak's kill/slow drills are checkpointless-only
            Drill(drill, dist.get_rank(), int(os.environ.get(protocol.GENERATION, "1"))).install(trainer)
        trainer.fit()
        if reporter is not None:  # the controller learns the last step before this process exits (also when
            reporter.report(trainer.progress.step)  # it resumed at the last step and trained none)
            reporter.flush(protocol.EXIT_FLUSH_S)
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
    finished step with its compute seconds (`ProgressReporter.report`: the store write happens on a background
    thread)."""

    def __init__(self, reporter):
        self.reporter = reporter

    def on_step_start(self, trainer, step: int) -> None:
        self.reporter.report(step)

    def on_step_end(self, trainer, record: dict) -> None:
        self.reporter.report(record["step"], record.get("compute_time_s"))


def report_progress(trainer):
    """Under a Phalanx node agent, publish each finished step to the seam's progress key (the agent's hang
    detector reads it), take the controller's checkpoint requests, and return the reporter; None otherwise."""
    reporter = protocol.progress_reporter()
    if reporter is None:
        return None
    trainer.callbacks.add(ReportProgress(reporter))
    trainer.checkpoint_requests = reporter
    return reporter


# ---- what every worker needs from its environment: the device and the config -------------------------------
def select_device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


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


# ---- a warm spare's worker ---------------------------------------------------------------------------------
STANDBY_WAIT = timedelta(seconds=30)  # one blocking wait for an assignment; then the store is checked and again


def store_alive(store, key: str) -> bool:
    """The controller's store still answers (and still holds `key`: a restarted controller's store is empty)."""
    try:
        return bool(store.check([key]))
    except (RuntimeError, OSError):
        return False


def wait_as_standby() -> None:
    """`--standby`: a warm spare's worker. Import what training needs now, then wait for the rank this
    process must become (the controller writes its env to `protocol.standby_key`); adopt that env and its log
    file, and return to run as that rank."""
    import time

    import phalanx.train.trainer  # noqa: F401 - imported now, not after adoption
    import torch.utils.tensorboard  # noqa: F401 - rank 0's TensorBoard writer, should this spare become rank 0
    from phalanx.resilience.groups import warm_up
    from phalanx.zygote import BASE_POLICY_ENV, restore_priority

    started = time.perf_counter()
    try:
        warm_up(select_device()[0])
    except Exception as err:  # noqa: BLE001 - a warm-up failure only costs speed
        log.warning("standby warm-up failed (%s: %s); the first step after adoption will be slower",
                    type(err).__name__, err)

    token = os.environ.get(protocol.CLUSTER_TOKEN, "")
    key = protocol.standby_key(os.environ[protocol.STANDBY_ID])
    print(f"standby for {key}: warm (torch {torch.__version__}, warm-up {time.perf_counter() - started:.2f} s), "
          "waiting", flush=True)
    store, warm = None, protocol.standby_warm_key(os.environ[protocol.STANDBY_ID])
    while True:
        try:
            if store is None:
                store = protocol.connect_store(os.environ[protocol.STORE_ADDR], token, timedelta(seconds=10))
                store.set(warm, "1")  # (again after a controller restart: its store starts empty)
            # Blocks until the controller writes the key (the store wakes its waiters): no polling, so idle
            # standbys cost the controller's store nothing however many spares there are.
            store.wait([key], STANDBY_WAIT)
            raw = store.get(key)
            store.delete_key(key)
            store.delete_key(warm)
            try:  # signed by the controller for this standby; anyone reaching the store could write the key
                assignment = protocol.open_standby_assignment(token, os.environ[protocol.STANDBY_ID], raw)
                break
            except ValueError as err:
                log.warning("ignored an assignment on %s (%s); still waiting", key, err)
        except (RuntimeError, OSError) as err:
            if "timeout" in str(err).lower() and store is not None and store_alive(store, warm):
                continue  # nothing assigned within STANDBY_WAIT: wait again
            store = None  # the controller restarts; its store comes back on the same port
            time.sleep(0.5)
    base_policy = os.environ.pop(BASE_POLICY_ENV, None)
    if base_policy is not None:  # warmed up under its template's SCHED_IDLE (`phalanx.zygote`); a worker now
        restore_priority(int(base_policy))
    os.environ.update(assignment["env"])
    os.environ[protocol.ACTIVATED_AT] = repr(time.time())
    log_fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    print(f"=== phalanx: warm standby activated as rank {os.environ[protocol.RANK]} (scheduling policy "
          f"{os.sched_getscheduler(0)}) ===", flush=True)


def main() -> int:
    if "--standby" in sys.argv[1:]:
        wait_as_standby()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    old_factory = logging.getLogRecordFactory()
    rank = os.environ.get("RANK", "?")

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    try:
        config = resolve_config(sys.argv[1:], os.environ)
        return run(config)
    except ConfigError as err:  # before the process group: every rank says it (they may log apart)
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


def entry() -> None:
    """Run `main` and leave with its exit code, without interpreter teardown (see phalanx.process)."""
    try:
        code = main()
    except SystemExit as err:
        code = 0 if err.code is None else err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed, then the process exits non-zero: an application error
        import traceback

        traceback.print_exc()
        code = 1
    exit_without_teardown(code)  # teardown can abort a finished run


if __name__ == "__main__":
    entry()
