"""Training overhead and data-loader speed of Phalanx, against baselines measured in the same run.

Training (A vs B, `--runs` pairs alternating A B, B A, A B, ..., `--nproc` local CPU processes, gloo):
  A  `phalanx train` on recipes/tiny-llama.yaml (tiny preset, fp32, global batch 32, micro batch 4;
     fewer steps, checkpoint.interval 0) through `phalanx.train.launch.launch`. tokens/s of a run =
     median of the per-step `tokens_per_s` in metrics.jsonl after the warm-up steps. The final
     checkpoint the trainer always writes is not in any step record, so it is excluded.
  B  a plain PyTorch FSDP2 loop written here (`PlainLoop`): the same `Transformer`, the same token
     file read with `TokenDataset`, `fully_shard` per block then the root over a 1-D mesh, fp32
     MixedPrecisionPolicy, AdamW (+ warmup/cosine LambdaLR) with the recipe's hyperparameters, the same
     gradient accumulation, clipping and loss all_reduce, timed the same way (perf_counter around the
     whole step including the data fetch), with the same warm-up skip. Like torchtitan (and Phalanx) it
     keeps the last block unsharded after forward; it draws batches with numpy's RNG instead of the
     Phalanx sampler and initialises weights with plain normal_/fill_ (same shapes, same cost per step).
  throughput_ratio = median(A) / median(B). Also reported: the cadence ratio from the wall time
  between consecutive steps (includes per-step work outside the timed region, e.g. metrics lines).
  The order alternates (until 2026-11-26 A always went first: the 16 pairs of the four earlier results had
  a median of 0.979, spread 0.92-1.10; how much of that was order and how much drift is not separable).

Interleaved (`--interleaved-runs`, before the pairs): a Phalanx `Trainer` and the plain loop built in the
same `--nproc` processes on one process group, stepping in turn (A B, B A, ...); A's step is the trainer's
whole per-step path (`advance()`: the step, the record with its host syncs, metrics.jsonl, TensorBoard,
callbacks). Both see the same machine at the same moments, so the ratio (median over step pairs of B's
seconds ÷ A's) isolates the code's cost from a shared 2-core box's drift between runs (±3 % run to run).
What it cannot see: a cost of a process as a whole (a background thread, start-up), which the pairs keep.

Loader: synthetic uint16 token files of ~10 MB and ~1 GiB (random tokens, real bytes, phalanx-tokens-v1
via `phalanx.data.token_file`); start-up = `TokenDataset` open + `GlobalBatchSampler` construction +
first global batch (10 MB vs 1 GiB, interleaved); read speed = random global batches (64 x 2048)
through `sampler.global_batch` + `dataset.get_batch` for ~2 s per run from the 1 GiB file (page cache
warm: the file was just written). The files are deleted at the end.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/throughput.py --runs 6 --interleaved-runs 3 --steps 30
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
TARGET_STEADY = 0.99  # issue 14: the trainer's per-step path against the plain loop
LOADER_BATCH, LOADER_BLOCK, LOADER_VOCAB = 64, 2048, 32000


# ---- B: the plain FSDP2 loop (runs in its own worker processes) -------------------------------
class PlainLoop:
    """The baseline's model, optimizer, schedule and data, on the default process group: plain
    torch.distributed + fully_shard, no Phalanx trainer code. `step()` runs one step and returns its seconds.
    `spec` may name a "device" (default cpu; a GPU step ends with a synchronize) and a "precision" ("fp32", the
    default, or "bf16": bf16 compute, fp32 master weights and reduction, as the trainer's policy)."""

    def __init__(self, spec: dict):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from phalanx.data import TokenDataset
        from phalanx.models import Transformer, get_preset

        self.torch, self.dist = torch, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(spec.get("device", "cpu"))
        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp_shard",))
        with torch.device("meta"):
            model = Transformer(get_preset(spec["preset"]))
        compute = torch.bfloat16 if spec.get("precision", "fp32") == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        layers = model.model.layers
        for i, block in enumerate(layers):  # torchtitan's default: keep the last block unsharded
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        model.to_empty(device=self.device)
        torch.manual_seed(spec["seed"] + self.rank)
        with torch.no_grad():
            for name, param in model.named_parameters():
                local = param.to_local()
                if name.endswith("norm.weight"):
                    local.fill_(1.0)
                else:
                    local.normal_(0.0, 0.02)
        model.reset_buffers()  # rotary inv_freq (a non-persistent buffer, empty after to_empty)
        self.model = model

        o = self.opt = spec["optimizer"]
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
        )
        warmup, total, min_ratio = spec["warmup_steps"], spec["decay_steps"], spec["min_lr_ratio"]

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor)
        self.dataset = TokenDataset(spec["data"])
        self.gb, mb = spec["global_batch_size"], spec["micro_batch_size"]
        self.local_bs, self.accum = self.gb // self.world, self.gb // (mb * self.world)
        self.rng = np.random.default_rng(spec["seed"])  # same stream on every rank: one global order
        self.tokens_per_step = self.gb * self.dataset.block_size

    def step(self) -> float:
        torch, dist = self.torch, self.dist
        start = time.perf_counter()
        global_batch = self.rng.integers(0, len(self.dataset), size=self.gb)
        local = global_batch[self.rank * self.local_bs : (self.rank + 1) * self.local_bs]
        loss_sum = torch.zeros((), device=self.device)
        for indices in np.split(local, self.accum):
            tokens = self.dataset.get_batch(indices).to(self.device, non_blocking=True)
            loss, _ = self.model(tokens, tokens)
            (loss / self.accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.opt["grad_clip"])
        grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_mean = loss_sum / self.accum
        dist.all_reduce(loss_mean)
        loss_mean /= self.world
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        loss_mean.item(), float(grad_norm)
        return seconds


