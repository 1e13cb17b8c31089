"""The independence gate of DESIGN section 8: a candidate must not use torch, even indirectly.

Three layers, cheapest first:
- static_scan: every .py file of the candidate's packages, parsed with ast, for imports of the
  forbidden packages (import, from-import, importlib.import_module / __import__ with a literal
  name, and literal source strings handed to exec/eval/compile);
- run_import_linter: import-linter's forbidden contract over the candidate's packages, which
  follows chains (package a imports b, b imports torch);
- run_sandboxed: the candidate runs in a child process on a temporary copy of its packages (never
  references/), where importing a forbidden package fails, sockets cannot connect, and an audit hook
  refuses any file access under the references/ directories (the repo's, the candidate's, any other
  named by the caller).

What counts as the candidate: the top-level directories jax_oracles/, serving_engine/ and
conversion/ when they hold any .py file (namespace packages allowed), every other top-level
directory that is a regular package (has __init__.py), and top-level .py modules; never
references/, tests/ (tests may import torch or transformers to compare against), grader/ (the
grader supplies its own), nor a directory named after a forbidden package. Symlinks are skipped,
so nothing outside the tree rides along.
"""
from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grader import _guard

__all__ = ["FORBIDDEN", "MIRROR_PACKAGES", "SandboxResult", "candidate_packages", "run_import_linter",
           "run_sandboxed", "static_scan"]

FORBIDDEN = ("torch", "torchvision", "torchaudio", "transformers", "vllm", "peft", "trl",
             "torch_sources", "recorder")
MIRROR_PACKAGES = ("jax_oracles", "serving_engine", "conversion")
_NEVER_CANDIDATE = frozenset({"references", "tests", "test", "grader", *FORBIDDEN})
_REPO_ROOT = Path(__file__).resolve().parent.parent
_TAIL_LINES = 20
_TAIL_CHARS = 4000


# ---------------------------------------------------------------- what the candidate is

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


def _candidate_modules(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*.py") if p.is_file() and not p.is_symlink())


def _python_files(root: Path) -> list[Path]:
    files = _candidate_modules(root)
    for package in candidate_packages(root):
        for dirpath, dirnames, filenames in os.walk(package):  # followlinks=False
            dirnames[:] = sorted(n for n in dirnames if n != "__pycache__")
            files += [Path(dirpath, f) for f in sorted(filenames)
                      if f.endswith(".py") and not Path(dirpath, f).is_symlink()]
    return files


# ---------------------------------------------------------------- (a) static scan

def _is_forbidden(name: str) -> bool:
    return name.partition(".")[0] in FORBIDDEN


def _literal_str(call: ast.Call) -> str | None:
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _forbidden_imports(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, a.name) for a in node.names if _is_forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_forbidden(node.module):
                hits.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            name, literal = _call_name(node), _literal_str(node)
            if literal is None:
                continue
            if name in ("import_module", "__import__") and _is_forbidden(literal):
                hits.append((node.lineno, literal))
            elif name in ("exec", "eval", "compile"):  # exec("import torch")
                try:
                    inner = ast.parse(literal)
                except SyntaxError:
                    continue
                hits += [(node.lineno, m) for _, m in _forbidden_imports(inner)]
    return hits


# CPython 3.11's parser is not safe to run from two threads at once (gh-106905: "AST constructor
# recursion depth mismatch"), and the sweep grades mutants from a thread pool.
_PARSE_LOCK = threading.Lock()


def static_scan(candidate_root: str | Path) -> list[str]:
    """Offending imports as "relative/path.py:LINE: module", sorted; [] when clean.

    A file that does not parse is reported too ("path: unparseable (...)"): it cannot be
    certified torch-free, and it could not run under the grader's interpreter anyway.
    """
    root = Path(candidate_root)
    offences = []
    for path in _python_files(root):
        rel = path.relative_to(root).as_posix()
        source = path.read_bytes()
        with _PARSE_LOCK:  # held over the scan too: it parses exec/eval string literals
            try:
                hits = _forbidden_imports(ast.parse(source, filename=rel))
            except (SyntaxError, ValueError) as e:  # ValueError: null bytes, bad encoding
                offences.append(f"{rel}: unparseable ({e})")
                continue
        offences += [f"{rel}:{line}: {module}" for line, module in sorted(hits)]
    return offences


# ---------------------------------------------------------------- (b) import-linter

def _linter_config(packages: list[str]) -> str:
    def block(names):
        return "".join(f"\n    {n}" for n in names)
    return (f"[importlinter]\nroot_packages ={block(packages)}\ninclude_external_packages = True\n\n"
            f"[importlinter:contract:torch-free]\nname = candidate is torch-free (direct and indirect)\n"
            f"type = forbidden\nsource_modules ={block(packages)}\nforbidden_modules ={block(FORBIDDEN)}\n")


# Runs lint-imports with the candidate first on sys.path and the repo's editable install hidden,
# so a candidate's namespace package is never merged with the oracle package of the same name.
_LINT_BOOTSTRAP = """\
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_t2j_gate_guard", {guard!r})
guard = importlib.util.module_from_spec(spec); spec.loader.exec_module(guard)
guard.hide_repo()
sys.path.insert(0, {root!r})
sys.argv = ["lint-imports", {config!r}, "--no-cache", "--no-logo"]
from importlinter.cli import lint_imports_command
lint_imports_command()
"""


def run_import_linter(candidate_root: str | Path, timeout_s: float = 300.0) -> tuple[bool, str]:
    """(kept, report): import-linter's forbidden contract over the candidate's packages."""
    root = Path(candidate_root).resolve()
    packages = [p.name for p in candidate_packages(root)]
    if not packages:
        return False, f"no candidate packages under {root}"
    with tempfile.TemporaryDirectory(prefix="t2j-lint-") as tmp:
        config = Path(tmp, ".importlinter")
        config.write_text(_linter_config(packages))
        code = _LINT_BOOTSTRAP.format(guard=str(Path(_guard.__file__)), root=str(root), config=str(config))
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout_s, env=_clean_env({}))
        except subprocess.TimeoutExpired:
            return False, f"lint-imports timed out after {timeout_s:.0f}s"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


