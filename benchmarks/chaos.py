"""The long chaos soak: `--trials` (default 200) seeded trials of `phalanx chaos` — fault kind × phase × recovery
mode (× layout) — on one local cluster of 4 `local.cpu-1` nodes + 2 spares, each trial a training job with its
faults injected and the invariants checked (finished; losses equal to the failure-free run's, fp32, bit for
bit; steps lost within the mode's bound; no leaked process or port; consistent events). Prints the table and
writes `benchmarks/results/chaos.json` (every trial, the plan, and a top-level `summary`: faults injected and
survived, seed, wall time, counts per kind / mode / phase, the invariants broken).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chaos.py --trials 200 --seed 0

A thin wrapper: the soak itself is `phalanx.chaos`. Evidence of failed trials stays under --work-dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, write_results  # noqa: E402


def main() -> int:
    from rich.console import Console
    from rich.markup import escape

    from phalanx.chaos import JobShape, Settings, make_plan, run_soak
    from phalanx.chaos.report import row, summary_line, trials_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration", type=float, default=None, help="stop starting trials after this many s")
    parser.add_argument("--recovery", choices=("both", "checkpointless", "restart"), default="both")
    parser.add_argument("--layouts", default="hsdp,fsdp", help="checkpointless layouts: hsdp and/or fsdp")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/chaos-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "chaos.json")
    args = parser.parse_args()

    console = Console(highlight=False)
    modes = ("checkpointless", "restart") if args.recovery == "both" else (args.recovery,)
    layouts = tuple(x.strip() for x in args.layouts.split(",") if x.strip())
    shape = JobShape()
    plan = make_plan(args.seed, args.trials, modes=modes, layouts=layouts, shape=shape)
    report = run_soak(plan, args.work_dir, Settings(shape=shape), seed=args.seed, home=args.work_dir / "home",
                      duration_s=args.duration, say=lambda m: console.print(f"[dim]{escape(m)}[/]"),
                      on_trial=lambda r: console.print(" | ".join(row(r))))
    console.print(trials_table(report["trials"], title=f"chaos soak, seed {args.seed}"))
    line = summary_line(report)
    console.print(line)
    s = report["summary"]
    path = write_results(args.out, {
        "benchmark": "chaos",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chaos.py " + " ".join(sys.argv[1:]),
        "summary": {"faults_injected": s["faults_injected"], "faults_survived": s["faults_survived"],
                    "trials": s["trials"], "trials_failed": s["trials_failed"], "seed": args.seed,
                    "wall_s": s["wall_s"], "per_kind": s["per_kind"], "per_mode": s["per_mode"],
                    "per_phase": s["per_phase"], "invariants_broken": s["invariants_broken"],
                    "left_running": report["left_running"], "error": report["error"], "line": line},
        "settings": report["settings"], "references": report["references"], "plan": report["plan"],
        "trials": report["trials"],
    })
    console.print(f"wrote {path}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
