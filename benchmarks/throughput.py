"""Training overhead and data-loader speed of Phalanx, against baselines measured in the same run.

Training (A vs B, interleaved A B A B for `--runs` pairs, `--nproc` local CPU processes, gloo):
  A  `phalanx train` on recipes/tiny-llama.yaml (tiny preset, fp32, global batch 32, micro batch 4;
     fewer steps, checkpoint.interval 0) through `phalanx.train.launch.launch`. tokens/s of a run =
     median of the per-step `tokens_per_s` in metrics.jsonl after the warm-up steps. The final
     checkpoint the trainer always writes is not in any step record, so it is excluded.
  B  a plain PyTorch FSDP2 loop written here (`fsdp2_worker`): the same `Transformer`, the same token
     file read with `TokenDataset`, `fully_shard` per block then the root over a 1-D mesh, fp32
     MixedPrecisionPolicy, AdamW (+ warmup/cosine LambdaLR) with the recipe's hyperparameters, the same
     gradient accumulation, clipping and loss all_reduce, timed the same way (perf_counter around the
     whole step including the data fetch), with the same warm-up skip. Like torchtitan (and Phalanx) it
     keeps the last block unsharded after forward; it draws batches with numpy's RNG instead of the
     Phalanx sampler and initialises weights with plain normal_/fill_ (same shapes, same cost per step).
  throughput_ratio = median(A) / median(B). Also reported: the cadence ratio from the wall time
  between consecutive steps (includes per-step work outside the timed region, e.g. metrics lines).

Loader: synthetic uint16 token files of ~10 MB and ~1 GiB (random tokens, real bytes, phalanx-tokens-v1
via `phalanx.data.token_file`); start-up = `TokenDataset` open + `GlobalBatchSampler` construction +
first global batch (10 MB vs 1 GiB, interleaved); read speed = random global batches (64 x 2048)
through `sampler.global_batch` + `dataset.get_batch` for ~2 s per run from the 1 GiB file (page cache
warm: the file was just written). The files are deleted at the end.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/throughput.py --runs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO_ROOT, RESULTS_DIR, cpu_env, median, write_results  # noqa: E402
from phalanx.process import exit_without_teardown  # noqa: E402

RECIPE = REPO_ROOT / "recipes" / "tiny-llama.yaml"
TARGET_RATIO, TARGET_LOADER_TOK_S = 0.98, 50e6
LOADER_BATCH, LOADER_BLOCK, LOADER_VOCAB = 64, 2048, 32000


# ---- B: the plain FSDP2 loop (runs in its own worker processes) -------------------------------
def fsdp2_worker(spec: dict) -> None:
    """One rank of the baseline: plain torch.distributed + fully_shard, no Phalanx trainer code."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from phalanx.data import TokenDataset
    from phalanx.models import Transformer, get_preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))

    with torch.device("meta"):
        model = Transformer(get_preset(spec["preset"]))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, block in enumerate(layers):  # torchtitan's default: keep the last block unsharded
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    model.to_empty(device="cpu")
    torch.manual_seed(spec["seed"] + rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local()
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02)
    model.reset_buffers()  # rotary inv_freq (a non-persistent buffer, empty after to_empty)

    o = spec["optimizer"]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
    )
    warmup, total, min_ratio = spec["warmup_steps"], spec["decay_steps"], spec["min_lr_ratio"]

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    dataset = TokenDataset(spec["data"])
    gb, mb = spec["global_batch_size"], spec["micro_batch_size"]
    local_bs, accum = gb // world, gb // (mb * world)
    rng = np.random.default_rng(spec["seed"])  # same stream on every rank: one global order
    tokens_per_step = gb * dataset.block_size
    step_times, ends = [], []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        global_batch = rng.integers(0, len(dataset), size=gb)
        local = global_batch[rank * local_bs : (rank + 1) * local_bs]
        loss_sum = torch.zeros(())
        for indices in np.split(local, accum):
            tokens = dataset.get_batch(indices)
            loss, _ = model(tokens, tokens)
            (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        grad_norm = grad_norm.full_tensor()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_mean = loss_sum / accum
        dist.all_reduce(loss_mean)
        loss_mean /= world
        step_times.append(time.perf_counter() - start)
        loss_mean.item(), float(grad_norm)
        ends.append(time.time())
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(
            {"step_time_s": step_times, "end_time": ends, "tokens_per_step": tokens_per_step}
        ))
    dist.destroy_process_group()


