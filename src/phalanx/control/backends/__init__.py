"""Backends: where nodes come from (`local.py`: agents on this machine; `hosts.py`: agents that join from
other hosts; `slurm.py`: Slurm allocates the nodes and starts their agents). `make_backend(spec, paths)`
picks the one a cluster spec names; policy only ever holds a `Backend` (base.py)."""

from __future__ import annotations

from phalanx.control.backends.base import Backend


def make_backend(spec, paths, store=None, links=None) -> Backend:
    """The backend of `spec.backend` for the cluster at `paths` (`store`: the controller's, which the hosts
    and slurm backends read their agents' reports from; `links`: its `AgentLinks`, which tell them an agent ended)."""
    if spec.backend == "slurm":
        from phalanx.control.backends.slurm import SlurmBackend

        return SlurmBackend(paths, spec, store, links)
    if spec.backend == "hosts":
        from phalanx.control.backends.hosts import HostsBackend

        return HostsBackend(paths, spec, store, links)
    from phalanx.control.backends.local import LocalBackend

    return LocalBackend(paths, spec)


__all__ = ["Backend", "make_backend"]
