"""A stand-in for NVML (nvidia-ml-py's `pynvml`) on machines without NVIDIA GPUs, for the agents of the Slurm GPU
test (put on their PYTHONPATH): the host has FAKE_NVML_GPUS GPUs (tests/slurm.py's device files standing in for
them). Like real NVML it sees all of them, whatever CUDA_VISIBLE_DEVICES says. No ECC errors, no XID events.
"""

import os


class NVMLError(Exception):
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's name
    pass


NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, nvmlEventTypeXidCriticalError = 1, 0, 8


def nvmlInit():  # noqa: N802
    pass


def nvmlDeviceGetCount():  # noqa: N802
    return int(os.environ.get("FAKE_NVML_GPUS", "0"))


def nvmlDeviceGetHandleByIndex(i):  # noqa: N802
    return i


def nvmlEventSetCreate():  # noqa: N802
    return "events"


def nvmlDeviceRegisterEvents(handle, kind, events):  # noqa: N802
    pass


def nvmlDeviceGetTotalEccErrors(handle, kind, counter):  # noqa: N802
    return 0


def nvmlEventSetWait_v2(events, timeout_ms):  # noqa: N802
    raise NVMLError_Timeout()
