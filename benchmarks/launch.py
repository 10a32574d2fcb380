"""`phalanx train --nproc N`: ranks forked from one worker template vs each rank exec'd (`PHALANX_LAUNCH_FORK=0`),
run side by side in alternating order.

Each run is the real CLI (`python -m phalanx.cli train`) on the tiny recipe (fp32, 2 layers, vocab 512) and the
bundled demo corpus, `--steps` steps, one checkpoint at the end. Measured per run: the command's wall time, and
the time from the command's start to rank 0's first committed step (metrics.jsonl's first step record). Summary:
medians per way and the ratios forked ÷ exec'd (below 1: forking is faster).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/launch.py --nproc 4 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, cpu_env, median, write_results  # noqa: E402

WAYS = {"forked": "1", "execd": "0"}


def recipe(work: Path, data: Path, run_dir: Path, steps: int) -> Path:
    tree = {
        "run_dir": str(run_dir), "seed": 7, "precision": "fp32",
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512, "n_layers": 2}},
        "data": {"path": str(data)},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "log_interval": 1},
        "optimizer": {"lr": 3e-3},
        "checkpoint": {"interval": 0},
    }
    path = work / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def first_step_at(run_dir: Path) -> float | None:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and "time" in record:
            return record["time"]
    return None


def one_run(work: Path, data: Path, way: str, nproc: int, steps: int, index: int) -> dict:
    run_dir = work / f"{way}-{index}"
    path = recipe(work, data, run_dir, steps)
    env = {**cpu_env(), "PHALANX_LAUNCH_FORK": WAYS[way]}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli", "train", str(path), "--nproc", str(nproc)], env=env,
                          cwd=work, capture_output=True, text=True, timeout=600)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{way} run {index} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    first = first_step_at(run_dir)
    return {"way": way, "index": index, "wall_s": round(wall, 3),
            "first_step_s": round(first - started, 3) if first is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="runs per way, in alternating order")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "launch.json")
    args = parser.parse_args()

    from phalanx.data import prepare, write_demo_corpus

    with tempfile.TemporaryDirectory(prefix="phalanx-launch-") as tmp:
        work = Path(tmp)
        data = work / "demo"
        prepare([write_demo_corpus(work / "corpus.jsonl")], data, block_size=64, vocab_size=512, val_percent=0.0,
                progress=False)
        runs = []
        for i in range(args.runs):
            for way in (("forked", "execd") if i % 2 == 0 else ("execd", "forked")):
                runs.append(one_run(work, data, way, args.nproc, args.steps, i))
                print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for way in WAYS:
        mine = [r for r in runs if r["way"] == way]
        summary[f"{way}_wall_s"] = median([r["wall_s"] for r in mine])
        summary[f"{way}_first_step_s"] = median([r["first_step_s"] for r in mine if r["first_step_s"] is not None])
    for key in ("wall_s", "first_step_s"):
        if summary[f"execd_{key}"]:
            summary[f"forked_over_execd_{key}"] = round(summary[f"forked_{key}"] / summary[f"execd_{key}"], 3)
    print(json.dumps(summary, indent=1))
    write_results(args.out, {"benchmark": "launch", "nproc": args.nproc, "steps": args.steps, "runs": runs,
                             "summary": summary, "command": " ".join([Path(sys.executable).name, *sys.argv])})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
