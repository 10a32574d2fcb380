"""Backends: where nodes come from. `make_backend(spec, paths)` picks the one a cluster spec names; policy
only ever holds a `Backend` (base.py)."""

from __future__ import annotations

from phalanx.control.backends.base import Backend


def make_backend(spec, paths) -> Backend:
    """The backend of `spec.backend` for the cluster at `paths`; SpecError for one not built yet."""
    from phalanx.control.spec import check_backend_supported

    check_backend_supported(spec)
    from phalanx.control.backends.local import LocalBackend

    return LocalBackend(paths, spec)


__all__ = ["Backend", "make_backend"]
