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

The same box caps what a hostile child can take from the machine (Limits): resident memory and tasks
(processes and threads) through the memory and pids controllers where the grader can make those cgroups
(v2, else v1: the kernel refuses past the cap), else by the grader summing the /proc tree each reading and
killing past the cap; the size of any one file it writes (RLIMIT_FSIZE: its outputs, its stdout/stderr
files, /tmp); and the total size of the paths the grader watches (its output directory and log files),
killed past the cap. Each is a Usage.exceeded reason.
"""
from __future__ import annotations

import itertools
import math
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limits", "Usage", "cap_kinds", "meter_kind", "run_tree", "watch_pid"]

POLL_S = 0.05
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_FORCE_ENV = "T2J_CLOCK"  # "procfs": never make a cgroup (tests cover both meters with it)
_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    cpu_s: float = math.inf  # CPU seconds of the whole tree
    wall_s: float = math.inf  # seconds on the grader's monotonic clock
    memory_bytes: float = math.inf  # resident memory of the whole tree
    tasks: float = math.inf  # processes and threads of the whole tree at once
    file_bytes: float = math.inf  # the largest file it may write (RLIMIT_FSIZE)
    disk_bytes: float = math.inf  # the total size of `watch`
    watch: tuple[str, ...] = ()  # files and directories the child writes into


@dataclass(frozen=True)
class Usage:
    cpu_s: float
    wall_s: float
    exceeded: str | None  # None | "cpu" | "wall" | "memory" | "tasks" | "disk": the limit it was killed at
    meter: str  # how cpu_s was counted: "cgroup2", "cgroup1", "procfs"
    peak_memory_bytes: float = 0.0
    peak_tasks: int = 0
    disk_bytes: int = 0

    def reason(self, limits: Limits) -> str | None:
        if self.exceeded == "cpu":
            return (f"timeout: the child's process tree used {self.cpu_s:.1f} CPU-s > {limits.cpu_s:.1f} CPU-s "
                    f"(grader's clock, {self.meter})")
        if self.exceeded == "wall":
            return f"timeout: the child ran {self.wall_s:.1f} s > {limits.wall_s:.1f} s (grader's wall clock)"
        if self.exceeded == "memory":
            return (f"memory: the child's process tree reached its cap of {limits.memory_bytes / 2**30:.1f} GiB "
                    f"(peak seen {self.peak_memory_bytes / 2**30:.2f} GiB)")
        if self.exceeded == "tasks":
            return f"processes: the child's tree reached its cap of {limits.tasks:.0f} processes and threads"
        if self.exceeded == "disk":
            return (f"disk: the child wrote {self.disk_bytes / 2**20:.0f} MiB into its outputs and logs (caps: "
                    f"{limits.disk_bytes / 2**20:.0f} MiB in all, {limits.file_bytes / 2**20:.0f} MiB a file)")
        return None


# ---------------------------------------------------------------- meters

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _ProcTree:
    """The tree under `root` in /proc, by parent links; CPU = the max seen of the members' sum (a member's time
    moves into its parent's cutime when it is reaped, so the sum only drops for a moment)."""
    kind = "procfs"

    def __init__(self):
        self.root: int | None = None
        self._best = 0.0
        self._last: dict[int, tuple[float, int]] = {}

    def prefix(self) -> list[str]:
        return []

    def attach(self, pid: int) -> None:
        self.root = pid

    def _stats(self) -> dict[int, tuple[int, float, int]]:
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
                threads = int(fields[17])
            except (IndexError, ValueError):
                continue
            out[int(name)] = (ppid, cpu, threads)
        return out

    def members(self) -> set[int]:
        if self.root is None:
            return set()
        stats = self._stats()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [self.root] if self.root in stats else []
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        self._last = {p: stats[p][1:] for p in tree}
        return tree

    def seconds(self) -> float:
        self.members()
        self._best = max(self._best, sum(cpu for cpu, _ in self._last.values()))
        return self._best

    def tasks(self) -> int:  # after members()
        return sum(n for _, n in self._last.values())

    def resident_bytes(self) -> float:  # after members()
        total = 0
        for pid in self._last:
            try:
                with open(f"/proc/{pid}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * _PAGE
            except (OSError, IndexError, ValueError):
                pass
        return float(total)

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


class _Cap(_Cgroup):
    """A memory or pids cgroup of the child's own with the kernel's cap set (v2 memory.max / pids.max, v1
    memory.limit_in_bytes / pids.max): past it the kernel OOM-kills inside it, or refuses the fork."""
    _FILES = {("memory", "cgroup2"): ("memory.max", "memory.current", "memory.events", "oom_kill"),
              # v1: oom_control's oom_kill, not failcnt (which also counts page cache reclaimed at the limit)
              ("memory", "cgroup1"): ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control",
                                      "oom_kill"),
              ("pids", "cgroup2"): ("pids.max", "pids.current", "pids.events", "max"),
              ("pids", "cgroup1"): ("pids.max", "pids.current", "pids.events", "max")}

    def __init__(self, path: Path, kind: str, controller: str, cap: float):
        super().__init__(path, kind)
        self.controller = controller
        self._max, self._current, self._events, self._event_key = self._FILES[(controller, kind)]
        (path / self._max).write_text(str(int(min(cap, 1 << 22 if controller == "pids" else cap))))

    def current(self) -> float:
        try:
            return float(int((self.path / self._current).read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            return 0.0

    def hit(self) -> bool:
        """The kernel enforced the cap at least once (an OOM kill, a refused fork, a failed charge)."""
        try:
            text = (self.path / self._events).read_text()
        except OSError:
            return False
        fields = dict(line.split() for line in text.splitlines() if line.strip())
        return int(fields.get(self._event_key, 0)) > 0


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


def _v2_root() -> Path | None:
    v2 = _own_cgroup(None)
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if v2 is not None and (mount / "cgroup.controllers").is_file():
            return mount / v2.lstrip("/")
    return None


def _v1_root(controller: str, probe: str) -> Path | None:
    own = _own_cgroup(controller)
    mounts = [Path(f"/sys/fs/cgroup/{controller}")] + ([Path("/sys/fs/cgroup/cpu,cpuacct")]
                                                       if controller == "cpuacct" else [])
    for mount in mounts:
        if own is not None and (mount / probe).is_file():
            return mount / own.lstrip("/")
    return None


def _cgroup_roots() -> list[tuple[Path, str]]:
    roots = []
    if (v2 := _v2_root()) is not None:
        roots.append((v2, "cgroup2"))
    if (v1 := _v1_root("cpuacct", "cpuacct.usage")) is not None:
        roots.append((v1, "cgroup1"))
    return roots


def _cap_roots(controller: str) -> list[tuple[Path, str]]:
    """Where a `controller` cgroup of the child's own can go: v2 where the controller is delegated to our
    subtree, v1 where its hierarchy is mounted."""
    roots = []
    v2 = _v2_root()
    if v2 is not None:
        try:
            if controller in (v2 / "cgroup.subtree_control").read_text().split():
                roots.append((v2, "cgroup2"))
        except OSError:
            pass
    if (v1 := _v1_root(controller, "cgroup.procs")) is not None:
        roots.append((v1, "cgroup1"))
    return roots


_KIND: list[str] = []  # the meter this process settled on, decided once
_CAPS: dict[str, str] = {}  # controller -> the kind that works here, or "procfs"
_KIND_LOCK = threading.Lock()


def _mkdir_under(root: Path) -> Path | None:
    path = root / f"t2j-{os.getpid()}-{next(_counter)}"
    try:
        path.mkdir()
    except OSError:
        return None
    return path


def _new_meter():
    if os.environ.get(_FORCE_ENV) == "procfs":
        return _ProcTree()
    with _KIND_LOCK:
        return _decide_meter()


def _decide_meter():
    if _KIND and _KIND[0] == "procfs":
        return _ProcTree()
    for root, kind in _cgroup_roots():
        if (_KIND and _KIND[0] != kind) or (path := _mkdir_under(root)) is None:
            continue
        meter = _Cgroup(path, kind)
        if not _KIND:  # a cgroup that cannot count or take a process is no clock
            if not meter._usage.is_file() or not _joinable(meter.prefix()):
                meter.close()
                continue
            _KIND.append(kind)
        return meter
    _KIND[:] = ["procfs"]
    return _ProcTree()


def _new_cap(controller: str, cap: float) -> _Cap | None:
    if not math.isfinite(cap) or os.environ.get(_FORCE_ENV) == "procfs":
        return None
    with _KIND_LOCK:
        if _CAPS.get(controller) == "procfs":
            return None
        for root, kind in _cap_roots(controller):
            if _CAPS.get(controller, kind) != kind or (path := _mkdir_under(root)) is None:
                continue
            try:
                box = _Cap(path, kind, controller, cap)
            except OSError:
                _Cgroup(path, kind).close()
                continue
            if controller not in _CAPS:
                if not _joinable(box.prefix()):
                    box.close()
                    continue
                _CAPS[controller] = kind
            return box
        _CAPS[controller] = "procfs"
        return None


def _joinable(prefix: list[str]) -> bool:
    try:
        return subprocess.run([*prefix, "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def meter_kind() -> str:
    """The CPU meter graded children get on this machine: "cgroup2", "cgroup1" or "procfs"."""
    meter = _new_meter()
    meter.close()
    return meter.kind


def cap_kinds() -> dict[str, str]:
    """How memory and task caps are kept here: {"memory": "cgroup2" | "cgroup1" | "procfs", "tasks": ...}."""
    out = {}
    for controller, name in (("memory", "memory"), ("pids", "tasks")):
        box = _new_cap(controller, 1 << 40 if controller == "memory" else 4096)
        out[name] = box.kind if box else "procfs"
        if box:
            box.close()
    return out


class _Box:
    """Everything one child is kept in: its CPU meter, its memory and tasks caps (kernel cgroups, or the /proc
    tree read by the grader), its file-size rlimit, the paths whose size is watched."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.cpu = _new_meter()
        self.memory = _new_cap("memory", limits.memory_bytes)
        self.pids = _new_cap("pids", limits.tasks)
        self.tree = self.cpu if isinstance(self.cpu, _ProcTree) else _ProcTree()
        self.peak_memory, self.peak_tasks, self.disk, self.largest = 0.0, 0, 0, 0
        self._reads = 0

    def prefix(self) -> list[str]:
        joins = [c.path for c in (self.cpu, self.memory, self.pids) if isinstance(c, _Cgroup)]
        script = "".join(f"echo $$ > {shlex.quote(str(p / 'cgroup.procs'))} && " for p in joins)
        if math.isfinite(self.limits.file_bytes):
            script += f"ulimit -f {max(1, int(self.limits.file_bytes) // 512)} && "
        return ["/bin/sh", "-c", script + 'exec "$@"', "sh"] if script else []

    def attach(self, pid: int) -> None:
        for c in (self.cpu, self.memory, self.pids):
            if c is not None:
                c.attach(pid)
        self.tree.attach(pid)

    def members(self) -> set[int]:
        out = self.tree.members()
        for c in (self.cpu, self.memory, self.pids):
            if isinstance(c, _Cgroup):
                out |= c.members()
        return out

    def check(self) -> str | None:
        """One reading; -> the cap it is past, or None."""
        lim = self.limits
        need_tree = self.memory is None and math.isfinite(lim.memory_bytes) or \
            self.pids is None and math.isfinite(lim.tasks)
        if need_tree and self.tree is not self.cpu:
            self.tree.members()
        mem = self.memory.current() if self.memory else (self.tree.resident_bytes() if need_tree else 0.0)
        tasks = self.pids.current() if self.pids else (self.tree.tasks() if need_tree else 0)
        self.peak_memory, self.peak_tasks = max(self.peak_memory, mem), max(self.peak_tasks, int(tasks))
        if (self.memory and self.memory.hit()) or mem > lim.memory_bytes:
            return "memory"
        if (self.pids and self.pids.hit()) or tasks > lim.tasks:
            return "tasks"
        self._reads += 1
        if lim.watch and self._reads % 5 == 0:  # a directory walk: every fifth reading
            return self._disk()
        return None

    def _disk(self) -> str | None:
        """Past the total, or a watched file at the file-size cap (a flood the rlimit cut short is a flood)."""
        self.disk, self.largest = _size(self.limits.watch)
        return "disk" if self.disk > self.limits.disk_bytes or self.largest >= self.limits.file_bytes else None

    def final(self) -> str | None:
        """After the child ended: a cap the kernel enforced, or a size past the cap, counts too."""
        if self.memory and self.memory.hit():
            return "memory"
        if self.pids and self.pids.hit():
            return "tasks"
        return self._disk() if self.limits.watch else None

    def close(self) -> None:
        for c in (self.cpu, self.memory, self.pids):
            if c is not None:
                c.close()


def _size(paths) -> tuple[int, int]:
    """(total bytes, the largest file) over files and directory trees."""
    sizes = []
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not os.path.isdir(p):
            sizes.append(st.st_size)
            continue
        for dirpath, _, files in os.walk(p):
            for f in files:
                try:
                    sizes.append(os.lstat(os.path.join(dirpath, f)).st_size)
                except OSError:
                    pass
    return sum(sizes), max(sizes, default=0)


# ---------------------------------------------------------------- watching and killing

def _kill_tree(box: _Box, root: int) -> None:
    for _ in range(50):  # until nothing is left: a member may fork while it is being killed
        found = box.members() | _descendants(root)
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


def _watch(box: _Box, root: int, done, started: float) -> Usage:
    exceeded, limits = None, box.limits
    while not done(POLL_S):
        cpu, wall = box.cpu.seconds(), time.monotonic() - started
        exceeded = "cpu" if cpu > limits.cpu_s else "wall" if wall > limits.wall_s else box.check()
        if exceeded:
            _kill_tree(box, root)
            break
    exceeded = exceeded or box.final()
    return Usage(box.cpu.seconds(), time.monotonic() - started, exceeded, box.cpu.kind, box.peak_memory,
                 box.peak_tasks, box.disk)


def run_tree(cmd: list[str], *, cwd, env, pass_fds=(), stdout=None, stderr=None,
             limits: Limits = Limits()) -> tuple[int | None, Usage]:
    """Popen `cmd` in its own session and box (cgroups where they can be made), kept to `limits` on the grader's
    clock; -> (exit code, or None where the grader killed it or it passed a cap; its usage)."""
    box = _Box(limits)
    try:
        try:
            proc = subprocess.Popen([*box.prefix(), *cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=stdout, stderr=stderr, start_new_session=True, pass_fds=pass_fds)
        finally:
            for fd in pass_fds:
                os.close(fd)
        started = time.monotonic()
        box.tree.attach(proc.pid)

        def done(wait_s: float) -> bool:
            try:
                proc.wait(timeout=wait_s)
                return True
            except subprocess.TimeoutExpired:
                return False

        usage = _watch(box, proc.pid, done, started)
        proc.wait()
        _kill_tree(box, proc.pid)  # what it left behind (a daemon it started) goes too
        return (None if usage.exceeded else proc.returncode), usage
    finally:
        box.close()


def watch_pid(pid: int, limits: Limits, finished: threading.Event) -> Usage:
    """Keep a process someone else started (the fork server's child, already running) to `limits` until
    `finished` is set; its tree is killed past a limit."""
    box = _Box(limits)
    try:
        box.attach(pid)
        usage = _watch(box, pid, finished.wait, time.monotonic())
        if box.members():
            _kill_tree(box, pid)
        return usage
    finally:
        box.close()
