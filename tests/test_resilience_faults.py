"""Which failures checkpointless recovery handles (`phalanx.resilience.faults`): typed ones by type, torch's
untyped gloo failures mapped to PeerFault — checked against what torch really raises when a peer dies — and
this rank's own errors left alone."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import torch.distributed as dist

from phalanx.resilience.faults import PeerFault, is_peer_fault, peer_fault
from phalanx.resilience.membership import Superseded
from phalanx.resilience.restore import IntegrityError


def test_typed_failures_are_peer_faults_as_they_are():
    for err in (dist.DistNetworkError("x"), dist.DistStoreError("x"), dist.DistBackendError("x"), TimeoutError("x"),
                Superseded(1, 2), IntegrityError("x"), PeerFault("x")):
        assert peer_fault(err) is err, err


def test_untyped_transport_failures_become_peer_faults_and_own_errors_do_not():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    fault = peer_fault(gloo)
    assert isinstance(fault, PeerFault) and fault.__cause__ is gloo and str(fault) == str(gloo)
    for own in (RuntimeError("shape mismatch"), ValueError("gloo"), KeyError("peer"), AssertionError("x")):
        assert peer_fault(own) is None and not is_peer_fault(own), own


PEER_DIES = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from phalanx.resilience.faults import peer_fault
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    try:
        dist.all_reduce(t)
        print("no error")
    except Exception as err:
        print("classified:", type(peer_fault(err)).__name__, "raised:", type(err).__name__)
    sys.stdout.flush()
    os._exit(0)
""")


def test_what_gloo_raises_when_a_peer_dies_is_a_peer_fault():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", PEER_DIES, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    out = procs[0].communicate(timeout=60)[0]
    procs[1].wait(timeout=60)
    # torch 2.13 raises a plain RuntimeError (gloo's "Connection closed by peer"): if a later torch gives it a
    # type, PeerFault's mapping is no longer needed for it
    assert "classified: PeerFault raised: RuntimeError" in out or "classified: Dist" in out, out
