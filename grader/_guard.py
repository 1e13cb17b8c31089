"""The in-process half of the independence gate (DESIGN section 8). Standard library only.

run_sandboxed copies this file into the sandbox and the child's bootstrap imports it before
anything else: it blocks the forbidden imports with a meta-path finder (and makes
importlib.util.find_spec report them absent, as on a machine without them), makes sockets unable
to connect, hides the repo's own packages (editable installs, repo-root path entries), then calls
the candidate's entry. A sitecustomize beside it re-installs the same guard in any Python process the
candidate spawns without -I/-S; the gate's contract is the child itself, that part is best effort.

Configuration travels in environment variables, so sitecustomize needs no arguments.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import socket
import sys

IMPORT_MARK = "t2j-gate: blocked import"         # run_sandboxed reads this in stderr -> "torch import"
NETWORK_MARK = "t2j-gate: network access blocked"  # -> "network access"
ENV_FORBIDDEN = "T2J_GATE_FORBIDDEN"  # comma-separated top-level package names
ENV_HIDE = "T2J_GATE_HIDE"            # os.pathsep-separated directories to drop from sys.path


class BlockForbidden(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: refuses a forbidden package and every submodule of it."""

    def __init__(self, forbidden):
        self.forbidden = frozenset(forbidden)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.forbidden:
            raise ModuleNotFoundError(
                f"{IMPORT_MARK} of {fullname!r}: a candidate must not import "
                f"{', '.join(sorted(self.forbidden))} (torch import)", name=fullname)
        return None


def _absent_from_find_spec(blocker: BlockForbidden) -> None:
    # Availability probes (`importlib.util.find_spec("torch") is None`, as optional-dependency
    # code does) see the forbidden packages as not installed instead of crashing on the finder.
    real_find_spec = importlib.util.find_spec

    def find_spec(name, package=None):
        if not name.startswith(".") and name.partition(".")[0] in blocker.forbidden:
            return None
        return real_find_spec(name, package)

    importlib.util.find_spec = find_spec


def _refuse(*args, **kwargs):
    raise PermissionError(f"{NETWORK_MARK}: sockets cannot connect in the candidate sandbox")


def block_network() -> None:
    socket.socket.connect = _refuse
    socket.socket.connect_ex = _refuse
    socket.socket.sendto = _refuse  # connectionless UDP would otherwise still reach out
    socket.create_connection = _refuse


def _is_editable(obj) -> bool:
    # setuptools' editable installs add a meta-path finder, a path hook and a placeholder path
    # entry, all from a module named __editable___<dist>_finder; they map the repo's own
    # packages (oracles, torch_sources) into any process of this interpreter.
    return str(getattr(obj, "__module__", "")).startswith("__editable__")


def hide_repo(hide_dirs=()) -> None:
    hidden = {os.path.realpath(d) for d in hide_dirs if d}
    sys.meta_path[:] = [f for f in sys.meta_path if not _is_editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not _is_editable(h)]
    sys.path[:] = [p for p in sys.path if not str(p).startswith("__editable__")
                   and os.path.realpath(p or ".") not in hidden]
    sys.path_importer_cache.clear()


def install(forbidden=None, hide_dirs=None) -> None:
    if forbidden is None:
        forbidden = [n for n in os.environ.get(ENV_FORBIDDEN, "").split(",") if n]
    if hide_dirs is None:
        hide_dirs = [d for d in os.environ.get(ENV_HIDE, "").split(os.pathsep) if d]
    hide_repo(hide_dirs)
    blocker = BlockForbidden(forbidden)
    sys.meta_path.insert(0, blocker)
    for name in list(sys.modules):  # anything a .pth file may have loaded before us
        if name.partition(".")[0] in blocker.forbidden:
            del sys.modules[name]
    _absent_from_find_spec(blocker)
    block_network()


def run_entry(entry: str, inputs_path: str, outputs_path: str):
    """entry = "package.module:function" (the function may be dotted: "module:Class.method")."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ValueError(f"entry {entry!r} is not 'module:function'")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn(inputs_path, outputs_path)
