"""One GPU: the trainer's MFU and tokens/s beside a plain FSDP2 loop, its peak memory, and what a buddy snapshot
costs on the step's path when the copy runs on a side stream. Needs a CUDA GPU (CI has none; nothing here is a
test).

One process, world size 1 (NCCL), the `llama-1b` preset (1.2 B parameters: dim 2048, 16 layers, GQA 32/8 heads,
vocab 32000), bf16 compute with fp32 master weights, sequence 2048, global batch `--batch` × 2048 tokens in
micro-batches of `--micro-batch`, no activation checkpointing, AdamW. The tokens are random (a real token file,
`phalanx.data.token_file`): throughput does not depend on them.

  throughput   A Phalanx `Trainer` (its whole per-step path, `advance()`: the step, the record with its host
               syncs, metrics.jsonl, TensorBoard) and `throughput.PlainLoop` (fully_shard per block, the same
               model code and policy, no Phalanx trainer code) built in the same process, stepping in turn
               (A B, B A, ...) after `--warmup` steps each. MFU = tokens/s × FLOPs per token ÷ the device's
               dense bf16 peak (`phalanx.train.mfu`: 6 × matmul parameters + attention, 989.5 TFLOP/s on an
               H100 SXM). `peak_mem_gib`: torch.cuda.max_memory_allocated over the trainer's steps, before the
               plain loop is built.
  snapshots    On the same trainer (its whole local state: 1.2 B fp32 parameters and two AdamW moments,
               ~14.9 GB, about what one rank of Llama-3.1-8B holds under FSDP over 8 GPUs):
                 capture_pageable_s  the capture before 2026-11-27: synchronous copies into pageable memory
                 first_capture_s     the first `ShardState.capture(trainer)` of the process: it pins fresh memory
                 capture_sync_s      later ones: the pinned buffer reused from PyTorch's cache, copies waited for
                 step_ratio_every_N  median step seconds without snapshots ÷ with `ShardState.capture(trainer,
                                     stream=side)` after every Nth step, the next update waiting on the copy's event
                                     as `BuddySnapshots` arranges (blocks of steps alternate with and without).
                 mean_ratio_every_N  the same from the mean step seconds: it counts a step that had to pin a new
                                     host buffer (the summary's `snapshot_step_ratio_every_N` is this one)
               The exchange with the buddy and the checksum run on the host in a thread and need a second GPU's
               rank: not measured here.
  compiled     (`--compile`) the same trainer with `compile: true` (each block compiled in place), timed alone
               after the eager one is gone: its first step (the compile) and its tokens/s and MFU.

    python benchmarks/gpu_mfu.py --compile --out benchmarks/results/gpu_mfu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, median, write_results  # noqa: E402
from throughput import PlainLoop, write_token_file  # noqa: E402

PRESET, SEQ = "llama-1b", 2048


def trainer_config(run_dir: Path, data: Path, args, compile: bool = False) -> dict:
    return {
        "run_dir": str(run_dir), "seed": 7, "precision": "bf16", "parallel": {"dp_replicate": 1, "dp_shard": 1},
        "compile": compile,
        "model": {"preset": args.preset}, "data": {"path": str(data)},
        "training": {"global_batch_size": args.batch, "micro_batch_size": args.micro_batch, "max_steps": 100000,
                     "log_interval": 100000},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.1, "grad_clip": 1.0},
        "lr_schedule": {"warmup_steps": 10, "min_lr_ratio": 0.1},
        "checkpoint": {"interval": 0, "resume": False},
    }


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_throughput(trainer, args, data: Path, device) -> tuple[dict, "PlainLoop"]:
    import torch

    from phalanx.train.mfu import mfu

    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        trainer.advance()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    alone = [timed(trainer.advance) for _ in range(5)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    cfg = trainer.config
    spec = {"preset": args.preset, "data": str(data / "train.bin"), "seed": 7, "device": str(device),
            "precision": "bf16", "global_batch_size": args.batch, "micro_batch_size": args.micro_batch,
            "optimizer": cfg.optimizer.model_dump(), "warmup_steps": cfg.lr_schedule.warmup_steps,
            "min_lr_ratio": cfg.lr_schedule.min_lr_ratio, "decay_steps": cfg.decay_steps}
    loop = PlainLoop(spec)
    for _ in range(args.warmup):
        loop.step()
    times = {"phalanx": [], "fsdp2_loop": []}
    for i in range(args.steps):
        order = ("phalanx", "fsdp2_loop") if i % 2 == 0 else ("fsdp2_loop", "phalanx")
        for name in order:
            times[name].append(timed(trainer.advance) if name == "phalanx" else loop.step())
    tokens = args.batch * SEQ
    tok_s = {k: tokens / median(v) for k, v in times.items()}
    peak_flops, per_token = trainer.peak_flops_per_s, trainer.flops_per_token
    ratios = [b / a for a, b in zip(times["phalanx"], times["fsdp2_loop"])]
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "tokens_per_step": tokens, "flops_per_token": per_token,
        "peak_flops_per_s": peak_flops, "step_time_s": times, "trainer_alone_step_time_s": alone,
        "tokens_per_s": tok_s, "mfu": {k: mfu(v, per_token, peak_flops, 1) if peak_flops else None
                                       for k, v in tok_s.items()},
        "trainer_record_mfu": trainer.last_record.get("mfu"), "pair_ratios": ratios,
        "ratio": median(ratios), "peak_mem_gib": round(peak, 2),
    }, loop


def bench_compiled(work: Path, data: Path, args, device, eager: dict) -> dict:
    """A trainer with `compile: true`, timed alone: its first step (the compile) and `--steps` steps after the
    warm-up. The eager figures were taken earlier in this process, beside the plain loop."""
    import torch

    from phalanx.train.config import config_from_dict
    from phalanx.train.mfu import mfu
    from phalanx.train.trainer import Trainer

    trainer = Trainer(config_from_dict(trainer_config(work / "compiled", data, args, compile=True)), device)
    trainer.start(announce=False)
    first = timed(trainer.advance)
    for _ in range(args.warmup):
        trainer.advance()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timed(trainer.advance) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    trainer.metrics.close()
    tok_s = eager["tokens_per_step"] / median(times)
    return {"first_step_s": first, "step_time_s": times, "tokens_per_s": tok_s, "peak_mem_gib": round(peak, 2),
            "mfu": mfu(tok_s, eager["flops_per_token"], eager["peak_flops_per_s"], 1) if eager["peak_flops_per_s"]
            else None, "vs_eager_trainer": tok_s / eager["tokens_per_s"]["phalanx"]}


def capture_pageable(trainer) -> None:
    """The capture as it was before 2026-11-27 on a GPU: a pageable buffer, one synchronous copy per tensor."""
    import torch

    tensors = [t for _, t in trainer.state.local_tensors()]
    data = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        data[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n


def bench_snapshots(trainer, args) -> dict:
    import torch

    from phalanx.resilience.restore import ShardState

    start = time.perf_counter()
    state = ShardState.capture(trainer)  # the first one pins fresh host memory; later ones reuse it (cached)
    first = time.perf_counter() - start
    nbytes = state.nbytes
    del state
    sync = [timed(lambda: ShardState.capture(trainer)) for _ in range(3)]
    pageable = [timed(lambda: capture_pageable(trainer))]

    cuda = trainer.device.type == "cuda"
    side = torch.cuda.Stream(trainer.device) if cuda else None
    pending: dict = {"event": None, "states": []}

    def before_update(optimizer, a, k):  # as BuddySnapshots._before_update
        if pending["event"] is not None:
            torch.cuda.current_stream().wait_event(pending["event"])
            pending["event"] = None

    hook = trainer.optimizer.register_step_pre_hook(before_update)

    def step(snapshot: bool) -> float:
        start = time.perf_counter()
        trainer.advance()
        if snapshot:
            state = ShardState.capture(trainer, stream=side)
            pending["event"] = state.copied
            # the exchange thread's first act: wait for the copy (it then checksums and sends; not here)
            thread = threading.Thread(target=state.ready)
            thread.start()
            pending["states"] = [state, thread]
        return time.perf_counter() - start

    result = {"state_gb": round(nbytes / 1e9, 2), "first_capture_s": first, "capture_pageable_s": pageable,
              "capture_sync_s": sync,
              "capture_pageable_gb_per_s": nbytes / 1e9 / median(pageable),
              "capture_sync_gb_per_s": nbytes / 1e9 / median(sync)}
    for every in args.snapshot_every:
        plain, snap = [], []
        for block in range(args.snapshot_blocks):
            for with_snapshots in ((False, True) if block % 2 == 0 else (True, False)):
                for i in range(args.snapshot_steps):
                    t = step(with_snapshots and i % every == 0)
                    (snap if with_snapshots else plain).append(t)
                if pending["states"]:
                    pending["states"][1].join()
                if cuda:
                    torch.cuda.synchronize()
        result[f"step_time_s_every_{every}"] = {"without": plain, "with": snap}
        result[f"step_ratio_every_{every}"] = median(plain) / median(snap)
        # the step that follows a capture pays for it (its update waits for the copy): its mean, not the median
        result[f"mean_ratio_every_{every}"] = statistics.fmean(plain) / statistics.fmean(snap)
    hook.remove()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=PRESET)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences of 2048 tokens)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps of each, stepping in turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--snapshot-every", type=int, nargs="*", default=[1, 10])
    parser.add_argument("--snapshot-steps", type=int, default=10, help="steps per block")
    parser.add_argument("--snapshot-blocks", type=int, default=2, help="blocks of each kind, alternating")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_mfu.json")
    parser.add_argument("--compile", action="store_true", help="then build a trainer with `compile: true` and "
                        "time it alone (after the eager trainer is gone)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run the script's path on the CPU (gloo), to check "
                        "it before a GPU is lent: its figures mean nothing")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from phalanx.train.config import config_from_dict
    from phalanx.train.launch import free_port
    from phalanx.train.trainer import Trainer
    from phalanx.worker import select_device

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_mfu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    if args.cpu_smoke:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend)
    else:
        device, backend = select_device()
        dist.init_process_group(backend, device_id=device)
    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-") as tmp:
        work = Path(tmp)
        data = work / "data"
        data.mkdir()
        write_token_file(data / "train.bin", 256 * 2**20, seed=1)
        start = time.perf_counter()
        trainer = Trainer(config_from_dict(trainer_config(work / "run", data, args)), device)
        trainer.start(announce=False)
        build_s = time.perf_counter() - start
        throughput, loop = bench_throughput(trainer, args, data, device)
        del loop
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{throughput['device']}: phalanx {throughput['tokens_per_s']['phalanx']:,.0f} tok/s "
              f"(MFU {throughput['mfu']['phalanx']}), plain FSDP2 loop "
              f"{throughput['tokens_per_s']['fsdp2_loop']:,.0f} tok/s (MFU {throughput['mfu']['fsdp2_loop']}); "
              f"ratio {throughput['ratio']:.3f}; peak memory {throughput['peak_mem_gib']} GiB", flush=True)
        snapshots = bench_snapshots(trainer, args)
        print(f"snapshot of {snapshots['state_gb']} GB: capture pageable {median(snapshots['capture_pageable_s']):.2f} s, "
              f"pinned {median(snapshots['capture_sync_s']):.2f} s (the first {snapshots['first_capture_s']:.2f} s); step ratio "
              + ", ".join(f"every {n}: {snapshots[f'step_ratio_every_{n}']:.3f} (mean {snapshots[f'mean_ratio_every_{n}']:.3f})"
                          for n in args.snapshot_every), flush=True)
        trainer.metrics.close()
        compiled = None
        if args.compile:
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
            compiled = bench_compiled(work, data, args, device, throughput)
            print(f"compiled: {compiled['tokens_per_s']:,.0f} tok/s (MFU {compiled['mfu']}), first step "
                  f"{compiled['first_step_s']:.1f} s", flush=True)
    dist.destroy_process_group()
    summary = {
        "device": throughput["device"], "mfu_2048": throughput["mfu"]["phalanx"],
        "tokens_per_s_2048": throughput["tokens_per_s"]["phalanx"],
        "fsdp2_loop_mfu_2048": throughput["mfu"]["fsdp2_loop"],
        "trainer_ratio": throughput["ratio"], "torchtitan_ratio": None, "peak_mem_gib": throughput["peak_mem_gib"],
        "snapshot_state_gb": snapshots["state_gb"],
        "snapshot_capture_pageable_s": median(snapshots["capture_pageable_s"]),
        "snapshot_capture_pinned_s": median(snapshots["capture_sync_s"]),
        "snapshot_first_capture_s": snapshots["first_capture_s"],
        **{f"snapshot_step_ratio_every_{n}": snapshots[f"mean_ratio_every_{n}"] for n in args.snapshot_every},
    }
    if compiled is not None:
        summary.update(compiled_mfu_2048=compiled["mfu"], compiled_tokens_per_s_2048=compiled["tokens_per_s"])
    write_results(args.out, {
        "command": "python " + " ".join(sys.argv),
        "config": {"preset": args.preset, "seq": SEQ, "global_batch": args.batch, "micro_batch": args.micro_batch,
                   "steps_each": args.steps, "warmup": args.warmup, "build_s": round(build_s, 2),
                   "torchtitan": "not measured: not installed on the GPU machine, which reaches no network"},
        "throughput": throughput, "snapshots": snapshots, "compiled": compiled, "summary": summary,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
