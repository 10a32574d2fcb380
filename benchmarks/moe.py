"""Mixture-of-experts throughput and balance: expert parallel degree 1 vs 2 vs 4, and single-GPU MFU.

CPU (always): recipes/tiny-mixtral.yaml (tiny-moe: 8 experts, top-2, 4 layers, fp32, global batch 32 ×
256 tokens) on `--nproc` local processes (gloo), with parallel.expert_parallel_degree = 1, 2 and 4.
Each run is `--steps` optimizer steps of the Phalanx `Trainer` (its own `train_step`, no checkpoints),
started fresh from the same seed on the same data. The three layouts run interleaved, in a rotating
order (run i starts with layout i mod 3), for `--runs` rounds. Per run: tokens/s = median of the per-step
tokens/s after `--warmup` steps. Reported: median over runs per ep, ratios ep2/ep1 and ep4/ep1, pairwise
ratios of the same round, the largest |loss(ep) − loss(ep=1)| over all steps and runs
(`ep_max_abs_loss_diff`), and the balance of the router over training: tokens dispatched per expert each
step (all micro-batches, all layers, all ranks), summarised as max/mean (1.0 = perfectly balanced) and
the coefficient of variation, early vs late in training.

GPU (only when CUDA is available): one process, bf16, tokens/s and MFU of the `llama-1b` preset (dense,
16 layers) and of an MoE on the same widths (llama-1b with 8 layers, each with 8 experts of intermediate
4096, top-2: the same active MLP width per token and layer as the dense model, half the layers), on
random tokens (block 2048). MFU = tokens/s × FLOPs per token / peak bf16 FLOP/s of the device, both from
`phalanx.train.mfu` (what each step's `mfu` in metrics.jsonl uses: 6 × active params in matmuls, the output
head included, + 12 × layers × heads × head_dim × seq; the peak from the device's name, None when unknown).
Without a GPU the JSON says "no GPU".

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe.py --runs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO_ROOT, RESULTS_DIR, cpu_env, median, write_results  # noqa: E402
from phalanx.process import exit_without_teardown  # noqa: E402

RECIPE = REPO_ROOT / "recipes" / "tiny-mixtral.yaml"
EP_DEGREES = (1, 2, 4)


# ---- one training run (a worker process of the CPU part, or the single GPU process) -----------------
def train_and_record(config, device, steps: int, out: Path | None) -> dict:
    """Run `steps` trainer steps; record each step's record and the tokens dispatched per expert."""
    import torch
    import torch.distributed as dist

    from phalanx.train.trainer import Trainer

    trainer = Trainer(config, device)
    records = []
    for _ in range(steps):
        record = trainer.train_step()  # MoE: with the step's tokens_per_expert and dropped_pairs
        record.setdefault("tokens_per_expert", None)
        record.setdefault("dropped_pairs", None)
        record["time"] = time.time()
        records.append(record)
    result = {"records": records, "layout": trainer.dims.describe(), "local_params": trainer.local_numel,
              "model_params": trainer.model_config.num_params(),
              "active_params": trainer.model_config.num_params(active=True)}
    if out is not None and dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    if device.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def worker_main(spec_path: Path) -> None:
    import torch
    import torch.distributed as dist

    from phalanx.train.config import config_from_dict

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train_and_record(config_from_dict(spec["config"]), torch.device("cpu"), spec["steps"], Path(spec["out"]))
    finally:
        dist.destroy_process_group()


def run_cpu(config, nproc: int, steps: int, work: Path) -> dict:
    from phalanx.train.config import dump_config
    from phalanx.train.launch import free_port

    work.mkdir(parents=True)
    spec = {"config": dump_config(config), "steps": steps, "out": str(work / "result.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    port, log = free_port(), work / "output.log"
    start = time.perf_counter()
    with open(log, "wb") as out:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(work / "spec.json")],
                env={**cpu_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                stdout=out, stderr=subprocess.STDOUT,
            )
            for r in range(nproc)
        ]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"run in {work} failed (exit codes {codes}):\n{log.read_text(errors='replace')[-3000:]}")
    result = json.loads((work / "result.json").read_text())
    result["process_wall_s"] = time.perf_counter() - start
    return result


