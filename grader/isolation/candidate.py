"""What counts as the candidate, and what it may never be or import (the module doc of grader/isolation/gate.py
says why): the top-level directories jax_oracles/, serving_engine/ and conversion/ when they hold any .py file,
every other top-level regular package, never the grader's own packages, the twin's or one named after a forbidden
one."""
from __future__ import annotations

import os
from pathlib import Path

FORBIDDEN = ("torch", "torchvision", "torchaudio", "transformers", "vllm", "peft", "trl",
             "torch_sources", "recorder")
MIRROR_PACKAGES = ("jax_oracles", "serving_engine", "conversion")
_NEVER_CANDIDATE = frozenset({"references", "tests", "test", "grader", "catalog", "twin", *FORBIDDEN})  # twin: the
# live twin harness (twin/), which runs the torch side and is never part of what it checks


def candidate_packages(candidate_root: str | Path) -> list[Path]:
    """The candidate's top-level package directories, sorted by name (see module doc)."""
    root = Path(candidate_root)
    found = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.is_symlink() or d.name in _NEVER_CANDIDATE:
            continue
        if not d.name.isidentifier():  # .git, .venv, build-1: not importable, not a package
            continue
        if (d / "__init__.py").is_file() or (d.name in MIRROR_PACKAGES and _has_python(d)):
            found.append(d)
    return found


def _has_python(directory: Path) -> bool:
    # a mirror directory may be a namespace package; with no .py file at all it is no package
    return any(f.endswith(".py") for _, _, files in os.walk(directory) for f in files)
