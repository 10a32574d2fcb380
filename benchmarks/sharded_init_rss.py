"""Peak memory per rank of Phalanx's delayed (meta-device) init of a 7B model on CPU ranks.

Each of `--nproc` gloo ranks builds `Transformer(get_preset(PRESET))` on the meta device, casts it to
bf16 (still on meta), shards it with `phalanx.parallel.apply_fsdp` over the mesh of
`build_mesh(ParallelDims(nproc))` (precision bf16), then `materialize(model, "cpu",
random_init_source(model, seed))`. Per rank it records the local numel against total ÷ nproc, the local
bytes, the peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`) before and after `materialize`, the resident
set after it, and the wall time of `materialize`. The whole model in bf16 is given for comparison: no
rank may come near it. The parent also samples the machine's MemAvailable to report the job's total.

Heavy (about 15 GB across 4 ranks for mistral-7b); not run in CI. Check `free -g` first.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sharded_init_rss.py            # one run, 4 ranks
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, cpu_env, median, write_results  # noqa: E402
from phalanx.process import exit_without_teardown  # noqa: E402

GIB = 2**30


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- one rank ----------------------------------------------------------------------------------
def worker(preset: str, seed: int, out_dir: Path) -> None:
    import torch
    import torch.distributed as dist

    from phalanx.models import Transformer, get_preset
    from phalanx.parallel import ParallelDims, apply_fsdp, build_mesh, materialize, random_init_source

    torch.set_num_threads(1)
    rss_at_start = peak_rss_bytes()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(get_preset(preset))
    model.to(torch.bfloat16)
    total_numel = sum(p.numel() for p in model.parameters())
    mesh = build_mesh(ParallelDims(world), "cpu")
    apply_fsdp(model, mesh, precision="bf16")
    build_s = time.perf_counter() - start
    dist.barrier()

    peak_before, rss_before = peak_rss_bytes(), current_rss_bytes()
    start = time.perf_counter()
    local_numel = materialize(model, "cpu", random_init_source(model, seed))
    materialize_s = time.perf_counter() - start
    peak_after, rss_after = peak_rss_bytes(), current_rss_bytes()

    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    dtypes = sorted({str(t.dtype) for t in locals_})
    record = {
        "rank": rank,
        "world_size": world,
        "total_numel": total_numel,
        "local_numel": local_numel,
        "expected_local_numel": total_numel / world,
        "local_param_bytes": sum(t.numel() * t.element_size() for t in locals_),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "param_dtypes": dtypes,
        "devices": sorted({str(t.device) for t in locals_}),
        "peak_rss_bytes_at_start": rss_at_start,
        "peak_rss_bytes_before_materialize": peak_before,
        "rss_bytes_before_materialize": rss_before,
        "peak_rss_bytes_after_materialize": peak_after,
        "rss_bytes_after_materialize": rss_after,
        "build_and_shard_on_meta_s": build_s,
        "materialize_s": materialize_s,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ---- the job -----------------------------------------------------------------------------------
class MemoryWatch:
    """Samples MemAvailable in a thread; `drop_bytes` = how far it fell below the starting value."""

    def __init__(self, interval_s: float = 0.2):
        self.start_bytes = self.min_bytes = mem_available_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.min_bytes = min(self.min_bytes, mem_available_bytes())

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def drop_bytes(self) -> int:
        return self.start_bytes - self.min_bytes


def run_job(args) -> dict:
    from phalanx.train.launch import free_port

    with tempfile.TemporaryDirectory(prefix="phalanx-init-rss-") as tmp:
        out_dir, port = Path(tmp), free_port()
        start = time.perf_counter()
        with MemoryWatch() as watch:
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", str(out_dir), "--preset", args.preset, "--seed", str(args.seed)],
                    env={**cpu_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.nproc),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                )
                for r in range(args.nproc)
            ]
            codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed (exit codes {codes})")
        ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    return {
        "ranks": ranks,
        "job_wall_s": time.perf_counter() - start,
        "mem_available_start_bytes": watch.start_bytes,
        "mem_available_min_bytes": watch.min_bytes,
        "mem_available_drop_bytes": watch.drop_bytes,
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s, run = result["summary"], result["runs"][-1]
    table = Table(title=f"RSS in GiB — delayed init of {result['config']['preset']} (bf16) on {result['config']['nproc']} CPU ranks")
    for col in ("rank", "local numel", "total ÷ N", "local GiB", "peak RSS before", "peak RSS after",
                "RSS after", "materialize s"):
        table.add_column(col, justify="right")
    for r in run["ranks"]:
        table.add_row(
            str(r["rank"]), f"{r['local_numel']:,}", f"{r['expected_local_numel']:,.0f}",
            f"{r['local_param_bytes'] / GIB:.2f}", f"{r['peak_rss_bytes_before_materialize'] / GIB:.2f}",
            f"{r['peak_rss_bytes_after_materialize'] / GIB:.2f}", f"{r['rss_bytes_after_materialize'] / GIB:.2f}",
            f"{r['materialize_s']:.1f}",
        )
    table.caption = (
        f"whole model bf16: {s['full_model_bf16_gib']:.2f} GiB ({s['total_numel']:,} params); "
        f"max peak RSS per rank {s['peak_rss_gib_max']:.2f} GiB = {s['peak_rss_over_full_model']:.2f} × whole model; "
        f"all ranks {s['peak_rss_gib_sum']:.2f} GiB; machine MemAvailable fell {s['mem_available_drop_gib']:.2f} GiB"
    )
    console = Console()
    console.width = max(console.width, 120)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="repetitions (each is a fresh job; heavy)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--preset", default="mistral-7b")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--min-free-gib", type=float, default=18.0, help="refuse to start with less MemAvailable")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sharded_init_rss.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.seed, args.worker)
        exit_without_teardown(0)  # teardown can abort in a gloo destructor (phalanx.process)

    free = mem_available_bytes() / GIB
    if free < args.min_free_gib:
        raise SystemExit(f"only {free:.1f} GiB available, need {args.min_free_gib} (--min-free-gib); "
                         "wait for other jobs to finish")
    print(f"MemAvailable {free:.1f} GiB; {args.runs} run(s) of {args.nproc} ranks, preset {args.preset}")
    runs = [run_job(args) for _ in range(args.runs)]
    first = runs[0]["ranks"][0]
    peaks = [r["peak_rss_bytes_after_materialize"] for run in runs for r in run["ranks"]]
    total_numel = first["total_numel"]
    summary = {
        "total_numel": total_numel,
        "full_model_bf16_gib": total_numel * 2 / GIB,
        "local_param_gib": max(r["local_param_bytes"] for r in runs[-1]["ranks"]) / GIB,
        "local_numel_equals_expected": all(r["local_numel"] == r["expected_local_numel"] for run in runs for r in run["ranks"]),
        "peak_rss_gib_max": max(peaks) / GIB,
        "peak_rss_gib_before_materialize_max": max(
            r["peak_rss_bytes_before_materialize"] for run in runs for r in run["ranks"]) / GIB,
        "peak_rss_gib_sum": median([sum(r["peak_rss_bytes_after_materialize"] for r in run["ranks"]) for run in runs]) / GIB,
        "peak_rss_over_full_model": max(peaks) / (total_numel * 2),
        "materialize_s": median([max(r["materialize_s"] for r in run["ranks"]) for run in runs]),
        "mem_available_drop_gib": median([run["mem_available_drop_bytes"] for run in runs]) / GIB,
    }
    result = {
        "benchmark": "sharded_init_rss",
        "config": {"preset": args.preset, "nproc": args.nproc, "precision": "bf16", "seed": args.seed,
                   "runs": args.runs, "mesh": f"build_mesh(ParallelDims({args.nproc}))", "backend": "gloo"},
        "runs": runs,
        "summary": summary,
    }
    print_table(result)
    print(f"wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
