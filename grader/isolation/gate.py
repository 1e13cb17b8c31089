"""The independence gate of DESIGN section 8: a candidate must not use torch, even indirectly.

Three layers, cheapest first:
- static_scan: every .py file of the candidate's packages, parsed with ast, for imports of the
  forbidden packages: import, from-import, import_module / __import__ / runpy.run_module with a
  name the file decides (literals, `+`, f-strings, joins, slices, names assigned those), programs
  handed to exec/eval/compile or after "-c" in an argument list, and `import torch`-like text in
  any other string (shell commands, files written and run);
- run_import_linter: import-linter's forbidden contract over the candidate's packages, which
  follows chains (package a imports b, b imports torch);
- run_sandboxed: the candidate runs in a sealed child (grader/isolation/sandbox.py): the torch-free
  verifier interpreter inside bubblewrap, seeing read-only copies of itself and of the grader's
  runtime plus the inputs directory, writing only its outputs file, with fresh /tmp and $HOME,
  no network and nothing of the repo; the Python-level guard (grader/isolation/_guard.py) is installed
  first for precise reasons. `trusted=True` runs the same child behind the guard alone (the
  oracles on a machine without namespaces), where its audit hook refuses the references/.

What counts as the candidate: the top-level directories jax_oracles/, serving_engine/ and
conversion/ when they hold any .py file (namespace packages allowed), every other top-level
directory that is a regular package (has __init__.py), and top-level .py modules; never
references/, tests/ (tests may import torch or transformers to compare against), grader/ (the
grader supplies its own), nor a directory named after a forbidden package. Symlinks are skipped,
so nothing outside the tree rides along.
"""
from __future__ import annotations

import ast
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from catalog import pysource
from grader.isolation import _guard, clock, sandbox
from grader.isolation.candidate import FORBIDDEN, MIRROR_PACKAGES, _NEVER_CANDIDATE, candidate_packages

__all__ = ["FORBIDDEN", "MIRROR_PACKAGES", "SandboxResult", "candidate_packages", "run_import_linter",
           "run_sandboxed", "static_scan"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
_TAIL_LINES = 20
_TAIL_CHARS = 4000


# ---------------------------------------------------------------- what the candidate is

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


# `import torch`, `from torch import x`, `python -m torch.utils...` inside any string: a shell
# command, a `-c` program, a file the candidate writes and runs.
_IMPORT_IN_TEXT = re.compile(r"(?<![\w.])(?:import|from)\s+(" + "|".join(FORBIDDEN) + r")(?![\w])"
                             r"|(?<![\w-])-m\s*(" + "|".join(FORBIDDEN) + r")(?![\w])")
_IMPORT_CALLS = frozenset({"import_module", "__import__", "run_module"})  # importlib, builtins, runpy
_CODE_CALLS = frozenset({"exec", "eval", "compile"})
_MAX_VARIANTS = 64  # a name assigned many strings: the product of two such stays bounded


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


class _Strings:
    """The strings an expression can evaluate to, where that is decidable from the file alone:
    literals, `+`, f-strings, `sep.join([...])`, constant slices (`"hcrot"[::-1]`), and names
    assigned such expressions anywhere in the file (every assignment counts)."""

    def __init__(self, tree: ast.AST):
        self.names: dict[str, set[str]] = {}
        assigns = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None]
        for _ in range(2):  # a second pass resolves names assigned from names
            for node in assigns:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                values = self.of(node.value)
                for t in targets:
                    if isinstance(t, ast.Name) and values:
                        self.names.setdefault(t.id, set()).update(values)

    def of(self, node) -> set[str]:
        try:
            out = self._of(node)
        except (TypeError, ValueError, IndexError, RecursionError):
            return set()
        return set(list(out)[:_MAX_VARIANTS])

    def _of(self, node) -> set[str]:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                return {node.value}
            return {node.value.decode("latin-1")} if isinstance(node.value, bytes) else set()
        if isinstance(node, ast.Name):
            return set(self.names.get(node.id, ()))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.of(node.left), self.of(node.right)
            return {a + b for a in left for b in right}
        if isinstance(node, ast.JoinedStr):
            parts = [self.of(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values]
            out = {""}
            for p in parts:
                if not p:
                    return set()
                out = {a + b for a in out for b in p}
            return out
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))):
            seps = self.of(node.func.value)
            out = {""}
            for i, elt in enumerate(node.args[0].elts):
                p = self.of(elt)
                if not p:
                    return set()
                out = {a + (sep if i else "") + b for a in out for sep in seps for b in p}
            return out
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice):
            bounds = [None if b is None else ast.literal_eval(b) for b in
                      (node.slice.lower, node.slice.upper, node.slice.step)]
            return {v[slice(*bounds)] for v in self.of(node.value)}
        return set()


