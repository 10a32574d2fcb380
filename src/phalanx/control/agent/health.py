"""Node health checks, run by the agent on a schedule. Each returns pass / fail / skipped with a detail.

- host:     free disk in the node's work dir, available memory
- workers:  the job workers the agent runs now are alive or exited 0 (informational: the scheduler already
            judges each exit from the heartbeat's worker reports)
- gpu:      via NVML when `pynvml` is importable: device count vs the instance type, uncorrected ECC
            errors, and XID events, mapped to an action the way HyperPod maps them (replace the node, or
            only restart the job); where CUDA_VISIBLE_DEVICES limits what this agent's workers may use (Slurm
            sets it for a step that holds GPUs), enough of them for one worker per GPU. Skipped with a reason
            when the instance type expects no GPUs.
- deep:     not here: a timed all_reduce across nodes needs the controller to pair them
            (`deep_check.py`); its verdict is the node's transition to healthy or faulty.

A failed check carries an `action`: "replace-node" (the node goes faulty) or "restart-job" (the node
stays; its job restarts). Imports nothing heavy: agents must start in a fraction of a second. Knows
nothing about HTTP or the controller.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPLACE_NODE = "replace-node"
RESTART_JOB = "restart-job"

# XIDs that mean the hardware is bad (replace) vs. an application-level fault (restart the job only).
# After NVIDIA's XID catalogue and HyperPod's health-monitoring agent.
XID_REPLACE_NODE = {48, 61, 62, 63, 64, 74, 79, 92, 95, 119, 120, 140}
XID_RESTART_JOB = {13, 31, 43, 45, 68, 94}


@dataclass
class Check:
    name: str
    status: str  # "pass" | "fail" | "skipped"
    detail: str
    action: str | None = None  # for failures: REPLACE_NODE, RESTART_JOB, or None (informational)

    def as_dict(self) -> dict:
        return asdict(self)


def check_disk(work_dir: Path, min_free_mb: int) -> Check:
    free_mb = shutil.disk_usage(work_dir).free // 2**20
    if free_mb < min_free_mb:
        return Check("host.disk", "fail", f"{free_mb} MiB free in {work_dir}, need {min_free_mb} MiB", REPLACE_NODE)
    return Check("host.disk", "pass", f"{free_mb} MiB free in {work_dir}")


def available_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except FileNotFoundError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20


def check_memory(min_free_mb: int) -> Check:
    mb = available_memory_mb()
    if mb < min_free_mb:
        return Check("host.memory", "fail", f"{mb} MiB available, need {min_free_mb} MiB", REPLACE_NODE)
    return Check("host.memory", "pass", f"{mb} MiB available")


def check_workers(workers: dict[int, int | None]) -> Check:
    """`workers`: local rank → exit code (None while running)."""
    if not workers:
        return Check("workers", "pass", "no workers assigned")
    dead = {r: c for r, c in workers.items() if c is not None and c != 0}
    if dead:
        # no action: the scheduler already judges each exit from the heartbeat's worker reports (this check
        # may also run between generations, before the agent learns its next assignment)
        return Check("workers", "fail", f"workers exited: {dead}")
    return Check("workers", "pass", f"{len(workers)} workers alive")


class GpuMonitor:
    """NVML state kept for the agent's lifetime, so XID events between two checks are not lost."""

    def __init__(self, expected_gpus: int, instance_type: str):
        self.expected = expected_gpus
        self.instance_type = instance_type
        self._nvml = None
        self._handles: list = []
        self._events = None
        self._init_error: str | None = None
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            self._init_error = "pynvml is not importable (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except pynvml.NVMLError as err:
            self._init_error = f"NVML unavailable: {err}"
            return
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._events)
        except pynvml.NVMLError as err:  # not supported on every driver / device
            self._events = None
            self._xid_note = f"XID events unavailable: {err}"
        else:
            self._xid_note = "no XID events"

    def check(self) -> list[Check]:
        if self.expected == 0:
            why = self._init_error or f"{len(self._handles)} GPUs visible"
            return [Check("gpu", "skipped", f"instance type {self.instance_type} expects no GPUs ({why})")]
        if self._nvml is None:
            return [Check("gpu", "fail", f"instance type {self.instance_type} expects {self.expected} GPUs but "
                                         f"{self._init_error}", REPLACE_NODE)]
        return [self._count(), *self._visible(), self._ecc(), self._xids()]

    def _count(self) -> Check:
        n = len(self._handles)
        if n < self.expected:
            return Check("gpu.count", "fail", f"{n} GPUs visible, instance type {self.instance_type} expects "
                                              f"{self.expected}", REPLACE_NODE)
        return Check("gpu.count", "pass", f"{n} GPUs visible (expected {self.expected})")

    def _visible(self) -> list[Check]:
        """NVML sees every GPU of the host; the workers see only those CUDA_VISIBLE_DEVICES lists (when set: what
        Slurm gave the agents' step), and worker i takes the i-th. Fewer than the instance type's workers: the
        last ones would fail at start, so the node fails here, saying how to fix it."""
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is None:
            return []
        n = len([d for d in listed.split(",") if d.strip()])
        if n < self.expected:
            return [Check("gpu.visible", "fail", f"this agent's workers may use {n} GPUs (CUDA_VISIBLE_DEVICES="
                                                 f"{listed!r}; under Slurm, what the allocation gave the step) but "
                                                 f"instance type {self.instance_type} runs {self.expected} workers, "
                                                 f"one per GPU: ask Slurm for {self.expected} GPUs per node (leave "
                                                 f"the GPU request out of slurm.sbatch_options) or choose an "
                                                 f"instance type of at most {n} GPUs", REPLACE_NODE)]
        return [Check("gpu.visible", "pass", f"{n} GPUs for the workers (CUDA_VISIBLE_DEVICES={listed})")]

    def _ecc(self) -> Check:
        nv, bad, unsupported = self._nvml, {}, 0
        for i, h in enumerate(self._handles):
            try:
                n = nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
            except nv.NVMLError:
                unsupported += 1
                continue
            if n:
                bad[i] = n
        if bad:
            return Check("gpu.ecc", "fail", f"uncorrected ECC errors by GPU index: {bad}", REPLACE_NODE)
        if unsupported == len(self._handles):
            return Check("gpu.ecc", "skipped", "ECC counters not supported on these GPUs")
        return Check("gpu.ecc", "pass", "no uncorrected ECC errors")

    def _xids(self) -> Check:
        if self._events is None:
            return Check("gpu.xid", "skipped", self._xid_note)
        nv, xids = self._nvml, []
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            xids.append(int(data.eventData))
        return xid_check(xids) if xids else Check("gpu.xid", "pass", self._xid_note)