def fsdp2_worker(spec: dict) -> None:
    """One rank of the baseline run (B)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    loop = PlainLoop(spec)
    step_times, ends = [], []
    for _ in range(spec["steps"]):
        step_times.append(loop.step())
        ends.append(time.time())
    if loop.rank == 0:
        Path(spec["out"]).write_text(json.dumps(
            {"step_time_s": step_times, "end_time": ends, "tokens_per_step": loop.tokens_per_step}
        ))
    dist.destroy_process_group()


def interleaved_worker(spec: dict) -> None:
    """One rank of the interleaved comparison: a Phalanx `Trainer` (its whole per-step path, `advance()`: the
    step, the record, metrics.jsonl, TensorBoard, callbacks) and the plain loop in the same processes, on the
    same process group, stepping in turn (A B B A A B ...): both see the same machine at the same moments, so
    what differs between them is the code, not the weather. Rank 0 writes each step's seconds."""
    import torch
    import torch.distributed as dist

    from phalanx.train.config import config_from_dict
    from phalanx.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trainer = Trainer(config_from_dict(spec["config"]), torch.device("cpu"))
    trainer.start(announce=False)
    loop = PlainLoop(spec)
    times: dict[str, list[float]] = {"phalanx": [], "fsdp2_loop": []}

    def phalanx_step() -> float:
        start = time.perf_counter()
        trainer.advance()
        return time.perf_counter() - start

    for i in range(spec["steps"]):
        order = ("phalanx", "fsdp2_loop") if i % 2 == 0 else ("fsdp2_loop", "phalanx")
        for name in order:
            times[name].append(phalanx_step() if name == "phalanx" else loop.step())
    trainer.metrics.close()
    if loop.rank == 0:
        Path(spec["out"]).write_text(json.dumps({"step_time_s": times, "tokens_per_step": loop.tokens_per_step}))
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


def run_workers(flag: str, spec: dict, nproc: int, work: Path) -> tuple[dict, float]:
    """`nproc` processes of this script with `flag` (one of the worker modes) on `spec`; rank 0's output and
    the wall seconds."""
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
                [sys.executable, __file__, flag, str(work / "spec.json")],
                env={**cpu_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                stdout=out, stderr=subprocess.STDOUT,
            )
            for r in range(nproc)
        ]
        codes = [p.wait() for p in procs]
    wall = time.perf_counter() - start
    if any(codes):
        _fail(f"{flag} (exit codes {codes})", log)
    return json.loads((work / "steps.json").read_text()), wall