# ---------------------------------------------------------------- (c) sandboxed run

@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    reason: str | None  # None | "timeout" | "torch import" | "network access" | "reads references/"
    #                     | "no output" | "exit N: ..."
    seconds: float
    stdout_tail: str
    stderr_tail: str = ""


_BOOTSTRAP = """\
import sys
sys.path[:0] = {path!r}
import _t2j_gate_guard as guard
guard.install()
guard.run_entry({entry!r}, {inputs!r}, {outputs!r})
"""

_SITECUSTOMIZE = "import _t2j_gate_guard\n_t2j_gate_guard.install()\n"

# Harmless interpreter settings kept; every other PYTHON* variable could re-point imports.
_KEEP_PYTHON_VARS = frozenset({"PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONIOENCODING",
                               "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER"})


def _points_at_sources(entry: str, roots: list[Path]) -> bool:
    """A path entry naming a repo/candidate root itself, or anything in its sources or references."""
    if not entry or not os.path.isabs(entry):
        return False
    p = Path(os.path.realpath(entry))
    for root in roots:
        if p == root or any(p == root / d or root / d in p.parents
                            for d in ("torch_sources", "recorder", "references")):
            return True
    return False


def _clean_env(extra: dict[str, str], candidate_root: Path | None = None) -> dict[str, str]:
    roots = [_REPO_ROOT] + ([candidate_root] if candidate_root else [])
    env = {}
    for key, value in os.environ.items():
        if key.startswith("PYTHON") and key not in _KEEP_PYTHON_VARS:
            continue
        parts = value.split(os.pathsep)
        kept = [p for p in parts if not _points_at_sources(p, roots)]
        if len(kept) == len(parts):
            env[key] = value
        elif kept:
            env[key] = os.pathsep.join(kept)  # PATH-like: drop only the offending entries
    env.update(extra)
    return env


def _copy_candidate(root: Path, dest: Path, include: tuple[str, ...]) -> None:
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in candidate_packages(root):
        shutil.copytree(package, dest / package.name, symlinks=True, ignore=_skip_links(ignore))
    for module in _candidate_modules(root):
        shutil.copy2(module, dest / module.name)
    for name in include:  # extra data the candidate's entry needs (configs/, assets/)
        src = root / name
        if (Path(name).parts[0] in _NEVER_CANDIDATE or src.is_symlink() or not src.exists()
                or root not in src.resolve().parents):
            raise ValueError(f"cannot include {name!r} from the candidate")
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, symlinks=True, ignore=_skip_links(ignore))
        else:
            shutil.copy2(src, target)