# ---- running A and B ---------------------------------------------------------------------------
@contextlib.contextmanager
def output_to(path: Path):
    """Send this process's (and its children's) stdout/stderr to `path` for the duration."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def _fail(what: str, log: Path) -> None:
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise SystemExit(f"{what} failed; last output:\n{tail}")


def run_phalanx(config, nproc: int, warmup: int, tokens_per_step: int) -> dict:
    from phalanx.train.launch import launch
    from phalanx.train.metrics import read_metrics

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True)
    log = run_dir / "output.log"
    start = time.perf_counter()
    with output_to(log):
        code = launch(config, nproc, threads_per_worker=1)
    wall = time.perf_counter() - start
    if code != 0:
        _fail(f"phalanx train (exit {code})", log)
    steps, _ = read_metrics(run_dir)
    return _summarise([r["tokens_per_s"] for r in steps], [r["time"] for r in steps], tokens_per_step, warmup, wall)


def run_fsdp2(spec: dict, nproc: int, warmup: int, work: Path) -> dict:
    from phalanx.train.launch import free_port

    work.mkdir(parents=True)
    spec = {**spec, "out": str(work / "steps.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    log = work / "output.log"
    port = free_port()
    start = time.perf_counter()
    with open(log, "wb") as out:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--fsdp2-worker", str(work / "spec.json")],
                env={**cpu_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                stdout=out, stderr=subprocess.STDOUT,
            )
            for r in range(nproc)
        ]
        codes = [p.wait() for p in procs]
    wall = time.perf_counter() - start
    if any(codes):
        _fail(f"FSDP2 baseline (exit codes {codes})", log)
    rec = json.loads((work / "steps.json").read_text())
    tps = [rec["tokens_per_step"] / t for t in rec["step_time_s"]]
    return _summarise(tps, rec["end_time"], rec["tokens_per_step"], warmup, wall)


def _summarise(tokens_per_s: list[float], end_times: list[float], tokens_per_step: float,
               warmup: int, wall_s: float) -> dict:
    """Per-run figures: median step tokens/s after warm-up, and the same from step-to-step wall time."""
    intervals = list(np.diff(end_times[warmup:]))
    return {
        "step_tokens_per_s": tokens_per_s,
        "tokens_per_s": median(tokens_per_s[warmup:]),
        "cadence_s": intervals,
        "cadence_tokens_per_s": tokens_per_step / median(intervals) if intervals else None,
        "process_wall_s": wall_s,
    }


def bench_training(args, work: Path) -> dict:
    from phalanx.data import TokenDataset, prepare, write_demo_corpus
    from phalanx.train.config import load_config

    data = work / "demo"
    work.mkdir(parents=True)
    with output_to(work / "prepare.log"):
        prepare([write_demo_corpus(work / "corpus.jsonl")], data, progress=False)  # = phalanx data prepare --demo
    overrides = [f"data.path={data}", f"training.max_steps={args.steps}", "checkpoint.interval=0"]
    base = load_config(RECIPE, overrides + [f"run_dir={work / 'probe'}"])
    spec = {
        "preset": base.model.preset, "data": str(data / "train.bin"), "seed": base.seed, "steps": args.steps,
        "global_batch_size": base.training.global_batch_size, "micro_batch_size": base.training.micro_batch_size,
        "optimizer": base.optimizer.model_dump(), "warmup_steps": base.lr_schedule.warmup_steps,
        "min_lr_ratio": base.lr_schedule.min_lr_ratio, "decay_steps": base.decay_steps,
    }
    tokens_per_step = base.training.global_batch_size * TokenDataset(data).block_size
    assert base.precision == "fp32" and not base.model.overrides and base.activation_checkpointing.mode == "none"
    runs = {"phalanx": [], "fsdp2_loop": []}
    for i in range(args.runs):
        config = load_config(RECIPE, overrides + [f"run_dir={work / f'phalanx-{i}'}"])
        load = os.getloadavg()[0]
        runs["phalanx"].append({**run_phalanx(config, args.nproc, args.warmup, tokens_per_step), "load_1m_before": load})
        load = os.getloadavg()[0]
        runs["fsdp2_loop"].append({**run_fsdp2(spec, args.nproc, args.warmup, work / f"fsdp2-{i}"), "load_1m_before": load})
        print(f"  pair {i + 1}/{args.runs}: phalanx {runs['phalanx'][-1]['tokens_per_s']:,.0f} tok/s, "
              f"fsdp2 loop {runs['fsdp2_loop'][-1]['tokens_per_s']:,.0f} tok/s", flush=True)
    med = {k: median([r["tokens_per_s"] for r in v]) for k, v in runs.items()}
    cad = {k: median([r["cadence_tokens_per_s"] for r in v]) for k, v in runs.items()}
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["phalanx"], runs["fsdp2_loop"])]
    return {
        "config": {"recipe": str(RECIPE.relative_to(REPO_ROOT)), "overrides": overrides[1:], "baseline": spec,
                   "nproc": args.nproc, "warmup_steps_skipped": args.warmup,
                   "tokens_per_step": tokens_per_step},
        "runs": runs,
        "median_tokens_per_s": med,
        "median_cadence_tokens_per_s": cad,
        "pairwise_ratios": pairs,
        "pairwise_ratio_median": median(pairs),
        "throughput_ratio": med["phalanx"] / med["fsdp2_loop"],
        "cadence_ratio": cad["phalanx"] / cad["fsdp2_loop"],
        "median_process_wall_s": {k: median([r["process_wall_s"] for r in v]) for k, v in runs.items()},
    }


# ---- loader ------------------------------------------------------------------------------------
def write_token_file(path: Path, num_bytes: int, seed: int) -> Path:
    """Random uint16 tokens (real bytes on disk) plus phalanx-tokens-v1 metadata."""
    from phalanx.data.token_file import TokenFileMeta, TokenFileWriter, token_dtype_for_vocab, write_meta

    dtype = token_dtype_for_vocab(LOADER_VOCAB)
    num_tokens = num_bytes // dtype.itemsize // LOADER_BLOCK * LOADER_BLOCK
    rng, chunk = np.random.default_rng(seed), 1 << 25
    with TokenFileWriter(path, dtype, LOADER_BLOCK) as writer:
        for start in range(0, num_tokens, chunk):
            writer.write(rng.integers(0, LOADER_VOCAB, size=min(chunk, num_tokens - start), dtype=np.uint16))
        kept = writer.finish()
    meta = TokenFileMeta(vocab_size=LOADER_VOCAB, dtype=dtype.name, block_size=LOADER_BLOCK,
                         num_samples=kept // LOADER_BLOCK, num_tokens=kept, eos_id=0)
    write_meta(path, meta, {"synthetic": "uniform random tokens (benchmarks/throughput.py)"})
    return path


def loader_startup(path: Path) -> float:
    from phalanx.data import GlobalBatchSampler, TokenDataset

    start = time.perf_counter()
    dataset = TokenDataset(path)
    sampler = GlobalBatchSampler(len(dataset), LOADER_BATCH, seed=0)
    dataset.get_batch(sampler.global_batch(0))
    return time.perf_counter() - start


def loader_read(path: Path, seconds: float, seed: int) -> float:
    from phalanx.data import GlobalBatchSampler, TokenDataset

    dataset = TokenDataset(path)
    sampler = GlobalBatchSampler(len(dataset), LOADER_BATCH, seed=seed)
    consumed = tokens = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        tokens += dataset.get_batch(sampler.global_batch(consumed)).numel()
        consumed += LOADER_BATCH
    return tokens / elapsed


def bench_loader(args, work: Path) -> dict:
    small = write_token_file(work / "small.bin", 10 * 2**20, seed=1)
    start = time.perf_counter()
    large = write_token_file(work / "large.bin", 2**30, seed=2)
    write_s = time.perf_counter() - start
    try:
        loader_startup(small)  # imports and first-call costs, untimed
        startup = {"10mb": [], "1gb": []}
        for _ in range(args.runs):
            startup["10mb"].append(loader_startup(small))
            startup["1gb"].append(loader_startup(large))
        read = [loader_read(large, args.loader_seconds, seed=i) for i in range(args.runs)]
        sizes = {"10mb": small.stat().st_size, "1gb": large.stat().st_size}
    finally:
        for p in (large, large.with_suffix(".json")):
            p.unlink(missing_ok=True)
    return {
        "config": {"batch": LOADER_BATCH, "block_size": LOADER_BLOCK, "vocab_size": LOADER_VOCAB, "dtype": "uint16",
                   "file_bytes": sizes, "read_seconds_per_run": args.loader_seconds, "page_cache": "warm",
                   "write_1gb_s": write_s},
        "startup_s": startup,
        "read_tokens_per_s": read,
        "median_startup_s": {k: median(v) for k, v in startup.items()},
        "median_read_tokens_per_s": median(read),
    }


# ---- report ------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Phalanx throughput (medians of {result['config']['runs']} runs)")
    for col in ("figure", "value", "baseline", "ratio", "target"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    t, ld = result.get("training"), result.get("loader")
    if t:
        m, c = t["median_tokens_per_s"], t["median_cadence_tokens_per_s"]
        ok = "✓" if t["throughput_ratio"] >= TARGET_RATIO else "✗"
        table.add_row("train tok/s, step timer (phalanx vs FSDP2 loop)", f"{m['phalanx']:,.0f}",
                      f"{m['fsdp2_loop']:,.0f}", f"{t['throughput_ratio']:.3f} {ok}", f"≥ {TARGET_RATIO}")
        table.add_row("train tok/s, step-to-step wall", f"{c['phalanx']:,.0f}", f"{c['fsdp2_loop']:,.0f}",
                      f"{t['cadence_ratio']:.3f}", "")
        w = t["median_process_wall_s"]
        table.add_row(f"whole job wall s ({t['config']['baseline']['steps']} steps, start-up + final ckpt)",
                      f"{w['phalanx']:.1f}", f"{w['fsdp2_loop']:.1f}", f"{w['phalanx'] / w['fsdp2_loop']:.3f}", "")
        table.add_row("pairwise ratios A/B (run i vs run i)", ", ".join(f"{r:.3f}" for r in t["pairwise_ratios"]), "",
                      f"median {t['pairwise_ratio_median']:.3f}", "")
    if ld:
        s = ld["median_startup_s"]
        ok = "✓" if ld["median_read_tokens_per_s"] >= TARGET_LOADER_TOK_S else "✗"
        table.add_row("loader read tok/s (1 GiB, 64×2048)", f"{ld['median_read_tokens_per_s'] / 1e6:,.1f} M {ok}",
                      "", "", "≥ 50 M")
        table.add_row("loader start-up 1 GiB vs 10 MB", f"{s['1gb'] * 1e3:.2f} ms", f"{s['10mb'] * 1e3:.2f} ms",
                      f"{s['1gb'] / s['10mb']:.2f}", "flat")
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="A/B pairs (and loader repetitions)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--loader-seconds", type=float, default=2.0)
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "throughput.json")
    parser.add_argument("--fsdp2-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp2_worker:
        fsdp2_worker(json.loads(args.fsdp2_worker.read_text()))
        exit_without_teardown(0)  # teardown can abort in a gloo destructor (phalanx.process)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} + 1")

    os.environ.update(cpu_env())
    import torch

    torch.set_num_threads(1)
    result: dict = {"benchmark": "throughput", "config": {k: v for k, v in vars(args).items() if k != "fsdp2_worker"}}
    result["config"]["out"] = str(args.out)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        if not args.skip_training:
            print(f"training: {args.runs} × (phalanx, fsdp2 loop) on {args.nproc} processes, {args.steps} steps")
            result["training"] = bench_training(args, Path(tmp) / "train")
        if not args.skip_loader:
            print("loader: writing 10 MB and 1 GiB token files")
            (Path(tmp) / "loader").mkdir()
            result["loader"] = bench_loader(args, Path(tmp) / "loader")
    t, ld = result.get("training"), result.get("loader")
    result["summary"] = {
        "throughput_ratio": t and t["throughput_ratio"],
        "loader_tokens_per_s": ld and ld["median_read_tokens_per_s"],
        "loader_startup_s_10mb": ld and ld["median_startup_s"]["10mb"],
        "loader_startup_s_1gb": ld and ld["median_startup_s"]["1gb"],
        "phalanx_tokens_per_s": t and t["median_tokens_per_s"]["phalanx"],
        "fsdp2_loop_tokens_per_s": t and t["median_tokens_per_s"]["fsdp2_loop"],
        "cadence_ratio": t and t["cadence_ratio"],
        "pairwise_ratio_median": t and t["pairwise_ratio_median"],
        "pairwise_ratio_min": t and min(t["pairwise_ratios"]),
        "pairwise_ratio_max": t and max(t["pairwise_ratios"]),
    }
    print_table(result)
    print(f"wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