def _code_hits(text: str, line: int, depth: int) -> list[tuple[int, str]]:
    """A string that is, or holds, a program: parsed when it parses, searched as text otherwise."""
    hits = [(line, m.group(1) or m.group(2)) for m in _IMPORT_IN_TEXT.finditer(text)]
    if depth < 3:
        try:
            inner = pysource.parse(text)
        except (SyntaxError, ValueError):
            return hits
        hits += [(line, m) for _, m in _forbidden_imports(inner, depth + 1)]
    return hits


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _first_arg(call: ast.Call):
    return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("name", "source")), None)


def _forbidden_imports(tree: ast.AST, depth: int = 0) -> list[tuple[int, str]]:
    hits = []
    strings, docs = _Strings(tree), _docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            hits += [(line, a.name) for a in node.names if _is_forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_forbidden(node.module):
                hits.append((line, node.module))
        elif isinstance(node, ast.Call):
            name, arg = _call_name(node), _first_arg(node)
            if arg is None:
                continue
            if name in _IMPORT_CALLS:  # import_module("tor" + "ch"), __import__(name) with name = "torch"
                hits += [(line, v) for v in strings.of(arg) if _is_forbidden(v)]
            elif name in _CODE_CALLS:  # exec("import torch")
                for v in strings.of(arg):
                    hits += _code_hits(v, line, depth)
        elif isinstance(node, (ast.List, ast.Tuple)):  # [python, "-c", "import torch"], [python, "-m", "torch"]
            for flag, program in zip(node.elts, node.elts[1:]):
                flags = strings.of(flag)
                if "-c" in flags:
                    for v in strings.of(program):
                        hits += _code_hits(v, line, depth)
                if "-m" in flags:
                    hits += [(line, v) for v in strings.of(program) if _is_forbidden(v)]
        elif isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) and id(node) not in docs:
            for v in strings.of(node):  # shell commands and programs written to files
                hits += [(line, m.group(1) or m.group(2)) for m in _IMPORT_IN_TEXT.finditer(v)]
    return sorted(set(hits))


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
                hits = _forbidden_imports(pysource.parse(source, filename=rel))
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
    outputs: Path | None = None  # the file the child wrote, on the grader's side: read it as untrusted
    usage: clock.Usage | None = None  # the child tree's CPU and wall seconds on the grader's clock
    limits: clock.Limits | None = None  # what it was kept to

    @property
    def timeout_detail(self) -> str | None:
        """Which limit the grader killed the child at, in words (None unless reason is "timeout")."""
        if self.reason != "timeout":
            return None
        return (self.usage.reason(self.limits) if self.usage and self.limits else None) or "timeout"


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
# What of the grader's environment a sealed child inherits: settings, never paths.
_KEEP_SANDBOX_VARS = _KEEP_PYTHON_VARS | {"XLA_FLAGS", "OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL"}
# What one child may take from the machine (grader/isolation/clock.py keeps them): the oracle's tiny-scale children peak at
# 0.2-0.6 GiB resident and 19-23 tasks on 2 cores (XLA's thread pools grow with the cores); grade() raises the
# memory cap with the checkpoint (grader.app.child_caps).
DEFAULT_CAPS = clock.Limits(memory_bytes=4 * 2**30, tasks=max(512, 16 * (os.cpu_count() or 1)), file_bytes=2**30,
                            disk_bytes=2 * 2**30)
