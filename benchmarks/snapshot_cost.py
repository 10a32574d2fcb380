"""What one buddy snapshot costs, piece by piece, in CPU time: the figure behind snapshots' throughput ratio.

The throughput ratio (`benchmarks/recovery.py --overhead-runs`) is what a user sees, but on 2 shared cores its
run-to-run spread (±8 %) is larger than the cost. This measures the cost directly, on the same job (the tiny
recipe, fp32, FSDP over 4 ranks, gloo on CPU, 4 processes on this machine):

  capture_cpu_ms    `ShardState.capture`: this rank's shards into host memory (on the training step's path)
  seal_cpu_ms       the checksum taken before the copy leaves (in the exchange thread)
  exchange_cpu_ms   sending the copy to the buddy, receiving the ward's, and the agreement all_reduce, as the
                    snapshot thread does them (process CPU, all threads: gloo's included)
  verify_cpu_ms     checking a received copy's checksum (at arrival or when used, as the code does)
  step_cpu_ms       one training step (its process CPU), for scale
  per_step_share    (capture + seal + exchange + the arrival check where there is one) ÷ step: the CPU a snapshot
                    every step adds
  snapshot_cpu_ms   a whole snapshot as training takes it, through the production class (`BuddySnapshots`:
                    `after_step()` then `wait()`, the step counter moved on between them, no training between):
                    process CPU, all threads. The pieces above call `exchange()`, the two-round transfer that a
                    snapshot now uses only for a generation's first exchange (or a changed layout); this figure
                    follows whatever the version's snapshots do.

Medians over `--iterations` snapshots per rank; rank 0's figures (the others are printed). Runs on any
version of `phalanx.resilience` (so a before/after pair is `PYTHONPATH=<tree>/src` on two trees).

Interleaved (`--blocks N`, after the pieces): what a user sees, without the drift between runs that swamps it on
2 shared cores (separate runs with and without snapshots differ by ±5–8 %, `benchmarks/recovery.py
--overhead-runs`). In the same 4 processes the trainer's whole step (`advance()`) runs in blocks of
`--block-steps`, alternately with `BuddySnapshots.after_step()` (the production class: capture, then the
exchange thread) and without, the order flipping each pair (on off, off on, ...); an "on" block ends by waiting
for its last exchange, so no cost spills into the next block. For each interval in `--intervals`:
  interleaved_ratio_every_K   median over block pairs of (off block seconds ÷ on block seconds): the tokens/s
                              with a snapshot every K steps as a fraction of the tokens/s without

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_cost.py
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, median, write_results  # noqa: E402

WORLD = 4


def _interleaved(trainer, blocks: int, block_steps: int, intervals: list[int]) -> dict:
    """Per interval, the seconds of each block with and without buddy snapshots (see the module docstring)."""
    from phalanx.resilience.snapshots import BuddySnapshots, SnapshotShelf

    out = {}
    for interval in intervals:
        snapshots = BuddySnapshots(trainer, SnapshotShelf(), interval=interval, workers_per_node=1)
        seconds: dict[str, list[float]] = {"on": [], "off": [], "cpu_on": [], "cpu_off": []}
        for pair in range(blocks):
            for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(block_steps):
                    trainer.advance()
                    if mode == "on":
                        snapshots.after_step()
                snapshots.wait()
                seconds[mode].append(time.perf_counter() - start)
                seconds[f"cpu_{mode}"].append(time.process_time() - cpu)
        snapshots.release()
        out[f"every_{interval}"] = seconds
    return out


def _whole_snapshots(trainer, iterations: int) -> float:
    """Median process CPU of one snapshot through `BuddySnapshots` (see `snapshot_cpu_ms` above), in seconds."""
    import torch.distributed as dist

    from phalanx.resilience.snapshots import BuddySnapshots, SnapshotShelf

    snapshots = BuddySnapshots(trainer, SnapshotShelf(), interval=1, workers_per_node=1)
    step, cpu = trainer.progress.step, []
    for _ in range(iterations + 5):
        trainer.progress.step += 1
        dist.barrier()
        c = time.process_time()
        snapshots.after_step()
        snapshots.wait()
        cpu.append(time.process_time() - c)
    snapshots.release()
    trainer.progress.step = step
    return median(cpu[5:])


def _rank_main(rank: int, port: int, data: str, run_dir: str, iterations: int, out_dir: str,
               blocks: int = 0, block_steps: int = 10, intervals: tuple = (1, 10)) -> None:
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from phalanx.resilience import restore
    from phalanx.resilience.restore import ShardState, exchange
    from phalanx.train.config import config_from_dict
    from phalanx.train.trainer import Trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    config = config_from_dict({
        "run_dir": run_dir, "seed": 7, "precision": "fp32", "parallel": {"dp_replicate": 1, "dp_shard": WORLD},
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512}}, "data": {"path": data},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 1000, "log_interval": 1000},
        "optimizer": {"lr": 1e-3}, "checkpoint": {"interval": 0, "resume": False},
    })
    trainer = Trainer(config, torch.device("cpu"))
    step_cpu = []
    for i in range(5 + iterations // 4):
        c = time.process_time()
        trainer.train_step()
        if i >= 5:
            step_cpu.append(time.process_time() - c)
    # as the snapshot thread calls it: received copies are checked on arrival where the version does so
    lazy = "verify" in inspect.signature(exchange).parameters
    kwargs = {"verify": False} if lazy else {}
    buddy, ward = (rank + 1) % WORLD, (rank - 1) % WORLD
    group = dist.new_group(backend="gloo")
    figures: dict[str, list[float]] = {"capture": [], "seal": [], "exchange": [], "verify": []}
    # buffers as buddy snapshots get them, where the version reuses them (a dropped copy's for the next one)
    # and the capture plan kept between snapshots, where the version has one
    reuse = "buffer" in inspect.signature(ShardState.capture).parameters
    spare: list = []
    take = (lambda n, pinned: spare.pop() if spare else torch.empty(n, dtype=torch.uint8)) if reuse else None
    plan_of = getattr(restore, "CapturePlan", None)
    plan = None
    for _ in range(iterations + 3):
        c = time.thread_time()
        if plan_of is not None:
            plan = plan_of.of(trainer, plan)
        state = ShardState.capture(trainer, **({"buffer": take} if reuse else {}),
                                   **({"plan": plan} if plan is not None else {}))
        capture = time.thread_time() - c
        c = time.thread_time()
        state.seal()
        seal = time.thread_time() - c
        dist.barrier()
        c = time.process_time()
        got = exchange([(buddy, state)], [ward], group=group, **kwargs, **({"buffer": take} if reuse else {}))
        dist.all_reduce(torch.ones(1), group=group)
        exchanged = time.process_time() - c
        copy = got[ward]
        if lazy:
            copy.verified = False
        c = time.thread_time()
        copy.verify()
        verify = time.thread_time() - c
        for k, v in zip(figures, (capture, seal, exchanged, verify)):
            figures[k].append(v)
        if reuse:
            spare[:] = [state.data, copy.data]
    result = {f"{k}_cpu_ms": median(v[3:]) * 1e3 for k, v in figures.items()}
    result["snapshot_cpu_ms"] = _whole_snapshots(trainer, iterations) * 1e3
    result["step_cpu_ms"] = median(step_cpu) * 1e3
    result["checked_on_arrival"] = not lazy
    # an arrival check is inside `exchange` (already in exchange_cpu_ms) where the version checks on arrival
    result["per_step_share"] = (result["capture_cpu_ms"] + result["seal_cpu_ms"] + result["exchange_cpu_ms"]
                                ) / result["step_cpu_ms"]
    result["bytes"] = state.nbytes
    result["tensors"] = len(state.entries)
    result["module"] = str(Path(restore.__file__).resolve())
    if blocks:
        for _ in range(block_steps):  # warm-up: the trainer's first steps since the pieces above
            trainer.advance()
        result["interleaved"] = _interleaved(trainer, blocks, block_steps, list(intervals))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # skip interpreter teardown (gloo's destructors)


def main() -> None:
    import torch.multiprocessing as mp

    from phalanx.data import prepare, write_demo_corpus

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=0, help="interleaved block pairs per interval (0: none)")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--intervals", default="1,10", help="snapshot intervals the interleaved blocks measure")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "snapshot_cost.json")
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    root = Path(tempfile.mkdtemp(prefix="phalanx-snapshot-cost-"))
    corpus = write_demo_corpus(root / "corpus.jsonl")
    prepare([corpus], root / "tokens", block_size=64, vocab_size=512, val_percent=0.0, progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = root / "out"
    out_dir.mkdir()
    intervals = tuple(int(k) for k in args.intervals.split(","))
    mp.spawn(_rank_main, args=(port, str(root / "tokens"), str(root / "run"), args.iterations, str(out_dir),
                               args.blocks, args.block_steps, intervals), nprocs=WORLD, join=True)
    import json

    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, res in enumerate(ranks):
        print(f"rank {r}: " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in res.items() if k not in ("module", "interleaved")))
    summary = {k: round(v, 4) for k, v in ranks[0].items() if isinstance(v, float)}
    for name, seconds in ranks[0].get("interleaved", {}).items():
        pairs = [off / on for on, off in zip(seconds["on"], seconds["off"])]
        summary[f"interleaved_ratio_{name}"] = round(median(pairs), 4)
        summary[f"interleaved_total_ratio_{name}"] = round(sum(seconds["off"]) / sum(seconds["on"]), 4)
        print(f"snapshot {name.replace('_', ' ')}: tokens/s with ÷ without {median(pairs):.4f} "
              f"(median of {len(pairs)} block pairs, {min(pairs):.3f}–{max(pairs):.3f}; totals "
              f"{summary[f'interleaved_total_ratio_{name}']:.4f})")
        if "cpu_on" in seconds:  # the CPU (all 4 processes, all threads) a block's snapshots add
            on, off = ([sum(r["interleaved"][name][key][i] for r in ranks) for i in range(len(pairs))]
                       for key in ("cpu_on", "cpu_off"))
            added = [a / b - 1 for a, b in zip(on, off)]
            summary[f"interleaved_cpu_added_{name}"] = round(median(added), 4)
            print(f"  CPU of the 4 processes with ÷ without - 1: {median(added):+.4f} (median; "
                  f"{min(added):+.3f} to {max(added):+.3f})")
    path = write_results(args.out, {
        "benchmark": "snapshot_cost",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_cost.py " + " ".join(sys.argv[1:]),
        "config": {"world": WORLD, "layout": "FSDP over 4 ranks", "model": "tiny, vocab 512, fp32",
                   "iterations": args.iterations, "module": ranks[0]["module"], "blocks": args.blocks,
                   "block_steps": args.block_steps, "intervals": list(intervals)},
        "ranks": ranks, "summary": summary,
    })
    print(f"summary: {summary}\nwrote {path}")


if __name__ == "__main__":
    main()
