"""How a process that used torch.distributed leaves: once its work is saved, flushed and released, without
interpreter teardown.

Teardown can destroy C++ objects of torch.distributed (gloo work threads, a process group kept alive by a
module or a DTensor cache that held it, groups of earlier generations) whose destructors abort the process
("terminate called without an active exception"). A finished run would then exit with SIGABRT, and its
launcher or the controller would take it for a crash. Standard library only: knows nothing about training,
recovery or the controller.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_without_teardown(code: int) -> None:
    """Flush stdout, stderr and logging, then `os._exit(code)`. Call it only when everything that must reach
    disk has (files closed, checkpoints committed): no atexit handler or finalizer runs after it."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