_CACHE_VARS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


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


CHILD_PACKAGES = ("grader", "catalog")  # what a child imports of the repo besides the candidate: the probes, the
# exchange, the guard's helpers (grader) and the schema, workloads and checks they stand on (catalog)


def stage_grader_packages(dst: Path) -> None:
    """Copies of CHILD_PACKAGES under dst (the child's /t2j/grader): the child runs the grader's own copy."""
    for name in CHILD_PACKAGES:
        shutil.copytree(_REPO_ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _stage(tmp: Path, root: Path, include: tuple[str, ...], stage_packages=None) -> tuple[Path, Path, Path]:
    """boot/ (the guard + sitecustomize), grader_pkg/ (copies of the grader and catalog packages, or what
    `stage_packages` puts there), candidate/ (a copy)."""
    boot, grader_parent, copy = tmp / "boot", tmp / "grader_pkg", tmp / "candidate"
    boot.mkdir()
    shutil.copy2(_guard.__file__, boot / "_t2j_gate_guard.py")
    (boot / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    (stage_packages or stage_grader_packages)(grader_parent)
    _copy_candidate(root, copy, tuple(include))
    return boot, grader_parent, copy


def _sealed_command(root, entry, inputs_dir, inputs_name, outputs_dir, outputs_name, staged, jax_platforms,
                    compile_cache, tmp: Path) -> tuple[list[str], dict, Path, tuple[int, ...]]:
    """bwrap around the verifier interpreter; every path the child sees is a sandbox path. bwrap reads its
    options from a descriptor (the last element), so /proc/1/cmdline inside names no host path."""
    v = sandbox.ensure_sandbox()
    view = sandbox.VIEW
    boot, grader_parent, copy = staged
    path = [view.boot, view.grader, view.candidate]
    env = {k: v_ for k, v_ in os.environ.items() if k in _KEEP_SANDBOX_VARS}
    env.update({"HOME": sandbox.HOME, "TMPDIR": "/tmp", "PATH": f"{view.venv}/bin:/usr/bin:/bin",
                "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": os.pathsep.join(path),  # read only by grandchildren (the child runs -I)
                _guard.ENV_FORBIDDEN: ",".join(FORBIDDEN)})
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platforms
    if compile_cache is not None:
        env.update(_CACHE_VARS, JAX_COMPILATION_CACHE_DIR=view.compile_cache)
    code = _BOOTSTRAP.format(path=path, entry=entry, inputs=f"{view.inputs}/{inputs_name}",
                             outputs=f"{view.out}/{outputs_name}")
    cmd = sandbox.bwrap_command(v, boot=boot, grader=grader_parent, candidate=copy, inputs=inputs_dir,
                                out=outputs_dir, env=env, argv=[f"{view.venv}/bin/python", "-I", "-c", code],
                                compile_cache=compile_cache, gpu=jax_platforms != "cpu")
    split = cmd.index("--")
    options = tmp / "bwrap.args"
    options.write_bytes(b"".join(os.fsencode(a) + b"\0" for a in cmd[1:split]))
    fd = os.open(options, os.O_RDONLY | os.O_CLOEXEC)
    # bwrap --clearenv builds the child's environment; bwrap itself needs none
    return [cmd[0], "--args", str(fd), *cmd[split:]], {}, tmp, (fd,)


def _trusted_command(root, entry, inputs_dir, inputs_name, outputs_dir, outputs_name, staged, jax_platforms,
                     deny_read, compile_cache) -> tuple[list[str], dict, Path, tuple[int, ...]]:
    """No namespaces: the verifier interpreter behind the Python-level fence only (trusted code)."""
    v = sandbox.verifier()
    boot, grader_parent, copy = staged
    path = [str(boot), str(grader_parent), str(copy)]
    env = _clean_env({
        "PYTHONPATH": os.pathsep.join(path),
        _guard.ENV_FORBIDDEN: ",".join(FORBIDDEN),
        _guard.ENV_HIDE: os.pathsep.join([str(_REPO_ROOT), str(root)]),
        _guard.ENV_DENY: os.pathsep.join(str(Path(d).resolve()) for d in (
            _REPO_ROOT / "references", root / "references", *deny_read)),
    }, candidate_root=root)
    if jax_platforms is not None:
        env["JAX_PLATFORMS"] = jax_platforms
    if compile_cache is not None:
        env.update(_CACHE_VARS, JAX_COMPILATION_CACHE_DIR=str(compile_cache))
    code = _BOOTSTRAP.format(path=path, entry=entry, inputs=str(inputs_dir / inputs_name),
                             outputs=str(outputs_dir / outputs_name))
    return [str(v.python), "-I", "-c", code], env, copy, ()


def run_sandboxed(candidate_root: str | Path, entry: str, inputs_dir: str | Path, outputs_dir: str | Path,
                  timeout_s: float, *, inputs_name: str = "inputs.h5", outputs_name: str = "outputs.npz",
                  include: tuple[str, ...] = (), jax_platforms: str | None = "cpu", trusted: bool = False,
                  deny_read: tuple[str | Path, ...] = (), compile_cache: str | Path | None = None,
                  forkserver=None, cpu_limit_s: float = math.inf, caps: clock.Limits | None = None,
                  stage_packages=None) -> SandboxResult:
    """Run `entry(inputs_path, outputs_path)` ("module:function") of a copy of the candidate.

    Sealed (the default): the verifier interpreter inside bubblewrap (grader/isolation/sandbox.py), seeing
    read-only only the system's programs, the verifier env, the guard, a copy of the grader and of
    the candidate (its cwd) and `inputs_dir`, writing only into `outputs_dir`; the entry gets
    "/t2j/inputs/<inputs_name>" and "/t2j/out/<outputs_name>". SandboxUnavailable where that cannot
    be made. `trusted=True` (trusted code on a machine without namespaces, said out loud) runs the
    same child behind the Python-level fence alone, where `deny_read` and the references/ of the
    repo and of the candidate are refused by the guard's audit hook.

    Either way the child runs `-I` with the guard installed first (forbidden imports and socket
    connections fail with precise reasons), in its own session (and cgroup, grader/isolation/clock.py). The grader
    keeps its limits on its own clock: past `timeout_s` wall seconds, or past `cpu_limit_s` CPU seconds of
    the child's whole process tree, the tree is killed and the reason is "timeout" (`timeout_detail` says
    which limit, `usage` what it used). `caps` (default DEFAULT_CAPS) bound its memory, tasks, the size of any
    file it writes and the total of its outputs directory and stdout/stderr logs: past one the tree is killed
    and the reason names it ("memory: ...", "processes: ...", "disk: ..."). JAX_PLATFORMS is set
    to `jax_platforms` (None keeps the caller's). `include` names extra top-level paths of the
    candidate to copy (data such as configs/). `outputs_dir` must be an empty directory; a run that
    exits 0 without writing its file fails with reason "no output". `result.outputs` is that file,
    to be read only with grader.isolation.exchange.read_outputs (or as untrusted data otherwise).
    `stage_packages(dst)` puts the trusted packages the entry runs from under dst in place of CHILD_PACKAGES (the
    live twin, twin/seal.py, stages its own probes and never the grader's checks).
    `compile_cache` shares one writable JAX compilation cache between children: a channel from one
    child to the next, so only for the sweep's own mutants, never for a candidate. `forkserver`
    (grader/isolation/forkserver.py, trusted only: the sweep's own mutants) forks the child from a server that has
    imported jax already instead of starting an interpreter; the child is otherwise the trusted one.
    """
    if forkserver is not None and not trusted:
        raise ValueError("a fork server runs trusted code only (the sweep's own mutants), never a candidate")
    root = Path(candidate_root).resolve()
    inputs_dir, outputs_dir = Path(inputs_dir).resolve(), Path(outputs_dir).resolve()
    if "references" in inputs_dir.parts:
        raise ValueError(f"{inputs_dir} lies under references/: the child gets an inputs-only directory")
    if not inputs_dir.is_dir() or not (inputs_dir / inputs_name).is_file():
        raise ValueError(f"{inputs_dir / inputs_name} is not an inputs file in an inputs directory")
    if not outputs_dir.is_dir() or any(outputs_dir.iterdir()):
        raise ValueError(f"{outputs_dir} must be an empty directory")
    cache = Path(compile_cache).resolve() if compile_cache is not None else None
    with tempfile.TemporaryDirectory(prefix="t2j-sandbox-") as tmp:
        tmp = Path(tmp)
        staged = _stage(tmp, root, tuple(include), stage_packages)
        args = (root, entry, inputs_dir, inputs_name, outputs_dir, outputs_name, staged, jax_platforms)
        if trusted:
            cmd, env, cwd, pass_fds = _trusted_command(*args, deny_read, cache)
        else:
            cmd, env, cwd, pass_fds = _sealed_command(*args, cache, tmp)
        out_log, err_log = tmp / "stdout.log", tmp / "stderr.log"
        c = caps or DEFAULT_CAPS
        limits = clock.Limits(cpu_s=cpu_limit_s, wall_s=timeout_s, memory_bytes=c.memory_bytes, tasks=c.tasks,
                              file_bytes=c.file_bytes, disk_bytes=c.disk_bytes,
                              watch=(str(outputs_dir), str(out_log), str(err_log)))
        start = time.perf_counter()
        if forkserver is not None:
            boot, grader_parent, copy = staged
            returncode, usage = forkserver.run(path=[str(boot), str(grader_parent), str(copy)], cwd=str(copy),
                                               env=env, entry=entry, inputs=str(inputs_dir / inputs_name),
                                               outputs=str(outputs_dir / outputs_name), stdout=str(out_log),
                                               stderr=str(err_log), limits=limits)
        else:
            with open(out_log, "wb") as out, open(err_log, "wb") as err:
                returncode, usage = clock.run_tree(cmd, cwd=cwd, env=env, pass_fds=pass_fds, stdout=out, stderr=err,
                                                   limits=limits)
        seconds = time.perf_counter() - start
        stdout, stderr = _read_end(out_log), _read_end(err_log)
    return _result(returncode, stdout, stderr, seconds, outputs_dir / outputs_name, usage, limits)


def fork_server_env(compile_cache: str | Path | None = None, jax_platforms: str = "cpu") -> dict[str, str]:
    """The environment of a fork server (grader/isolation/forkserver.py): the guard's settings as a trusted child has
    them (the repo hidden, its references/ refused) and what JAX reads from the environment at import."""
    env = _clean_env({_guard.ENV_FORBIDDEN: ",".join(FORBIDDEN), _guard.ENV_HIDE: str(_REPO_ROOT),
                      _guard.ENV_DENY: str((_REPO_ROOT / "references").resolve()), "JAX_PLATFORMS": jax_platforms})
    if compile_cache is not None:
        env.update(_CACHE_VARS, JAX_COMPILATION_CACHE_DIR=str(Path(compile_cache).resolve()))
    return env


def _result(returncode, stdout, stderr, seconds, produced, usage=None, limits=None) -> SandboxResult:
    if returncode is None and usage is not None and usage.exceeded not in (None, "cpu", "wall"):
        reason = usage.reason(limits)  # a cap: memory, processes, disk
    elif returncode is None:
        reason = "timeout"
    elif returncode != 0:
        reason = _failure_reason(returncode, stderr)
    elif not os.path.lexists(produced):
        reason = "no output"
    else:
        reason = None
    return SandboxResult(reason is None, reason, seconds, _tail(stdout), _tail(stderr),
                         produced if os.path.lexists(produced) else None, usage, limits)