def balance(tokens_per_expert: list[int]) -> dict:
    mean = statistics.fmean(tokens_per_expert)
    return {"max_over_mean": max(tokens_per_expert) / mean, "min_over_mean": min(tokens_per_expert) / mean,
            "cv": statistics.pstdev(tokens_per_expert) / mean}


def bench_cpu(args, work: Path) -> dict:
    from phalanx.data import TokenDataset, prepare, write_demo_corpus
    from phalanx.train.config import load_config

    data = work / "demo"
    work.mkdir(parents=True)
    with open(work / "prepare.log", "w") as log, contextlib.redirect_stdout(log):
        prepare([write_demo_corpus(work / "corpus.jsonl")], data, progress=False)  # = phalanx data prepare --demo
    overrides = [f"data.path={data}", f"training.max_steps={args.steps}", "checkpoint.interval=0",
                 "checkpoint.resume=false"]
    runs: dict[int, list[dict]] = {ep: [] for ep in EP_DEGREES}
    for i in range(args.runs):
        order = EP_DEGREES[i % 3:] + EP_DEGREES[: i % 3]
        for ep in order:
            config = load_config(RECIPE, overrides + [f"run_dir={work / f'ep{ep}-{i}'}",
                                                      f"parallel.expert_parallel_degree={ep}"])
            result = run_cpu(config, args.nproc, args.steps, work / f"ep{ep}-{i}-work")
            recs = result["records"]
            runs[ep].append({
                "step_tokens_per_s": [r["tokens_per_s"] for r in recs],
                "tokens_per_s": median([r["tokens_per_s"] for r in recs][args.warmup:]),
                "losses": [r["loss"] for r in recs],
                "tokens_per_expert": [r["tokens_per_expert"] for r in recs],
                "dropped_pairs": [r["dropped_pairs"] for r in recs],
                "layout": result["layout"], "local_params": result["local_params"],
                "process_wall_s": result["process_wall_s"], "load_1m_after": os.getloadavg()[0],
            })
        print(f"  round {i + 1}/{args.runs}: " + ", ".join(
            f"ep{ep} {runs[ep][-1]['tokens_per_s']:,.0f} tok/s" for ep in EP_DEGREES), flush=True)
    med = {ep: median([r["tokens_per_s"] for r in runs[ep]]) for ep in EP_DEGREES}
    loss_diff = max(abs(a - b) for ep in EP_DEGREES[1:] for run, base in zip(runs[ep], runs[1])
                    for a, b in zip(run["losses"], base["losses"]))
    # Balance over training, from the first ep=1 run (routing is the same for every ep up to fp noise).
    per_step = [balance(t) for t in runs[1][0]["tokens_per_expert"]]
    quarter = max(1, len(per_step) // 4)
    return {
        "config": {"recipe": str(RECIPE.relative_to(REPO_ROOT)), "overrides": overrides[1:], "nproc": args.nproc,
                   "steps": args.steps, "warmup_steps_skipped": args.warmup,
                   "tokens_per_step": TokenDataset(data).block_size * load_config(RECIPE).training.global_batch_size},
        "runs": {f"ep{ep}": v for ep, v in runs.items()},
        "median_tokens_per_s": {f"ep{ep}": v for ep, v in med.items()},
        "ratio_vs_ep1": {f"ep{ep}": med[ep] / med[1] for ep in EP_DEGREES},
        "pairwise_ratios_vs_ep1": {f"ep{ep}": [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[ep], runs[1])]
                                   for ep in EP_DEGREES[1:]},
        "ep_max_abs_loss_diff": loss_diff,
        "balance_per_step": per_step,
        "balance_first_quarter": {k: statistics.fmean(b[k] for b in per_step[:quarter]) for k in per_step[0]},
        "balance_last_quarter": {k: statistics.fmean(b[k] for b in per_step[-quarter:]) for k in per_step[0]},
        "tokens_per_expert_first_step": runs[1][0]["tokens_per_expert"][0],
        "tokens_per_expert_last_step": runs[1][0]["tokens_per_expert"][-1],
    }


