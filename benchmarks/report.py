"""What every Phalanx benchmark records next to its figures: the machine, versions, and the JSON file.

`machine_info()` describes where a result was measured (CPU, cores, memory, Python/torch/numpy, git
commit); `write_results(path, payload)` adds that description and writes the JSON atomically. The
benchmarks themselves decide what they measure; this module knows nothing about training or data.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def cpu_env() -> dict[str, str]:
    """Environment for CPU benchmark processes: one intra-op thread, gloo over loopback."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict:
    import numpy
    import torch

    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "git_commit": _git_commit(),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def write_results(path: Path, payload: dict) -> Path:
    """Write `payload` (+ machine, torch version, timestamp) as JSON to `path`, atomically."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "torch_version": torch.__version__,
        **payload,
    }
    _write_json(path, record)
    return path


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def summary_of(path: Path, prefix: str) -> dict:
    """The `prefix*` keys of another result file's summary, with where and when they were measured (for a
    figure measured by its own script but reported in a shared summary, like torchft's in recovery.json)."""
    path = Path(path)
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    keys = {k: v for k, v in record.get("summary", {}).items() if k.startswith(prefix)}
    if keys:
        keys[f"{prefix}measured_by"] = f"{path.name} ({record.get('created')}, {record.get('command')})"
    return keys


def merge_summary(path: Path, keys: dict) -> None:
    """Add `keys` to the summary of the result file at `path`, if it exists (atomically)."""
    path = Path(path)
    if not path.is_file() or not keys:
        return
    record = json.loads(path.read_text())
    record.setdefault("summary", {}).update(keys)
    _write_json(path, record)