def _skip_links(ignore):
    def _ignore(directory, names):
        links = {n for n in names if os.path.islink(os.path.join(directory, n))}
        return set(ignore(directory, names)) | links
    return _ignore


def _read_end(path: Path, limit: int = 1 << 20) -> str:
    """The last `limit` bytes of a log: enough for chained tracebacks, bounded for chatty runs."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
        return f.read().decode("utf-8", errors="replace")


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-_TAIL_LINES:])[-_TAIL_CHARS:]


def _failure_reason(returncode: int, stderr: str) -> str:
    # the marks may sit anywhere in a chained traceback, so the whole (bounded) log is searched
    if _guard.IMPORT_MARK in stderr:
        return "torch import"
    if _guard.NETWORK_MARK in stderr:
        return "network access"
    if _guard.REFERENCES_MARK in stderr:
        return "reads references/"
    return f"exit {returncode}: {_tail(stderr).strip()}"


def run_sandboxed(candidate_root: str | Path, entry: str, inputs_path: str | Path,
                  outputs_path: str | Path, timeout_s: float, *, include: tuple[str, ...] = (),
                  jax_platforms: str | None = "cpu", deny_read: tuple[str | Path, ...] = ()) -> SandboxResult:
    """Run `entry(inputs_path, outputs_path)` ("module:function") of a copy of the candidate.

    The child is `sys.executable -I -c <bootstrap>` with cwd = the copy and sys.path starting
    [guard, grader copy, candidate copy]; it cannot import FORBIDDEN packages nor connect a
    socket, and sees neither the repo's packages nor its references. JAX_PLATFORMS is set to
    `jax_platforms` (None keeps the caller's). `include` names extra top-level paths of the
    candidate to copy (data such as configs/). A stale outputs file is removed first; a run that
    exits 0 without writing it fails with reason "no output". Past `timeout_s` the child's whole
    process group is killed and the reason is "timeout". The references/ directories of the repo
    and of the candidate, and every directory in `deny_read`, cannot be opened, listed, linked or
    renamed from the child (PermissionError; a run it kills fails as "reads references/").
    """
    root = Path(candidate_root).resolve()
    inputs, outputs = Path(inputs_path).resolve(), Path(outputs_path).resolve()
    if "references" in inputs.parts:
        raise ValueError(f"{inputs} lies under references/: the child gets an inputs-only file")
    outputs.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="t2j-sandbox-") as tmp:
        tmp = Path(tmp)
        boot, grader_parent, copy = tmp / "boot", tmp / "grader_pkg", tmp / "candidate"
        boot.mkdir()
        shutil.copy2(_guard.__file__, boot / "_t2j_gate_guard.py")
        (boot / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        shutil.copytree(Path(__file__).parent, grader_parent / "grader",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        _copy_candidate(root, copy, tuple(include))
        path = [str(boot), str(grader_parent), str(copy)]
        env = _clean_env({
            "PYTHONPATH": os.pathsep.join(path),  # read only by grandchildren (the child runs -I)
            _guard.ENV_FORBIDDEN: ",".join(FORBIDDEN),
            _guard.ENV_HIDE: os.pathsep.join([str(_REPO_ROOT), str(root)]),
            _guard.ENV_DENY: os.pathsep.join(str(Path(d).resolve()) for d in (
                _REPO_ROOT / "references", root / "references", *deny_read)),
        }, candidate_root=root)
        if jax_platforms is not None:
            env["JAX_PLATFORMS"] = jax_platforms
        code = _BOOTSTRAP.format(path=path, entry=entry, inputs=str(inputs), outputs=str(outputs))
        out_log, err_log = tmp / "stdout.log", tmp / "stderr.log"
        start = time.perf_counter()
        with open(out_log, "wb") as out, open(err_log, "wb") as err:
            # own session: on timeout the whole group goes, including anything the entry spawned
            proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=copy, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # it finished in the meantime
                    pass
                returncode = None
                proc.wait()
        seconds = time.perf_counter() - start
        stdout, stderr = _read_end(out_log), _read_end(err_log)
    if returncode is None:
        reason = "timeout"
    elif returncode != 0:
        reason = _failure_reason(returncode, stderr)
    elif not outputs.exists():
        reason = "no output"
    else:
        reason = None
    return SandboxResult(reason is None, reason, seconds, _tail(stdout), _tail(stderr))