# ---- single GPU ------------------------------------------------------------------------------------
GPU_MODELS = {
    "dense llama-1b": {"preset": "llama-1b", "overrides": {}},
    "moe llama-1b shapes, 8 experts top-2, 8 layers": {
        "preset": "llama-1b", "overrides": {"n_experts": 8, "top_k": 2, "intermediate_size": 4096, "n_layers": 8}},
}


def bench_single_device(device, models: dict, data: Path, *, micro_batch: int, steps: int, warmup: int,
                        work: Path) -> dict:
    """bf16 tokens/s (and MFU on a known GPU) of each model on one device; torch.distributed is initialised."""
    import torch

    from phalanx.train.config import config_from_dict
    from phalanx.train.mfu import flops_per_token, peak_flops_per_s
    from phalanx.train.trainer import resolve_model_config

    name_of_device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name_of_device, "peak_bf16_flops": peak_flops_per_s(name_of_device, "bf16"), "models": {}}
    for name, model in models.items():
        config = config_from_dict({
            "run_dir": str(work / name.split()[0]), "precision": "bf16", "model": model,
            "data": {"path": str(data)},
            "training": {"global_batch_size": micro_batch, "micro_batch_size": micro_batch, "max_steps": steps},
            "checkpoint": {"interval": 0, "resume": False}, "optimizer": {"lr": 1e-4},
        })
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = train_and_record(config, device, steps, None)
        tps = median([r["tokens_per_s"] for r in result["records"]][warmup:])
        seq = json.loads(data.with_suffix(".json").read_text())["block_size"]
        fpt = flops_per_token(resolve_model_config(config), seq)
        out["models"][name] = {
            "tokens_per_s": tps, "flops_per_token": fpt, "micro_batch": micro_batch, "seq": seq,
            "mfu": tps * fpt / out["peak_bf16_flops"] if out["peak_bf16_flops"] else None,
            "params": result["model_params"], "active_params": result["active_params"],
            "max_memory_gib": result.get("max_memory_gib"),
            "step_tokens_per_s": [r["tokens_per_s"] for r in result["records"]],
        }
    return out


def bench_gpu(args, work: Path) -> dict:
    import torch
    import torch.distributed as dist

    from throughput import write_token_file

    from phalanx.train.launch import free_port

    (work / "gpu-data").mkdir(parents=True)
    data = write_token_file(work / "gpu-data" / "train.bin", 256 * 2**20, seed=0)  # random, block 2048, vocab 32k
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    try:
        return bench_single_device(device, GPU_MODELS, data, micro_batch=args.gpu_micro_batch, steps=args.gpu_steps,
                                   warmup=args.warmup, work=work)
    finally:
        dist.destroy_process_group()


