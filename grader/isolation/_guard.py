"""The in-process half of the independence gate (DESIGN section 8). Standard library only (h5py,
when installed, has its file entry points audited).

run_sandboxed copies this file into the sandbox and the child's bootstrap imports it before
anything else: it blocks the forbidden imports with a meta-path finder (and makes
importlib.util.find_spec report them absent, as on a machine without them), makes sockets unable
to connect, hides the repo's own packages (editable installs, repo-root path entries), refuses any
file access under the references/ directories with an audit hook, then calls the candidate's entry.
A sitecustomize beside it re-installs the same guard in any Python process the candidate spawns
without -I/-S; the gate's contract is the child itself, that part is best effort.

The references/ barrier works at the Python level: the audit hook, plus the two C paths a
candidate reaches most easily (h5py, os.open with dir_fd). It stops a candidate that opens, lists,
copies, links or h5py-reads the references, or spawns a command naming them; it is no OS boundary
(ctypes, HDF5 external links, or a shell command that spells the path in pieces get past it).
The OS boundary is grader/isolation/sandbox.py: sealed, this guard is the first line that gives precise
reasons, and the deny list is empty (nothing of the repo is in the child's view); it carries the
references/ barrier alone only in trusted mode.

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
REFERENCES_MARK = "t2j-gate: reads references/"  # -> "reads references/"
ENV_DENY = "T2J_GATE_DENY_READ"       # os.pathsep-separated directories the candidate must not touch


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


# ---------------------------------------------------------------- references/ are out of reach
# An audit hook sees every Python-level file access (open, os.open, io.open_code, np.load,
# pathlib, listdir/scandir, links, renames) and cannot be removed once added. Which argument of
# each event is a path:
_PATH_EVENTS = {
    "open": (0,), "os.listdir": (0,), "os.scandir": (0,), "os.chdir": (0,), "os.link": (0, 1),
    "os.rename": (0, 1), "os.symlink": (1,), "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,),
    "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
    "shutil.copyfile": (0, 1), "shutil.copytree": (0, 1), "shutil.rmtree": (0,), "shutil.move": (0, 1),
}
# A spawned program is no Python the hook can follow: refuse one whose command line names the place.
_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn"})


def _strings(value, depth=0):
    if isinstance(value, (str, bytes, os.PathLike)):
        yield os.fsdecode(value)
    elif depth < 2 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v, depth + 1)


def deny_access(deny_dirs) -> None:
    """Refuse (PermissionError carrying REFERENCES_MARK) any audited access under `deny_dirs`."""
    realpath, fsdecode, fspath, getcwd = os.path.realpath, os.fsdecode, os.fspath, os.getcwd  # bound now:
    sep = os.sep                                     # a candidate re-pointing os.path cannot blind the hook
    denied = tuple(sorted({realpath(d) for d in deny_dirs if d} | {os.path.abspath(d) for d in deny_dirs if d}))
    if not denied:
        return

    def inside(path) -> bool:
        if path is None:
            path = getcwd()
        if isinstance(path, int):  # a file descriptor: its path was checked when it was opened
            return False
        try:
            path = realpath(fsdecode(fspath(path)))  # follows symlinks; relative -> cwd
        except (TypeError, ValueError, OSError):
            return False
        return any(path == d or path.startswith(d + sep) for d in denied)

    def hook(event, args):
        where = _PATH_EVENTS.get(event)
        if where is not None:
            bad = next((args[i] for i in where if i < len(args) and inside(args[i])), None)
        elif event in _SPAWN_EVENTS:
            bad = next((s for s in _strings(args) if any(d in s for d in denied)), None)
        else:
            return
        if bad is not None:
            raise PermissionError(f"{REFERENCES_MARK}: {event} {bad!r} refused: the candidate sandbox "
                                  f"cannot read the recorded references")

    sys.addaudithook(hook)
    _audit_dir_fd()
    _audit_hdf5()


def _audit_dir_fd() -> None:
    # The "open" event of os.open carries the path but not dir_fd: a relative path under a directory
    # descriptor would be judged against the cwd. Audit the path the descriptor really names too.
    import posix
    real_open, readlink = posix.open, os.readlink
    if getattr(real_open, "_t2j_audited", False):
        return

    def audited_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None and isinstance(path, (str, bytes, os.PathLike)):
            base = readlink(f"/proc/self/fd/{dir_fd}")
            sys.audit("open", os.path.join(base, os.fsdecode(path)), None, flags)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    audited_open._t2j_audited = True
    os.open = posix.open = audited_open
    if real_open in os.supports_dir_fd:  # shutil and others ask this set what takes dir_fd
        os.supports_dir_fd.add(audited_open)


def _audit_hdf5() -> None:
    # libhdf5 opens files in C, out of the audit hook's sight: route h5py's file entry points through
    # an "open" audit event first. Done before the candidate runs, so it never holds the originals.
    try:
        import h5py.h5f as h5f
    except ImportError:  # no h5py here: nothing to route
        return
    for name in ("open", "create", "is_hdf5"):
        real = getattr(h5f, name)
        if getattr(real, "_t2j_audited", False):
            continue

        def audited(path, *args, _real=real, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)):
                sys.audit("open", path, None, 0)
            return _real(path, *args, **kwargs)

        audited._t2j_audited = True
        setattr(h5f, name, audited)


def install(forbidden=None, hide_dirs=None, deny_dirs=None) -> None:
    if forbidden is None:
        forbidden = [n for n in os.environ.get(ENV_FORBIDDEN, "").split(",") if n]
    if hide_dirs is None:
        hide_dirs = [d for d in os.environ.get(ENV_HIDE, "").split(os.pathsep) if d]
    if deny_dirs is None:
        deny_dirs = [d for d in os.environ.get(ENV_DENY, "").split(os.pathsep) if d]
    hide_repo(hide_dirs)
    blocker = BlockForbidden(forbidden)
    sys.meta_path.insert(0, blocker)
    for name in list(sys.modules):  # anything a .pth file may have loaded before us
        if name.partition(".")[0] in blocker.forbidden:
            del sys.modules[name]
    _absent_from_find_spec(blocker)
    block_network()
    deny_access(deny_dirs)


def run_entry(entry: str, inputs_path: str, outputs_path: str):
    """entry = "package.module:function" (the function may be dotted: "module:Class.method")."""
    module_name, _, attr = entry.partition(":")
    if not module_name or not attr:
        raise ValueError(f"entry {entry!r} is not 'module:function'")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    fn(inputs_path, outputs_path)
    # The outputs are written: leave without interpreter teardown, which can crash after a time limit
    # interrupted JAX mid-initialisation (exit 139 with the answer on disk, seen on L5 budgets).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
