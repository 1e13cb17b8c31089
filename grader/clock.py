"""The grader's own clock: a graded child's whole process tree, its CPU seconds as the kernel counts them.

A candidate owns everything inside its child: its clocks, its timers, its signal handlers. So every limit
that decides a verdict is kept here, in the grader's process, on figures the candidate cannot touch:

- CPU seconds of the child's whole process tree (user + system, every thread, every descendant): the
  child's own cgroup where the grader can make one (cgroup v2 `cpu.stat` usage_usec, or v1
  `cpuacct.usage`), else the tree found in /proc by parent links (utime + stime + the reaped children's
  cutime + cstime of each member). CPU time is what load from other processes does not inflate: a child
  waiting for a core accrues none, and a machine with fewer cores runs the same work in the same CPU time.
- wall seconds on the grader's monotonic clock: the backstop for a child that sleeps, blocks or hands its
  work to something the CPU clock does not see.

Past either limit the whole tree is killed with SIGKILL: every member of its cgroup, its process group,
and every descendant found by parent links, so a child that ignores SIGTERM, or forks and calls setsid,
goes with it. (Under bubblewrap the tree is also a PID namespace, which dies with its first process.)
Where no cgroup can be made, a grandchild that double-forks and is reaped by init leaves the /proc tree;
sealed children cannot do that (their PID namespace holds them), trusted ones are the repo's own code.
"""
from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limits", "Usage", "meter_kind", "run_tree", "watch_pid"]

POLL_S = 0.05
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_FORCE_ENV = "T2J_CLOCK"  # "procfs": never make a cgroup (tests cover both meters with it)
_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    cpu_s: float = math.inf  # CPU seconds of the whole tree
    wall_s: float = math.inf  # seconds on the grader's monotonic clock


@dataclass(frozen=True)
class Usage:
    cpu_s: float
    wall_s: float
    exceeded: str | None  # None | "cpu" | "wall": the limit the grader killed the tree at
    meter: str  # how cpu_s was counted: "cgroup2", "cgroup1", "procfs"

    def reason(self, limits: Limits) -> str | None:
        if self.exceeded == "cpu":
            return (f"timeout: the child's process tree used {self.cpu_s:.1f} CPU-s > {limits.cpu_s:.1f} CPU-s "
                    f"(grader's clock, {self.meter})")
        if self.exceeded == "wall":
            return f"timeout: the child ran {self.wall_s:.1f} s > {limits.wall_s:.1f} s (grader's wall clock)"
        return None


# ---------------------------------------------------------------- meters

class _ProcTree:
    """The tree under `root` in /proc, by parent links; CPU = the max seen of the members' sum (a member's time
    moves into its parent's cutime when it is reaped, so the sum only drops for a moment)."""
    kind = "procfs"

    def __init__(self):
        self.root: int | None = None
        self._best = 0.0

    def prefix(self) -> list[str]:
        return []

    def attach(self, pid: int) -> None:
        self.root = pid

    def _stats(self) -> dict[int, tuple[int, float]]:
        out = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    raw = f.read().decode("latin-1")
            except OSError:
                continue
            fields = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
            try:
                ppid = int(fields[1])
                cpu = sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
            except (IndexError, ValueError):
                continue
            out[int(name)] = (ppid, cpu)
        return out

    def members(self) -> set[int]:
        if self.root is None:
            return set()
        stats = self._stats()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [self.root] if self.root in stats else []
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        self._last = {p: stats[p][1] for p in tree}
        return tree

    def seconds(self) -> float:
        self.members()
        self._best = max(self._best, sum(getattr(self, "_last", {}).values()))
        return self._best

    def close(self) -> None:
        pass


class _Cgroup:
    """A cgroup of the child's own: everything it starts stays in it (joining another needs rights it lacks)."""

    def __init__(self, path: Path, kind: str):
        self.path, self.kind = path, kind
        self._usage = path / ("cpu.stat" if kind == "cgroup2" else "cpuacct.usage")

    def prefix(self) -> list[str]:
        # the child joins before it execs: nothing it runs is ever outside (fds and argv pass through exec)
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def attach(self, pid: int) -> None:  # a process already running (the fork server's child)
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError:
            pass

    def members(self) -> set[int]:
        try:
            return {int(x) for x in (self.path / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def seconds(self) -> float:
        try:
            text = self._usage.read_text()
        except OSError:
            return 0.0
        if self.kind == "cgroup1":
            return int(text.strip()) / 1e9
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get("usage_usec", 0)) / 1e6

    def close(self) -> None:
        for _ in range(100):  # members killed a moment ago may still be leaving
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)


