"""Entry point of one training worker process: `python -m phalanx.train.worker`.

Reads the seam's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
PHALANX_CONFIG, the resolved config as JSON), initialises torch.distributed (NCCL on GPU, gloo on CPU)
and runs the `Trainer`. Works the same under `phalanx train`, torchrun or a Phalanx node agent.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.train.config import ConfigError, config_from_dict

log = logging.getLogger("phalanx.worker")


def select_device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def run(config_tree: dict) -> int:
    from phalanx.data import DataError
    from phalanx.parallel import ParallelConfigError
    from phalanx.train.trainer import Trainer

    config = config_from_dict(config_tree)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    device, backend = select_device()
    dist.init_process_group(backend, timeout=timedelta(seconds=config.pg_timeout_s))
    try:
        trainer = Trainer(config, device)
        report_progress(trainer)
        trainer.fit()
    except (ConfigError, DataError, ParallelConfigError) as err:
        if dist.get_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def report_progress(trainer) -> None:
    """Under a Phalanx node agent, publish each finished step to the seam's progress key (the agent's hang
    detector reads it); a no-op otherwise. One store write per step, done on a background thread."""
    from phalanx.control.seam import progress_reporter

    reporter = progress_reporter()
    if reporter is None:
        return
    train_step = trainer.train_step

    def train_step_reporting_progress() -> dict:
        reporter.report(trainer.progress.step)  # before the first step: where this run starts (after resume)
        record = train_step()
        reporter.report(record["step"])
        return record

    trainer.train_step = train_step_reporting_progress


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    old_factory = logging.getLogRecordFactory()
    rank = os.environ.get("RANK", "?")

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    path = os.environ.get("PHALANX_CONFIG")
    if not path:
        print("error: PHALANX_CONFIG is not set (path to a resolved training config JSON)", file=sys.stderr)
        return 2
    try:
        with open(path) as f:
            tree = json.load(f)
        return run(tree)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
