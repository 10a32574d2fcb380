"""On one GPU, through the CLI users run: `phalanx train` (NCCL, bf16) to 30 steps twice, and the same run stopped
at 15 and resumed from its checkpoint to 30. Reports whether the resumed steps' losses equal the uninterrupted
run's bit for bit (the CPU suite asserts it for gloo and fp32: tests/test_train.py), and how far apart they are
if not. Needs a CUDA GPU; CI has none, so this is a check run by hand, not a test.

    python benchmarks/gpu_resume.py --out benchmarks/results/gpu_resume.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import REPO_ROOT, RESULTS_DIR, write_results  # noqa: E402

RECIPE = REPO_ROOT / "recipes" / "tiny-llama.yaml"


def train(run_dir: Path, data: Path, max_steps: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "phalanx.cli", "train", str(RECIPE), f"run_dir={run_dir}", f"data.path={data}",
           f"training.max_steps={max_steps}", "lr_schedule.total_steps=30", "checkpoint.interval=15", "training.log_interval=15", *extra,
           "--nproc", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def losses(run_dir: Path) -> dict[int, float]:
    from phalanx.train.metrics import read_metrics

    steps, _ = read_metrics(run_dir)
    return {r["step"]: r["loss"] for r in steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu_resume.json")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_resume.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from phalanx.data import prepare, write_demo_corpus

    with tempfile.TemporaryDirectory(prefix="phalanx-gpu-resume-") as tmp:
        work = Path(tmp)
        data = work / "demo"
        prepare([write_demo_corpus(work / "corpus.jsonl")], data, progress=False)  # = phalanx data prepare --demo
        extra = [f"precision={args.precision}"]
        train(work / "whole", data, 30, extra)
        train(work / "again", data, 30, extra)  # the same run again: is the GPU run deterministic at all?
        train(work / "split", data, 15, extra)
        train(work / "split", data, 30, extra)
        whole, again, split = losses(work / "whole"), losses(work / "again"), losses(work / "split")
        events = [json.loads(line) for line in (work / "split" / "metrics.jsonl").read_text().splitlines()
                  if '"event"' in line]
    resumed = [e for e in events if e.get("event") == "resumed"]
    diffs = {s: abs(whole[s] - split[s]) for s in range(1, 31)}
    result = {
        "device": torch.cuda.get_device_name(0), "precision": args.precision,
        "resumed_from_step": resumed[0]["step"] if resumed else None,
        "losses_whole": whole, "losses_again": again, "losses_split": split,
        "bit_exact": all(whole[s] == split[s] for s in range(1, 31)),
        "max_abs_loss_diff": max(diffs.values()),
        "repeat_bit_exact": all(whole[s] == again[s] for s in range(1, 31)),
        "repeat_max_abs_loss_diff": max(abs(whole[s] - again[s]) for s in range(1, 31)),
        "loss_first_last": [whole[1], whole[30]],
    }
    print(f"{result['device']} {args.precision}: resumed from step {result['resumed_from_step']}; steps 1-30 "
          f"bit-exact: {result['bit_exact']} (max |diff| {result['max_abs_loss_diff']:.3g}); the same run twice: "
          f"{result['repeat_bit_exact']} (max |diff| {result['repeat_max_abs_loss_diff']:.3g}); loss "
          f"{whole[1]:.3f} -> {whole[30]:.3f}")
    write_results(args.out, {"command": "python " + " ".join(sys.argv), "config": {"recipe": str(RECIPE.name)},
                             "result": result, "summary": {k: result[k] for k in
                                                           ("device", "bit_exact", "max_abs_loss_diff", "repeat_bit_exact")}})


if __name__ == "__main__":
    main()
