"""Local launcher: validate a config, then start N worker processes on this machine and watch them.

The config is checked before anything starts (degrees vs world size, batch arithmetic, data files,
vocabulary), so a bad config starts nothing. Workers get the usual torch variables plus PHALANX_CONFIG; they
are forked from one worker template that imported torch once (`forked.py`), or exec'd where it cannot.
If one worker fails, the others are stopped and its exit code is returned. Exit code 2 is a worker refusing
what it found (e.g. a checkpoint written for another model): every rank refuses alike and rank 0 prints the
one-line reason, so the launcher lets them exit on their own (`REFUSAL_GRACE_S`) and adds nothing.
Knows nothing about what a worker does inside (it runs `python -m phalanx.worker`), clusters or recovery.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.train.config import ConfigError, TrainConfig, check_local_paths, dump_config
from phalanx.train.forked import ForkedWorker, Template, TemplateError

BAD_INPUT_EXIT_CODE = 2  # a worker refused its config or checkpoint; it printed why (rank 0)
REFUSAL_GRACE_S = 15.0  # how long the other workers get to refuse too before they are stopped
Worker = subprocess.Popen | ForkedWorker
FORK_ENV = "PHALANX_LAUNCH_FORK"  # "0": every worker exec'd (its own interpreter and imports), no template


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_local_gpus(nproc: int) -> int:
    """On a machine with GPUs each local worker takes cuda:LOCAL_RANK: more workers than GPUs would fail inside
    the workers (an invalid device, or NCCL refusing two ranks on one GPU). Raises ConfigError. Returns the GPUs
    the workers see."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and nproc > gpus:
        raise ConfigError(f"--nproc={nproc} but this machine shows {gpus} GPU{'s' if gpus > 1 else ''}: a worker "
                          f"per GPU; use --nproc {gpus} or fewer, or train on the CPU with CUDA_VISIBLE_DEVICES=")
    return gpus


def preflight(config: TrainConfig, nproc: int) -> None:
    """Every check that needs no process group. Raises ConfigError / DataError / ParallelConfigError."""
    from phalanx.data import TokenDataset
    from phalanx.train.trainer import check_data_fits_model, parallel_dims, resolve_model_config

    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be >= 1")
    check_local_paths(config)
    try:
        config = config.for_world(nproc)  # an elastic job: checked at its starting size
    except ValueError as err:
        raise ConfigError(f"elastic: {err}") from None
    model_config = resolve_model_config(config)
    dims = parallel_dims(config, nproc, model_config)
    config.grad_accum_steps(dims.dp_size)
    check_data_fits_model(TokenDataset(config.data.path, split=config.data.split), model_config)


def worker_env(rank: int, nproc: int, port: int, config_path: Path, threads: int) -> dict:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PHALANX_CONFIG=str(config_path),
        OMP_NUM_THREADS=str(threads),
    )
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def launch(config: TrainConfig, nproc: int, *, threads_per_worker: int | None = None,
           template: Template | None = None) -> int:
    """Run the job to completion on `nproc` local processes. Returns the job's exit code.

    `template`: a worker template the caller started (`Template.start()`) and keeps for many launches (a sweep, a
    test suite): the ranks are forked from it without its import, and it stays open. By default each launch starts
    its own and closes it."""
    own = template is None
    if own:
        template = _template()  # (its import of torch runs beside the checks below, which import torch here too)
    try:
        return _launch(config, nproc, threads_per_worker, template, own)
    finally:
        if own and template is not None:
            template.close()


def _launch(config: TrainConfig, nproc: int, threads_per_worker: int | None, template: Template | None,
            own: bool) -> int:
    preflight(config, nproc)
    if check_local_gpus(nproc) and template is not None:  # (CUDA's fork safety after the imports is not tested)
        if own:
            template.close()
        template = None
    run_dir = Path(config.run_dir)
    config_path = run_dir / "config.json"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(dump_config(config), indent=2))
    except OSError as err:
        raise ConfigError(f"run_dir={str(run_dir)!r}: cannot write {config_path.name} there "
                          f"({err.strerror or err}); choose a writable directory") from None
    threads = threads_per_worker or max(1, (os.cpu_count() or 1) // nproc)
    port = free_port()
    if template is not None:
        try:
            template.wait_ready()
        except TemplateError as err:
            print(f"phalanx train: {err}; starting each worker with its own interpreter", file=sys.stderr)
            template = None
    procs = [_start(template, worker_env(rank, nproc, port, config_path, threads)) for rank in range(nproc)]
    try:
        return _watch(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _template() -> Template | None:
    """The worker template the ranks are forked from (Linux, CPU ranks; `PHALANX_LAUNCH_FORK=0`: none), or None:
    each rank is exec'd and imports torch itself."""
    if sys.platform != "linux" or os.environ.get(FORK_ENV, "1") == "0":
        return None
    try:
        return Template.spawn()
    except TemplateError as err:
        print(f"phalanx train: {err}; starting each worker with its own interpreter", file=sys.stderr)
        return None


def _start(template: Template | None, env: dict) -> Worker:
    argv = [sys.executable, "-m", "phalanx.worker"]
    if template is not None:
        try:
            return template.fork(argv, env, os.getcwd())
        except TemplateError as err:
            print(f"phalanx train: {err}; starting the worker with its own interpreter", file=sys.stderr)
    return subprocess.Popen(argv, env=env)


def _watch(procs: list[Worker]) -> int:
    exits = _ExitWatch(procs)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if code == BAD_INPUT_EXIT_CODE and _all_exit_by_themselves(procs, REFUSAL_GRACE_S):
                    return code  # every worker refused; rank 0 printed the reason
                print(f"worker rank {rank} exited with code {code}; stopping the other workers", file=sys.stderr)
                _stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            exits.wait([p for p, c in zip(procs, codes) if c is None])
    finally:
        exits.close()


class _ExitWatch:
    """Sleep until one of the workers exits: on a pidfd per worker (Linux ≥ 5.3), so the launcher takes no CPU
    from the workers while they train; elsewhere a 0.1 s poll."""

    def __init__(self, procs: list[Worker]):
        self.fds: dict[int, int] = {}
        for p in procs:
            try:
                self.fds[p.pid] = os.pidfd_open(p.pid)
            except (AttributeError, OSError):  # no pidfd here: poll
                self.close()
                return

    def wait(self, running: list[subprocess.Popen]) -> None:
        fds = [self.fds[p.pid] for p in running if p.pid in self.fds]
        if len(fds) == len(running) and fds:
            waiter = select.poll()  # (not select.select: no limit on the fd numbers)
            for fd in fds:
                waiter.register(fd, select.POLLIN)  # readable once that process has exited
            waiter.poll()
        else:
            time.sleep(0.1)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _all_exit_by_themselves(procs: list[Worker], grace_s: float) -> bool:
    """Wait up to `grace_s` for every worker to exit; True if they all did, each with a non-zero code."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return all(p.returncode != 0 for p in procs)


def _stop(procs: list[Worker], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