# ---- report ------------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 120)
    c = result.get("cpu")
    if c:
        table = Table(title=f"tiny-moe on {c['config']['nproc']} CPU processes (medians of {result['config']['runs']} "
                            "interleaved runs)")
        for col in ("expert parallel degree", "tokens/s", "ratio vs ep=1", "pairwise ratios", "layout"):
            table.add_column(col, justify="left" if col in ("expert parallel degree", "layout") else "right")
        for ep in EP_DEGREES:
            key = f"ep{ep}"
            pairs = c["pairwise_ratios_vs_ep1"].get(key)
            table.add_row(str(ep), f"{c['median_tokens_per_s'][key]:,.0f}", f"{c['ratio_vs_ep1'][key]:.3f}",
                          ", ".join(f"{p:.2f}" for p in pairs) if pairs else "", c["runs"][key][0]["layout"])
        console.print(table)
        b0, b1 = c["balance_first_quarter"], c["balance_last_quarter"]
        console.print(f"max |loss(ep) − loss(ep=1)| over all steps and runs: {c['ep_max_abs_loss_diff']:.2e}")
        console.print(f"router balance (tokens per expert, max/mean; CV): first quarter {b0['max_over_mean']:.3f}; "
                      f"{b0['cv']:.3f} → last quarter {b1['max_over_mean']:.3f}; {b1['cv']:.3f}")
        console.print(f"tokens per expert, step 1: {c['tokens_per_expert_first_step']}; "
                      f"last step: {c['tokens_per_expert_last_step']}")
    g = result.get("gpu")
    if isinstance(g, dict):
        table = Table(title=f"single GPU, bf16: {g['device']}")
        for col in ("model", "params (active)", "tokens/s", "MFU", "peak memory GiB"):
            table.add_column(col, justify="left" if col == "model" else "right")
        for name, m in g["models"].items():
            mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a (unknown peak)"
            table.add_row(name, f"{m['params'] / 1e9:.2f}B ({m['active_params'] / 1e9:.2f}B)",
                          f"{m['tokens_per_s']:,.0f}", mfu,
                          "" if m["max_memory_gib"] is None else f"{m['max_memory_gib']:.1f}")
        console.print(table)
    else:
        console.print(f"GPU: {g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="interleaved rounds of (ep=1, ep=2, ep=4)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of tokens/s")
    parser.add_argument("--gpu-steps", type=int, default=15)
    parser.add_argument("--gpu-micro-batch", type=int, default=4)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--note", help="free text kept in the JSON config (e.g. why the budget was reduced)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "moe.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        exit_without_teardown(0)  # teardown can abort in a gloo destructor (phalanx.process)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps={args.steps} must exceed --warmup={args.warmup} + 1")
    if args.nproc % max(EP_DEGREES):
        parser.error(f"--nproc={args.nproc} must be a multiple of {max(EP_DEGREES)} (ep up to {max(EP_DEGREES)})")

    import torch

    result: dict = {"benchmark": "moe", "config": {k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items() if k != "worker"}}
    result["config"]["defaults"] = {k: v for k, v in vars(parser.parse_args([])).items()
                                    if k in ("runs", "steps", "warmup") and v != getattr(args, k)}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-moe-") as tmp:
        if torch.cuda.is_available():
            print("GPU: dense and MoE bf16 on one device")
            result["gpu"] = bench_gpu(args, Path(tmp))
        else:
            result["gpu"] = "no GPU"
        if not args.skip_cpu:
            os.environ.update(cpu_env())
            torch.set_num_threads(1)
            print(f"CPU: {args.runs} rounds × ep {EP_DEGREES} on {args.nproc} processes, {args.steps} steps each")
            result["cpu"] = bench_cpu(args, Path(tmp) / "cpu")
    c, g = result.get("cpu"), result["gpu"]
    result["summary"] = {
        "ep_max_abs_loss_diff": c and c["ep_max_abs_loss_diff"],
        "tokens_per_s_ep1": c and c["median_tokens_per_s"]["ep1"],
        "tokens_per_s_ep2": c and c["median_tokens_per_s"]["ep2"],
        "tokens_per_s_ep4": c and c["median_tokens_per_s"]["ep4"],
        "ratio_ep2_vs_ep1": c and c["ratio_vs_ep1"]["ep2"],
        "ratio_ep4_vs_ep1": c and c["ratio_vs_ep1"]["ep4"],
        "balance_max_over_mean_first_quarter": c and c["balance_first_quarter"]["max_over_mean"],
        "balance_max_over_mean_last_quarter": c and c["balance_last_quarter"]["max_over_mean"],
        "gpu": g if isinstance(g, str) else g["device"],
        "gpu_dense_tokens_per_s": None if isinstance(g, str) else g["models"]["dense llama-1b"]["tokens_per_s"],
        "gpu_dense_mfu": None if isinstance(g, str) else g["models"]["dense llama-1b"]["mfu"],
    }
    if not isinstance(g, str):
        moe_name = next(n for n in g["models"] if n.startswith("moe"))
        result["summary"].update(gpu_moe_tokens_per_s=g["models"][moe_name]["tokens_per_s"],
                                 gpu_moe_mfu=g["models"][moe_name]["mfu"])
    path = write_results(args.out, result)
    print_table(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