def xid_check(xids: list[int], source: str = "") -> Check:
    """XID events seen since the last check → the action they call for: a hardware XID replaces the node;
    any other (an application-level fault: 13, 31, 43, …) restarts the job on the same nodes."""
    replace = sorted(x for x in xids if x in XID_REPLACE_NODE)
    if replace:
        return Check("gpu.xid", "fail", f"XID {replace}{source}: hardware fault", REPLACE_NODE)
    return Check("gpu.xid", "fail", f"XID {sorted(set(xids))}{source}: application-level fault", RESTART_JOB)


def injected_failure(kind: str) -> Check:
    return Check("injected", "fail", f"fault injected by operator ({kind}): this node reports a failing check",
                 REPLACE_NODE)


def restart_job_failures(health: dict | None, since: float) -> list[dict]:
    """Failed checks of a health report taken at or after `since` whose action is to restart the job."""
    if not health or health.get("checked_at", 0) < since:
        return []
    return [c for c in health["checks"] if c["status"] == "fail" and c.get("action") == RESTART_JOB]


def report(checks: list[Check]) -> dict:
    """The health section of a heartbeat. `ok` is false when any failure asks for the node's replacement."""
    failed = [c for c in checks if c.status == "fail" and c.action == REPLACE_NODE]
    return {"ok": not failed, "checked_at": time.time(), "checks": [c.as_dict() for c in checks]}


def summarize_failure(health: dict) -> str:
    failed = [c for c in health["checks"] if c["status"] == "fail" and c.get("action") == REPLACE_NODE]
    return "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
