"""The shape docs/architecture.md promises, checked on the source: which package may import which, module
size, and a docstring at the top of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "phalanx"
MODULES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)
MAX_LINES = 400

# package → the packages it must never import (anywhere in the module, function bodies included)
FORBIDDEN = {
    "protocol": ("phalanx.control", "phalanx.train", "phalanx.resilience", "phalanx.models", "phalanx.parallel",
                 "phalanx.data"),
    "control": ("phalanx.train", "phalanx.resilience", "phalanx.models", "phalanx.parallel"),
    "train": ("phalanx.control",),
    "resilience": ("phalanx.control",),
    "models": ("phalanx.control", "phalanx.train", "phalanx.resilience", "phalanx.parallel"),
    "parallel": ("phalanx.control", "phalanx.train", "phalanx.resilience"),
    "observability": ("phalanx.control", "phalanx.train", "phalanx.resilience", "phalanx.models"),
}
# the exceptions, each with its reason
ALLOWED = {
    # `job submit` checks a training recipe with the runtime's own preflight before anything starts
    # (imported inside the function, only for training jobs: the CLI stays torch-free otherwise)
    ("control/client/jobs.py", "phalanx.train.config"),
    ("control/client/jobs.py", "phalanx.train.launch"),
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_their_role_allows(package):
    broken = []
    for path in MODULES:
        if not _rel(path).startswith(package + "/"):
            continue
        for name in _imports(path):
            for banned in FORBIDDEN[package]:
                if _within(name, banned) and not any(_rel(path) == f and _within(name, m) for f, m in ALLOWED):
                    broken.append(f"{_rel(path)} imports {name}")
    assert not broken, "\n".join(sorted(set(broken)))


def test_no_module_is_over_the_size_limit():
    long = {_rel(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by role): {long}"


def test_every_module_opens_with_a_docstring_saying_its_role():
    missing = [_rel(p) for p in MODULES if p.stat().st_size and not (ast.get_docstring(ast.parse(p.read_text()))
                                                                    or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"