def _own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path for `controller` (None: the v2 unified hierarchy)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path
    return None


def _cgroup_roots() -> list[tuple[Path, str]]:
    roots = []
    v2 = _own_cgroup(None)
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if v2 is not None and (mount / "cgroup.controllers").is_file():
            roots.append((mount / v2.lstrip("/"), "cgroup2"))
            break
    v1 = _own_cgroup("cpuacct")
    for mount in (Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if v1 is not None and (mount / "cpuacct.usage").is_file():
            roots.append((mount / v1.lstrip("/"), "cgroup1"))
            break
    return roots


_KIND: list[str] = []  # the meter this process settled on, decided once
_KIND_LOCK = threading.Lock()


def _new_meter():
    if os.environ.get(_FORCE_ENV) == "procfs":
        return _ProcTree()
    with _KIND_LOCK:
        return _decide_meter()


def _decide_meter():
    if _KIND and _KIND[0] == "procfs":
        return _ProcTree()
    for root, kind in _cgroup_roots():
        if _KIND and _KIND[0] != kind:
            continue
        path = root / f"t2j-{os.getpid()}-{next(_counter)}"
        try:
            path.mkdir()
        except OSError:
            continue
        meter = _Cgroup(path, kind)
        if not _KIND:  # a cgroup that cannot count or take a process is no clock
            if not meter._usage.is_file() or not _joinable(meter):
                meter.close()
                continue
            _KIND.append(kind)
        return meter
    _KIND[:] = ["procfs"]
    return _ProcTree()


def _joinable(meter: _Cgroup) -> bool:
    try:
        return subprocess.run([*meter.prefix(), "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def meter_kind() -> str:
    """The CPU meter graded children get on this machine: "cgroup2", "cgroup1" or "procfs"."""
    meter = _new_meter()
    meter.close()
    return meter.kind


# ---------------------------------------------------------------- watching and killing

def _kill_tree(meter, root: int) -> None:
    for _ in range(50):  # until nothing is left: a member may fork while it is being killed
        found = meter.members() | _descendants(root)
        try:
            os.killpg(root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _descendants(root: int) -> set[int]:
    tree = _ProcTree()
    tree.attach(root)
    return tree.members()


def _watch(meter, root: int, limits: Limits, done, started: float) -> Usage:
    exceeded = None
    while not done(POLL_S):
        cpu, wall = meter.seconds(), time.monotonic() - started
        if cpu > limits.cpu_s or wall > limits.wall_s:
            exceeded = "cpu" if cpu > limits.cpu_s else "wall"
            _kill_tree(meter, root)
            break
    return Usage(meter.seconds(), time.monotonic() - started, exceeded, meter.kind)


def run_tree(cmd: list[str], *, cwd, env, pass_fds=(), stdout=None, stderr=None,
             limits: Limits = Limits()) -> tuple[int | None, Usage]:
    """Popen `cmd` in its own session (and its own cgroup where one can be made), kept to `limits` on the grader's
    clock; -> (exit code, or None where the grader killed it at a limit; its usage)."""
    meter = _new_meter()
    try:
        try:
            proc = subprocess.Popen([*meter.prefix(), *cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, start_new_session=True, pass_fds=pass_fds)
        finally:
            for fd in pass_fds:
                os.close(fd)
        started = time.monotonic()
        meter.attach(proc.pid) if isinstance(meter, _ProcTree) else None

        def done(wait_s: float) -> bool:
            try:
                proc.wait(timeout=wait_s)
                return True
            except subprocess.TimeoutExpired:
                return False

        usage = _watch(meter, proc.pid, limits, done, started)
        proc.wait()
        if usage.exceeded is None:  # it may have left members behind (a daemon it started): they go too
            _kill_tree(meter, proc.pid)
        return (None if usage.exceeded else proc.returncode), usage
    finally:
        meter.close()


def watch_pid(pid: int, limits: Limits, finished: threading.Event) -> Usage:
    """Keep a process someone else started (the fork server's child, already running) to `limits` until
    `finished` is set; its tree is killed past a limit."""
    meter = _new_meter()
    try:
        meter.attach(pid)
        return _watch(meter, pid, limits, finished.wait, time.monotonic())
    finally:
        if isinstance(meter, _Cgroup):
            _kill_tree(meter, pid) if meter.members() else None
        meter.close()
