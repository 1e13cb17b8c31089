"""The kernel boundary of the independence gate (DESIGN section 8): bubblewrap and the verifier env.

Every sandboxed child runs the torch-free verifier interpreter (`.venv-verifier`, built by the
Makefile from requirements-verifier.txt: torch, transformers, vllm, peft, trl, torch_sources and
recorder are not installed in it) inside bubblewrap, with its own user, mount, network, PID, IPC,
UTS and cgroup namespaces. The child's whole filesystem is:

    /usr (and the /bin, /lib, /lib64, /sbin links into it)   read-only, the system's programs
    <base python prefix>                                     read-only, its site-packages masked
    /t2j/venv        the verifier environment                read-only
    /t2j/boot        the Python-level guard + sitecustomize  read-only
    /t2j/grader      a copy of the grader package            read-only
    /t2j/candidate   a copy of the candidate (the cwd)       read-only
    /t2j/inputs      the inputs-only directory               read-only
    /t2j/out         the one writable directory the grader reads back (as untrusted data)
    /tmp, /home/sandbox ($HOME)   fresh, empty, size-capped tmpfs per child
    /proc            the child's own PID namespace only; /dev a minimal devtmpfs

No repo, no .git, no reports/, no references/, no other checkout, no /opt (wheels lie there), no
network but the namespace's own loopback, no capabilities, no new user namespaces inside; the
environment is cleared and rebuilt from names that point nowhere outside. bwrap runs with
--die-with-parent and the child in a new session; killing bwrap (the grader's timeout) tears the
PID namespace down with everything in it.

Why bubblewrap: it is the distribution-packaged, maintained unprivileged sandbox that Flatpak is
built on; it needs no daemon and no root, and it makes exactly the namespaces asked for.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from grader.isolation.candidate import FORBIDDEN

__all__ = ["SandboxUnavailable", "Verifier", "VIEW", "bwrap_command", "ensure_sandbox", "verifier"]

ROOT = Path(__file__).resolve().parents[2]
ENV_VERIFIER = "T2J_VERIFIER"  # a verifier venv other than <repo>/.venv-verifier
ENV_BWRAP = "T2J_BWRAP"        # a bwrap binary other than the one on PATH
TMPFS_BYTES = 4 << 30          # /tmp and $HOME each: a runaway child fills memory only this far
HOME = "/home/sandbox"


@dataclass(frozen=True)
class _View:
    """Where things sit inside the sandbox."""
    venv: str = "/t2j/venv"
    boot: str = "/t2j/boot"
    grader: str = "/t2j/grader"
    candidate: str = "/t2j/candidate"
    inputs: str = "/t2j/inputs"
    out: str = "/t2j/out"
    compile_cache: str = "/t2j/xla-cache"


VIEW = _View()


class SandboxUnavailable(RuntimeError):
    """No kernel boundary can be made here (no bwrap, no user namespaces, no verifier env)."""


@dataclass(frozen=True)
class Verifier:
    venv: Path           # the venv directory
    python: Path         # its interpreter, as invoked (a symlink into the base prefix)
    base_prefix: Path    # the Python installation the venv was made from
    masked: tuple[str, ...]  # site-packages of the base installation(s), hidden inside the sandbox


def _verifier_dir() -> Path:
    return Path(os.environ.get(ENV_VERIFIER) or ROOT / ".venv-verifier").absolute()


@functools.cache
def _verifier_at(venv: Path) -> Verifier:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SandboxUnavailable(f"the torch-free verifier environment {venv} is missing: run `make verifier` "
                                 f"(`make test` builds it too)")

    probe = ("import importlib.util, json, site, sys; print(json.dumps([sys.base_prefix, "
             f"site.getsitepackages([sys.base_prefix]), [m for m in {FORBIDDEN!r} "
             "if importlib.util.find_spec(m) is not None]]))")
    out = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SandboxUnavailable(f"the verifier interpreter {python} does not run: {out.stderr.strip()[-500:]}")
    base, base_sites, present = json.loads(out.stdout)
    if present:
        raise SandboxUnavailable(f"the verifier environment {venv} is not torch-free ({', '.join(present)} "
                                 f"importable): remove it and run `make verifier`")
    # Any other system Python's packages are masked too: the child may run any interpreter in /usr.
    sites = set(base_sites) | set(glob.glob("/usr/lib/python3*/*-packages")) | set(
        glob.glob("/usr/local/lib/python3*/*-packages"))
    masked = tuple(sorted(s for s in sites if os.path.isdir(s)))
    return Verifier(venv, python, Path(base), masked)


def verifier() -> Verifier:
    """The verifier environment every sandboxed child runs with (SandboxUnavailable if absent)."""
    return _verifier_at(_verifier_dir())


def _bwrap() -> str:
    path = os.environ.get(ENV_BWRAP) or shutil.which("bwrap")
    if not path or not os.access(path, os.X_OK):
        raise SandboxUnavailable("bubblewrap is not installed: `apt-get install bubblewrap` (Debian, Ubuntu) or "
                                 "`dnf install bubblewrap`; `make test` installs it where it runs as root. On a "
                                 "machine that cannot have it, grade only trusted code (the oracles) with "
                                 "trusted=true")
    return path


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    # the dynamic loader's cache only; nothing else of /etc (no passwd, no hosts, no pip config)
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _device_binds() -> list[str]:
    # a GPU child (jax_platforms != "cpu") needs the NVIDIA device nodes; the driver's libraries are in /usr
    return [a for d in sorted(glob.glob("/dev/nvidia*")) for a in ("--dev-bind", d, d)]


def bwrap_command(v: Verifier, *, boot: Path, grader: Path, candidate: Path, inputs: Path, out: Path,
                  env: dict[str, str], argv: list[str], compile_cache: Path | None = None,
                  gpu: bool = False) -> list[str]:
    """The bwrap command line that runs `argv` (inside-sandbox paths) in a sealed view (module doc)."""
    base = str(v.base_prefix)
    cmd = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
           *_system_binds(), "--proc", "/proc", "--dev", "/dev",
           "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--size", str(TMPFS_BYTES), "--tmpfs", HOME,
           "--ro-bind", base, base]
    for site in v.masked:
        cmd += ["--tmpfs", site, "--remount-ro", site]
    cmd += ["--ro-bind", str(v.venv), VIEW.venv, "--ro-bind", str(boot), VIEW.boot,
            "--ro-bind", str(grader), VIEW.grader, "--ro-bind", str(candidate), VIEW.candidate,
            "--ro-bind", str(inputs), VIEW.inputs, "--bind", str(out), VIEW.out]
    if compile_cache is not None:  # the sweep's own mutants only (trusted code): never for a candidate
        cmd += ["--bind", str(compile_cache), VIEW.compile_cache]
    if gpu:
        cmd += _device_binds()
    for key, value in sorted(env.items()):
        cmd += ["--setenv", key, value]
    # the root bwrap builds is a tmpfs: read-only once every mount point exists (not recursive, so the
    # scratch mounts stay writable)
    return cmd + ["--remount-ro", "/", "--chdir", VIEW.candidate, "--", *argv]


@functools.cache
def _probe(bwrap: str, venv: Path) -> str | None:
    """None when a sealed child can start here, else why not (bwrap's own words)."""
    v = _verifier_at(venv)
    probe_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    cmd = bwrap_command(v, boot=probe_dir, grader=probe_dir, candidate=probe_dir, inputs=probe_dir,
                        out=probe_dir, env={"HOME": HOME},
                        argv=[f"{VIEW.venv}/bin/python", "-I", "-S", "-c", "pass"])
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")[-500:]


def ensure_sandbox() -> Verifier:
    """The verifier, once it is known a sealed child can start; else SandboxUnavailable, with the fix."""
    v = verifier()
    why = _probe(_bwrap(), v.venv)
    if why is not None:
        raise SandboxUnavailable(
            f"bubblewrap cannot make the sandbox's namespaces here ({why}). In a container, allow user "
            f"namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1, or run it with --privileged / a "
            f"seccomp profile that permits unshare and mount); to grade only trusted code (the oracles) "
            f"without it, pass trusted=true")
    return v