def run_fsdp2(spec: dict, nproc: int, warmup: int, work: Path) -> dict:
    rec, wall = run_workers("--fsdp2-worker", spec, nproc, work)
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
    interleaved = None
    if args.interleaved_runs:
        print(f"interleaved: {args.interleaved_runs} runs of phalanx and the fsdp2 loop stepping in turn")
        interleaved = bench_interleaved(args, work, data, spec)
    runs = {"phalanx": [], "fsdp2_loop": []}
    for i in range(args.runs):
        config = load_config(RECIPE, overrides + [f"run_dir={work / f'phalanx-{i}'}"])
        run = {"phalanx": lambda: run_phalanx(config, args.nproc, args.warmup, tokens_per_step),
               "fsdp2_loop": lambda: run_fsdp2(spec, args.nproc, args.warmup, work / f"fsdp2-{i}")}
        for name in (("phalanx", "fsdp2_loop") if i % 2 == 0 else ("fsdp2_loop", "phalanx")):  # A B, B A, ...
            load = os.getloadavg()[0]
            runs[name].append({**run[name](), "load_1m_before": load})
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
        "interleaved": interleaved,
    }


def bench_interleaved(args, work: Path, data: Path, spec: dict) -> dict:
    """`--interleaved-runs` runs of `interleaved_worker`: per run, the median over its steps (after the warm-up)
    of phalanx's step seconds ÷ the plain loop's neighbouring step (the pair stepped back to back)."""
    from phalanx.train.config import load_config

    runs = []
    for i in range(args.interleaved_runs):
        run_dir = work / f"interleaved-{i}"
        # max_steps past the run: the trainer's final checkpoint is not part of a steady step
        config = load_config(RECIPE, [f"data.path={data}", f"training.max_steps={args.steps + 1000}",
                                      "checkpoint.interval=0", f"run_dir={run_dir / 'phalanx'}"])
        rec, wall = run_workers("--interleaved-worker", {**spec, "config": config.model_dump(mode="json")},
                                args.nproc, run_dir)
        a, b = rec["step_time_s"]["phalanx"], rec["step_time_s"]["fsdp2_loop"]
        ratios = [tb / ta for ta, tb in zip(a[args.warmup:], b[args.warmup:])]
        runs.append({"step_time_s": rec["step_time_s"], "pair_ratios": ratios, "ratio": median(ratios),
                     "tokens_per_s": {k: rec["tokens_per_step"] / median(v[args.warmup:])
                                      for k, v in rec["step_time_s"].items()},
                     "process_wall_s": wall})
        print(f"  interleaved run {i + 1}/{args.interleaved_runs}: phalanx ÷ fsdp2 loop {runs[-1]['ratio']:.4f} "
              f"(median of {len(ratios)} step pairs)", flush=True)
    return {"config": {"steps_each": args.steps, "warmup_steps_skipped": args.warmup, "nproc": args.nproc},
            "runs": runs, "ratio": median([r["ratio"] for r in runs]),
            "all_pairs_ratio": median([x for r in runs for x in r["pair_ratios"]])}


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
        if t.get("interleaved"):
            il = t["interleaved"]
            table.add_row("interleaved in one process: phalanx ÷ fsdp2 loop per step pair",
                          ", ".join(f"{r['ratio']:.3f}" for r in il["runs"]), "", f"median {il['ratio']:.3f}",
                          f"≥ {TARGET_STEADY}")
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
    parser.add_argument("--interleaved-runs", type=int, default=3,
                        help="runs where phalanx and the fsdp2 loop step in turn in the same processes (0: none)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--loader-seconds", type=float, default=2.0)
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "throughput.json")
    parser.add_argument("--fsdp2-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.interleaved_worker:
        interleaved_worker(json.loads(args.interleaved_worker.read_text()))
        exit_without_teardown(0)
    if args.fsdp2_worker:
        fsdp2_worker(json.loads(args.fsdp2_worker.read_text()))
        exit_without_teardown(0)  # teardown can abort in a gloo destructor (phalanx.process)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} + 1")

    os.environ.update(cpu_env())
    import torch

    torch.set_num_threads(1)
    result: dict = {"benchmark": "throughput", "config": {k: v for k, v in vars(args).items() if not k.endswith("_worker")}}
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
        "interleaved_ratio": t and t["interleaved"] and t["interleaved"]["ratio"],
    }
    print_table(result)
    print(f"wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
