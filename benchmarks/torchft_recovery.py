"""torchft 0.2.0 as an outside baseline for `recovery.py`: the same job, the same failure, torchft's own recovery.

The job (as in `recovery.py`'s `job_tree`): the tiny Llama preset, fp32, vocab 512, seed 7 (Phalanx's seeded
init), the bundled demo corpus in 64-token blocks, AdamW (Phalanx's `build_optimizer`: lr 1e-3, betas
0.9/0.95, weight decay 0.1 on matrices) with 10 warmup steps then cosine to 10 %, grad-norm clip 1.0, global
batch 8, micro batch 2, 100 steps. Laid out the way torchft runs data parallelism: 4 replica groups of 1 process
each (pure data parallel: every process holds the whole model; the Phalanx job is HSDP 2 x 2), each group with
its own TCPStore and `torchft.Manager` (`min_replica_size=1`, gloo through `torchft.ProcessGroupGloo`), one
lighthouse process (`torchft._torchft.LighthouseServer`, min_replicas 1). Each step: `torchft.Optimizer`'s
`zero_grad()` starts the quorum, forward/backward, the gradients are averaged over the participating replicas
with `manager.allreduce` (one flat bucket), clipped, and `manager.should_commit()` gates the AdamW step (what
`torchft.Optimizer.step()` does; the LR of the committed step is set in between, so a replica healed from a
peer follows the same schedule). Replica group r trains on slice r of Phalanx's `GlobalBatchSampler` global
batch of step `manager.current_step()` (the samples the 4 data-parallel ranks of the Phalanx job see).
`torchft.DistributedDataParallel` (`--grad-sync ddp`) is not the default: in 0.2.0 its comm hook crashes the
survivors when a peer dies mid-all-reduce (`assert fut._fut` in `ddp._comm_hook`).

The failure (as in `recovery.py`): replica group 1's process is SIGKILLed the moment replica 0 logs step
`--fail-step` (75; the metrics file is polled every 10 ms), and this script starts a fresh replica-1 process at
once (a new Python process that imports torch, like torchrun's restart). The survivors do not stop: the step in
flight is not committed, the lighthouse forms a quorum of the 3 survivors once the dead replica's heartbeat has
timed out, and they train on with a global batch of 6. The replacement joins a later quorum and fetches the
model and optimizer state from a live peer through torchft's checkpoint transport (the Manager's default, HTTP);
it sits out that step (its gradient is zeroed) and contributes from the next.

Two jobs, run interleaved: `job` is the 100-step job above. On this machine its last 25 steps take less time
than the replacement takes to start, so the survivors finish first and the replacement never rejoins (it then
exits instead of training alone from step 0). `rejoin_job` is the same job run for `--rejoin-steps` steps (300;
the LR schedule of the 100-step job, then its final LR), the same failure at step 75, to time the rejoin.

Figures per run (times from the kill, taken just before it is sent), from replica 0's `metrics.jsonl`:
  survivor_stall_s  kill → replica 0's next committed step, minus one normal step (median step gap before)
  first_step_s      kill → replica 0's next committed step
  downtime_s        replica 0's last step before the kill → its next step, minus one normal step (as in
                    recovery.py: wall time lost vs a failure-free run; no step is redone)
  steps_lost        committed steps computed again (last step before the kill − (first step after − 1))
  rejoin_s          the replacement process spawned → its first committed step (torch import included)
  join_stall_s      the survivors' extra stall when the replacement joins (the quorum change, the
                    process-group rebuild and serving it the checkpoint): replica 0's step gap at the
                    replacement's first step, minus one normal step
  reduced_steps     steps replica 0 committed with fewer than 4 replicas (a global batch of 6, not 8)
Each run also checks that replica 0 logged every step once and that the final weights are bit-identical on
every replica that finished (the replacement included when it rejoined).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/torchft_recovery.py --runs 5

torchft is imported from `--torchft-path` (default $TORCHFT_PATH, else /tmp/tftlib), which only the lighthouse
and replica processes put on their PYTHONPATH.
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # a replica's own start, before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPLICAS = 4
GLOBAL_BATCH = 8
MICRO_BATCH = 2
SEED = 7
FIGURES = ("survivor_stall_s", "first_step_s", "downtime_s", "steps_lost", "rejoin_s", "join_stall_s",
           "reduced_steps", "normal_step_s")


# ---- a replica group (one process) -----------------------------------------------------------------------
def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def replica_main(a: argparse.Namespace) -> None:
    import dataclasses
    import hashlib
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torch.nn.utils import clip_grad_norm_

    import torchft
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    imported_at = time.time()
    from recovery import job_tree

    from phalanx.data import GlobalBatchSampler, TokenDataset
    from phalanx.models import Transformer, get_preset
    from phalanx.parallel import materialize, random_init_source
    from phalanx.train.config import config_from_dict
    from phalanx.train.optim import build_optimizer, lr_factor

    torch.set_num_threads(1)
    run_dir, r = Path(a.run_dir), a.replica
    log = run_dir / ("metrics.jsonl" if r == 0 else f"replica-{r}{'-restart' if a.replacement else ''}.jsonl")
    tree = job_tree(run_dir, Path(a.data), a.steps, 50)
    tree["lr_schedule"]["total_steps"] = a.decay_steps  # the longer rejoin job keeps the 100-step schedule
    config = config_from_dict(tree)
    schedule = config.lr_schedule

    # the model, initialised exactly as Phalanx does (seeded, per-parameter), and Phalanx's AdamW
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(get_preset("tiny"), vocab_size=512))
    materialize(model, "cpu", random_init_source(model, SEED))
    optimizer = build_optimizer(model, config)
    model_at = time.time()

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    # this replica group's own store (torchft: one TCPStore per replica group), on a free port
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout_s)),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        replica_id=f"replica_{r}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=a.lighthouse, timeout=timeout, quorum_timeout=timedelta(seconds=a.quorum_timeout_s),
        connect_timeout=timedelta(seconds=10),
    )
    # torchft.DistributedDataParallel (a comm hook calling manager.allreduce per bucket) crashes in 0.2.0 when
    # a peer dies mid-all-reduce (`assert fut._fut` in ddp._comm_hook: _ManagedWork.wait() swallows the gloo
    # error before it sets up the future), so by default the gradients are all-reduced as one flat bucket
    # with manager.allreduce after backward; `--grad-sync ddp` runs the DDP wrapper instead.
    ddp = DistributedDataParallel(manager, model) if a.grad_sync == "ddp" else model
    params = [p for p in model.parameters() if p.requires_grad]
    ft_optimizer = torchft.Optimizer(manager, optimizer)
    dataset = TokenDataset(a.data)
    sampler = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, SEED, dp_rank=r, dp_size=REPLICAS)
    if a.replacement:
        _append(log, {"event": "process", "spawned_at": a.spawned_at, "process_start": _PROCESS_START,
                      "imported_at": imported_at, "model_at": model_at, "ready_at": time.time()})
    else:  # all 4 start together, so the first quorum has all of them (a start-up barrier, not timed)
        (run_dir / f"ready-{r}").touch()
        deadline = time.monotonic() + 300
        while sum((run_dir / f"ready-{i}").exists() for i in range(REPLICAS)) < REPLICAS:
            if time.monotonic() > deadline:
                raise TimeoutError("the other replica groups did not start within 300 s")
            time.sleep(0.01)

    first_commit = True
    while manager.current_step() < a.steps:
        step = manager.current_step()  # a replica that heals this step is moved to the peers' step below
        ft_optimizer.zero_grad()  # starts the quorum (asynchronously)
        tokens = dataset.get_batch(sampler.local_batch(step * GLOBAL_BATCH))
        loss, _ = ddp(tokens, tokens)
        loss.backward()  # with DDP: the gradient all-reduce through manager.allreduce, bucket by bucket
        if a.grad_sync == "allreduce":  # one flat bucket (zeroed by the Manager if not participating)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        loss_avg = loss.detach().clone()
        manager.allreduce(loss_avg).wait()  # the mean loss over the participating replicas
        clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        # torchft.Optimizer.step() is `if manager.should_commit(): optimizer.step()`; the LR of the committed
        # step is set in between (should_commit applies a healing replica's fetched state first)
        if manager.should_commit():
            done = manager.current_step() - 1
            for group in optimizer.param_groups:
                group["lr"] = config.optimizer.lr * lr_factor(
                    done, warmup_steps=schedule.warmup_steps, decay_steps=config.decay_steps,
                    min_lr_ratio=schedule.min_lr_ratio)
            optimizer.step()
            now = time.time()
            if first_commit and a.replacement:
                if done == 0:  # nobody to heal from: the survivors had finished; don't train a new job alone
                    _append(log, {"event": "no_peer_to_rejoin", "time": now})
                    manager.shutdown(wait=False)
                    os._exit(0)
                _append(log, {"event": "resumed", "time": now, "step": done})
            first_commit = False
            _append(log, {"time": now, "step": manager.current_step(), "loss": float(loss_avg),
                          "participants": manager.num_participants(), "quorum_id": manager._quorum_id})
        else:
            _append(log, {"event": "step_not_committed", "time": time.time(), "step": step + 1,
                          "error": str(manager.errored())[:300]})
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().contiguous().numpy().tobytes())
    _append(log if r == 0 else run_dir / f"final-{r}.jsonl",
            {"event": "final", "replica": r, "step": manager.current_step(), "sha256": digest.hexdigest()})
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # don't wait on torchft's server threads at interpreter exit


def lighthouse_main(a: argparse.Namespace) -> None:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=a.join_timeout_ms,
                              quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    out = Path(a.address_file)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(server.address())
    os.replace(tmp, out)
    while True:  # until the benchmark kills this process group
        time.sleep(3600)


# ---- the benchmark (parent) ------------------------------------------------------------------------------
class Job:
    """The lighthouse and the replica processes of one run; each in its own session, all killed in `close`."""

    def __init__(self, run_dir: Path, data: Path, steps: int, args: argparse.Namespace):
        self.run_dir, self.data, self.steps, self.args = run_dir, data, steps, args
        self.env = dict(os.environ)
        self.env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent / "src"),
                                                    str(args.torchft_path)]))
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.lighthouse_addr: str | None = None

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "w")
        self.logs.append(log)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_lighthouse(self) -> None:
        a = self.args
        address_file = self.run_dir / "lighthouse.addr"
        proc = self._spawn(["--role", "lighthouse", "--address-file", str(address_file),
                            "--join-timeout-ms", str(a.join_timeout_ms), "--quorum-tick-ms", str(a.quorum_tick_ms),
                            "--heartbeat-timeout-ms", str(a.heartbeat_timeout_ms)], "lighthouse")
        deadline = time.monotonic() + 60
        while not address_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the lighthouse exited with {proc.returncode}; see {self.run_dir / 'lighthouse.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError("the lighthouse did not start within 60 s")
            time.sleep(0.05)
        self.lighthouse_addr = address_file.read_text().strip()

    def start_replica(self, r: int, replacement: bool = False) -> subprocess.Popen:
        a = self.args
        argv = ["--role", "replica", "--replica", str(r), "--run-dir", str(self.run_dir), "--data", str(self.data),
                "--steps", str(self.steps), "--decay-steps", str(a.steps), "--lighthouse", self.lighthouse_addr, "--timeout-s", str(a.timeout_s),
                "--pg-timeout-s", str(a.pg_timeout_s), "--quorum-timeout-s", str(a.quorum_timeout_s),
                "--grad-sync", a.grad_sync]
        if replacement:
            argv += ["--replacement", "--spawned-at", repr(time.time())]
        return self._spawn(argv, f"replica-{r}{'-restart' if replacement else ''}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        for log in self.logs:
            log.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_once(run_dir: Path, data: Path, steps: int, args: argparse.Namespace) -> dict:
    from recovery import wait_for_step

    from phalanx.train.timeline import normal_step_s

    run_dir.mkdir(parents=True)
    job = Job(run_dir, data, steps, args)
    try:
        job.start_lighthouse()
        replicas = {r: job.start_replica(r) for r in range(REPLICAS)}
        wait_for_step(run_dir / "metrics.jsonl", args.fail_step,
                      lambda: all(p.poll() is None for p in replicas.values()), timeout_s=args.run_timeout_s)
        killed_at = time.time()
        os.kill(replicas[1].pid, signal.SIGKILL)
        spawned_at = time.time()
        replicas[1] = job.start_replica(1, replacement=True)  # the restart: a fresh process, at once
        deadline = time.monotonic() + args.run_timeout_s
        while any(p.poll() is None for p in replicas.values()):
            failed = {r: p.returncode for r, p in replicas.items() if p.poll() not in (None, 0)}
            if failed:
                raise RuntimeError(f"replica process(es) exited with {failed}; see {run_dir}/replica-*.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish within {args.run_timeout_s} s after the kill; see {run_dir}")
            time.sleep(0.05)
        failed = {r: p.returncode for r, p in replicas.items() if p.returncode != 0}
        if failed:
            raise RuntimeError(f"replica process(es) exited with {failed}; see {run_dir}/replica-*.log")
    finally:
        job.close()

    records = read_jsonl(run_dir / "metrics.jsonl")
    steps0 = [s for s in records if "event" not in s]
    if [s["step"] for s in steps0] != list(range(1, steps + 1)):
        raise RuntimeError(f"replica 0 logged steps {[s['step'] for s in steps0]}, not 1..{steps} once each")
    restart = read_jsonl(run_dir / "replica-1-restart.jsonl")
    process = next(e for e in restart if e.get("event") == "process")
    new_steps = [s for s in restart if "event" not in s]
    rejoined = any(e.get("event") == "resumed" for e in restart)
    before = [s for s in steps0 if s["time"] <= killed_at]
    after = [s for s in steps0 if s["time"] > killed_at]
    step_s = normal_step_s(before)
    first_after = after[0]
    out = {
        "survivor_stall_s": first_after["time"] - killed_at - step_s,
        "first_step_s": first_after["time"] - killed_at,
        "downtime_s": first_after["time"] - before[-1]["time"] - step_s,
        "steps_lost": before[-1]["step"] - (first_after["step"] - 1),
        "rejoined": rejoined,
        "rejoin_s": None, "join_stall_s": None, "replacement_first_step": None,
        "reduced_steps": sum(1 for s in after if s["participants"] < REPLICAS),
        "normal_step_s": step_s,
        "last_step": before[-1]["step"],
        "first_step_after": first_after["step"],
        "first_quorum_after": [s["participants"] for s in after[:1]][0],
        "replacement_import_s": process["imported_at"] - process["process_start"],
        "replacement_ready_s": process["ready_at"] - spawned_at,
        "replacement_start_s": process["process_start"] - spawned_at,
        "replacement_model_s": process["model_at"] - process["imported_at"],
        "replacement_manager_s": process["ready_at"] - process["model_at"],
        "survivors_end_s": steps0[-1]["time"] - killed_at,
    }
    # a survivor whose failed step outlasted the first new quorum is healed from a peer too (skips a step)
    survivor_steps = {0: [s["step"] for s in steps0]}
    for r in (2, 3):
        survivor_steps[r] = [s["step"] for s in read_jsonl(run_dir / f"replica-{r}.jsonl") if "event" not in s]
    out["survivors_healed"] = sum(1 for v in survivor_steps.values() if v != list(range(1, len(v) + 1)))
    hashes = {0: next(e["sha256"] for e in records if e.get("event") == "final")}
    for r in (1, 2, 3) if rejoined else (2, 3):
        hashes[r] = next(e["sha256"] for e in read_jsonl(run_dir / f"final-{r}.jsonl") if e.get("event") == "final")
    out["final_weights_match"] = len(set(hashes.values())) == 1
    out["final_weights_compared"] = sorted(hashes)
    if rejoined:
        resumed = next(e for e in restart if e.get("event") == "resumed")
        joined = next(s for s in steps0 if s["step"] == new_steps[0]["step"])  # replica 0's record of that step
        prev = next(s for s in steps0 if s["step"] == joined["step"] - 1)
        out.update(rejoin_s=new_steps[0]["time"] - spawned_at, join_stall_s=joined["time"] - prev["time"] - step_s,
                   replacement_first_step=new_steps[0]["step"], replacement_resumed_step=resumed["step"])
    return out


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each job (interleaved)")
    parser.add_argument("--steps", type=int, default=100, help="the job's steps (as recovery.py)")
    parser.add_argument("--rejoin-steps", type=int, default=300,
                        help="steps of the longer job that measures the rejoin (the 100-step schedule, then its "
                             "final LR); 0: skip it")
    parser.add_argument("--fail-step", type=int, default=75, help="kill replica 1 when replica 0 logs this step")
    parser.add_argument("--torchft-path", type=Path,
                        default=Path(os.environ.get("TORCHFT_PATH", "/tmp/tftlib")),
                        help="a directory holding the torchft package (put on the replicas' PYTHONPATH only)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse: a replica is dead after")
    parser.add_argument("--join-timeout-ms", type=int, default=1000, help="lighthouse: wait for stragglers at most")
    parser.add_argument("--quorum-tick-ms", type=int, default=20, help="lighthouse: quorum check interval")
    parser.add_argument("--timeout-s", type=int, default=30, help="Manager timeout (should_commit, checkpoint fetch)")
    parser.add_argument("--pg-timeout-s", type=int, default=5, help="ProcessGroupGloo timeout (collectives, store)")
    parser.add_argument("--quorum-timeout-s", type=int, default=60, help="Manager quorum timeout")
    parser.add_argument("--grad-sync", choices=("allreduce", "ddp"), default="allreduce",
                        help="allreduce: manager.allreduce on one flat gradient bucket after backward; ddp: "
                             "torchft.DistributedDataParallel (crashes on a peer failure in torchft 0.2.0)")
    parser.add_argument("--run-timeout-s", type=float, default=300)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--out", type=Path, default=None)
    # the child roles
    parser.add_argument("--role", choices=("bench", "replica", "lighthouse"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--decay-steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--address-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "replica":
        return replica_main(args)
    if args.role == "lighthouse":
        return lighthouse_main(args)

    import shutil

    from recovery import job_tree, prepare_data
    from report import RESULTS_DIR, median, merge_summary, summary_of, write_results

    if not (args.torchft_path / "torchft" / "__init__.py").exists():
        sys.exit(f"torchft not found under {args.torchft_path} (--torchft-path or $TORCHFT_PATH)")
    out = args.out or RESULTS_DIR / "recovery_torchft.json"
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    root = Path(tempfile.mkdtemp(prefix="torchft-recovery-"))
    data = prepare_data(root)
    jobs = {"job": args.steps, **({"rejoin_job": args.rejoin_steps} if args.rejoin_steps else {})}
    samples: dict[str, list[dict]] = {name: [] for name in jobs}
    columns = (*FIGURES, "replacement_import_s", "replacement_ready_s", "survivors_healed")
    try:
        for i in range(args.runs):
            for name, steps in jobs.items():
                sample = run_once(root / f"{name}-{i}", data, steps, args)
                samples[name].append(sample)
                print(f"run {i + 1}/{args.runs} {name} ({steps} steps): " + "  ".join(
                    f"{k} {_fmt(sample[k])}" for k in (*columns, "rejoined", "final_weights_match")), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run directories kept in {root}")

    medians = {name: {k: median([s[k] for s in runs if s[k] is not None]) for k in columns}
               for name, runs in samples.items()}
    print(f"\ntorchft, medians of {args.runs} runs (s; steps in steps):")
    print(f"{'':>24} " + " ".join(f"{name + ' (' + str(jobs[name]) + ')':>18}" for name in jobs))
    for k in columns:
        print(f"{k:>24} " + " ".join(f"{_fmt(medians[n][k]) if medians[n][k] is not None else '-':>18}" for n in jobs))
    for name, runs in samples.items():
        print(f"{name}: the replacement rejoined in {sum(s['rejoined'] for s in runs)}/{len(runs)} runs; final "
              f"weights equal on all replicas compared in {sum(s['final_weights_match'] for s in runs)}/{len(runs)}")
    m = medians["job"]
    summary = {"torchft_survivor_stall_s": m["survivor_stall_s"], "torchft_steps_lost": m["steps_lost"],
               "torchft_downtime_s": m["downtime_s"], "torchft_first_step_s": m["first_step_s"],
               "torchft_rejoin_s": m["rejoin_s"], "torchft_join_stall_s": m["join_stall_s"]}
    if "rejoin_job" in medians and m["rejoin_s"] is None:  # the 100-step job ended before the replacement was in
        summary.update(torchft_rejoin_s=medians["rejoin_job"]["rejoin_s"],
                       torchft_join_stall_s=medians["rejoin_job"]["join_stall_s"])
    torchft_version = next((d.name.split("-")[1] for d in args.torchft_path.glob("torchft-*.dist-info")), None)
    tree = job_tree(Path("<run_dir>"), Path("<data>"), args.steps, 50)
    path = write_results(out, {
        "benchmark": "recovery_torchft",
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/torchft_recovery.py "
                   + " ".join(sys.argv[1:]),
        "config": {
            "torchft_version": torchft_version, "replica_groups": REPLICAS, "processes_per_group": 1,
            "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH, "steps": jobs,
            "fail_step": args.fail_step,
            "job": {k: v for k, v in tree.items() if k not in ("parallel", "checkpoint", "run_dir")},
            "parallel": "pure data parallel: 4 replica groups x 1 process (no sharding, no checkpoints)",
            "lighthouse": {"min_replicas": 1, "heartbeat_timeout_ms": args.heartbeat_timeout_ms,
                           "join_timeout_ms": args.join_timeout_ms, "quorum_tick_ms": args.quorum_tick_ms},
            "manager": {"min_replica_size": 1, "use_async_quorum": True, "init_sync": True,
                        "world_size_mode": "DYNAMIC", "timeout_s": args.timeout_s,
                        "quorum_timeout_s": args.quorum_timeout_s, "connect_timeout_s": 10,
                        "heartbeat_interval_ms": 100, "checkpoint_transport": "HTTPTransport (the default)"},
            "process_group": {"class": "torchft.ProcessGroupGloo", "timeout_s": args.pg_timeout_s},
            "grad_sync": ("manager.allreduce of one flat gradient bucket after backward" if args.grad_sync == "allreduce"
                          else "torchft.DistributedDataParallel"),
            "optimizer": "torchft.Optimizer.zero_grad (starts the quorum); manager.should_commit() gates phalanx's "
                         "AdamW step; the LR is set from the committed step number",
        },
        "samples": samples, "medians": medians,
        "summary": {k: (round(v, 4) if v is not None else None) for k, v in summary.items()},
    })
    merge_summary(out.with_name("recovery.json"), summary_of(path, "torchft_"))  # beside Phalanx's figures
    print(f"\nsummary: {json.dumps(summary)}\nwrote {path}")


if __name__ == "__main__":
    main()
