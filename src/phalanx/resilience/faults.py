"""Which failures checkpointless recovery handles: a peer's fault — a collective or store operation failed
because a peer died, hung or lost its connection, the generation was superseded, a state received from a peer
failed its checksum — as opposed to this rank's own error (a bug, a bad batch), which ends the process (the
controller then restarts the job from its checkpoint).

By type wherever there is one: `torch.distributed.DistError` (with DistBackendError, DistNetworkError,
DistStoreError), DCP's `CheckpointException`, `TimeoutError`, `Superseded`, `IntegrityError`, `PeerFault`.
Torch reports some peer failures as plain RuntimeError; `peer_fault()` is the one place that recognises those
(by their message: there is nothing else to tell them by) and maps them to `PeerFault`.

Knows nothing about models, training state, the training loop or the controller.
"""

from __future__ import annotations

import torch.distributed as dist

from phalanx.resilience.membership import Superseded
from phalanx.resilience.restore import IntegrityError


class PeerFault(RuntimeError):
    """A peer's failure that torch reported without a type of its own (see `peer_fault`), or one found off the
    training thread (a buddy snapshot's exchange) and raised again on it."""


def _typed() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [PeerFault, Superseded, IntegrityError, TimeoutError]
    kinds += [getattr(dist, n) for n in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
              if hasattr(dist, n)]
    try:  # DCP wraps each rank's failure (a checkpoint save or load interrupted by a peer's death)
        from torch.distributed.checkpoint.api import CheckpointException

        kinds.append(CheckpointException)
    except ImportError:  # pragma: no cover
        pass
    return tuple(kinds)


PEER_FAULT_TYPES = _typed()

# Peer failures torch raises as plain RuntimeError, told apart by their message alone:
_UNTYPED_PEER_FAILURE_WORDS = (
    # gloo (the CPU backend, and the host-memory transfers beside NCCL): gloo's C++ exceptions reach Python as
    # RuntimeError carrying gloo's source path. Checked on torch 2.13 with two processes, one SIGKILLed or
    # hung: all_reduce, barrier, send/recv, isend/irecv, all_to_all, all_gather_object, broadcast_object_list,
    # FSDP's all-gather and a DCP save all raise "[.../third_party/gloo/gloo/transport/tcp/pair.cc:553]
    # Connection closed by peer [...]"; a hung peer gives "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed
    # out waiting 5000ms for recv operation to complete".
    "gloo", "Gloo",
    # the same transport failures worded without gloo's path (a reset or closed socket under a send, a
    # timeout), as the torch versions before the Dist* types reported them
    "Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out", "Socket", "socket", "peer",
    # NCCL and the c10d process-group layer: torch raises DistBackendError for NCCL's own errors, but not
    # every failed or aborted work a process group reports is typed (GPU only: not exercised by the CPU tests)
    "NCCL", "ProcessGroup",
)


def peer_fault(err: BaseException) -> BaseException | None:
    """`err` itself when its type says it is a peer fault; a `PeerFault` (caused by `err`) when it is one of
    torch's untyped reports of one; None when it is this rank's own error."""
    if isinstance(err, PEER_FAULT_TYPES):
        return err
    if isinstance(err, RuntimeError) and any(w in str(err) for w in _UNTYPED_PEER_FAILURE_WORDS):
        fault = PeerFault(str(err))
        fault.__cause__ = err
        return fault
    return None


def is_peer_fault(err: BaseException) -> bool:
    """A failure recovery handles (see `peer_fault`)."""
    return peer_fault(err) is not None
