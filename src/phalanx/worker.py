"""Entry point of one training worker process: `python -m phalanx.worker` (`python -m phalanx.train.worker`,
the name the protocol still gives, hands over to it).

Reads the seam's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
PHALANX_CONFIG: a YAML recipe, or the resolved config JSON that `phalanx train` and the control plane pass;
`key.sub=value` overrides from PHALANX_OVERRIDES and the command line, resolved like `phalanx train`) and
picks how the process trains: under an agent with PHALANX_RECOVERY=checkpointless, `phalanx.resilience.run`
(it survives its peers' failures and regroups on the controller's store, generation after generation);
otherwise `phalanx.train.worker.run_restart` (NCCL on GPU, gloo on CPU; a failure ends the process and a
restart resumes from the newest checkpoint). Works the same under `phalanx train`, torchrun, srun or a
Phalanx node agent. A config that cannot run: one `error:` line, exit 2. `--standby` starts a warm spare's
worker: torch imported and warmed up, waiting for the rank it must become.

The one module that knows both modes: `phalanx.train` never imports `phalanx.resilience`. Knows nothing about
the controller beyond `phalanx.protocol`.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

import torch

from phalanx import protocol
from phalanx.process import exit_without_teardown
from phalanx.train.config import ConfigError, TrainConfig, config_from_dict
from phalanx.train.worker import resolve_config, run_restart, select_device

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


def wait_as_standby() -> None:
    """`--standby`: a warm spare's worker. Import what training needs now, then wait for the rank this
    process must become (the controller writes its env to `protocol.standby_key`); adopt that env and its log
    file, and return to run as that rank."""
    import time

    import phalanx.train.trainer  # noqa: F401 - imported now, not after adoption
    from phalanx.resilience.groups import warm_up

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
    store = None
    while True:
        try:
            store = store or protocol.connect_store(os.environ[protocol.STORE_ADDR], token, timedelta(seconds=10))
            if store.check([key]):
                raw = store.get(key)
                store.delete_key(key)
                try:  # signed by the controller for this standby; anyone reaching the store could write the key
                    assignment = protocol.open_standby_assignment(token, os.environ[protocol.STANDBY_ID], raw)
                    break
                except ValueError as err:
                    log.warning("ignored an assignment on %s (%s); still waiting", key, err)
        except (RuntimeError, OSError):  # the controller restarts; its store comes back on the same port
            store = None
            time.sleep(0.5)
        time.sleep(0.01)
    os.environ.update(assignment["env"])
    os.environ[protocol.ACTIVATED_AT] = repr(time.time())
    log_fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    print(f"=== phalanx: warm standby activated as rank {os.environ[protocol.RANK]} ===", flush=True)


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
