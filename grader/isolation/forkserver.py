"""A fork server for the seeded-defect sweep's own mutants: children that skip the interpreter's start.

A sandboxed child spends ~1.7 s of its ~2 s fixed cost importing jax (2-core machine, docs/SWEEP.md). The sweep
grades only the repo's own oracle mutants, trusted code, so it may run their children as forks of one verifier
interpreter that has installed the guard (grader/isolation/_guard.py) and imported jax, numpy, h5py and the grader's
child-side modules, and nothing of any candidate: each fork gets its own session, working directory,
environment, stdout/stderr files and sys.path entries (its staged copies of the grader and the candidate), then
runs the entry exactly as a trusted child's bootstrap does (grader/isolation/gate.py). JAX's backend is not initialised
before the fork (the server checks that no thread but numpy's
OpenBLAS pool, which re-makes itself after a fork, runs in it), so every child starts its backend, its
caches and its compilations afresh, as a new interpreter would; the JAX settings that are read from the
environment at import (the platform, the persistent compilation cache) are the server's, the same for every
child of a sweep. Never used for a candidate: gate.run_sandboxed accepts a fork server only with trusted=True.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from grader.isolation import _guard, clock, gate, sandbox

__all__ = ["CHARGED_ENV", "ForkServer"]

CHARGED_ENV = "T2J_CHARGED_CPU_S"  # CPU seconds a forked child is charged for what its server did before the fork

# Runs in the verifier interpreter (-I): argv[1] = the directory holding the guard and the grader copy.
_SERVER = r"""
import json, os, select, sys, threading, time, traceback
base = sys.argv[1]
sys.path[:0] = [os.path.join(base, "boot"), os.path.join(base, "grader_pkg")]
import _t2j_gate_guard as guard
guard.install()
count = lambda: len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 99  # noqa: E731
import numpy  # noqa: F401  its OpenBLAS starts its worker threads here and re-makes them after a fork (atfork)
blas = count()
import h5py, jax, jax.numpy  # noqa: F401,E401  the child's heavy imports, done once
import grader.isolation.exchange, catalog.h5schema, grader.probes.common  # noqa: F401,E401
threads = count() - blas + 1  # must be 1: jax's backend and runtime threads start in each child, not here
out = os.fdopen(os.dup(1), "w", buffering=1)
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)
# what a cold child pays before its probes run and a forked one does not: the grader charges it to every fork
print(json.dumps({"ready": threads == 1, "threads": threads, "startup_cpu_s": time.process_time()}), file=out)
running = {}
buf = b""
while True:
    ready, _, _ = select.select([0], [], [], 0.02 if running else None)
    for pid in list(running):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            print(json.dumps({"id": running.pop(pid), "status": code}), file=out)
    if not ready:
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(out.fileno())  # the server's reply pipe is not the child's
                os.setsid()
                fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0)
                fd = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600); os.dup2(fd, 1)
                fd = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600); os.dup2(fd, 2)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                sys.path[:0] = req["path"]
                guard.run_entry(req["entry"], req["inputs"], req["outputs"])
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        running[pid] = req["id"]
        print(json.dumps({"id": req["id"], "pid": pid}), file=out)
"""


class ForkServer:
    """One server process per sweep (start(), close()); run() is thread-safe."""

    def __init__(self, env: dict[str, str]):
        """env: the server's environment, which must carry what every child's JAX reads at import
        (JAX_PLATFORMS, the shared compilation cache): gate.fork_server_env builds it."""
        self._tmp = Path(tempfile.mkdtemp(prefix="t2j-forkserver-"))
        (self._tmp / "boot").mkdir()
        shutil.copy2(_guard.__file__, self._tmp / "boot" / "_t2j_gate_guard.py")
        gate.stage_grader_packages(self._tmp / "grader_pkg")
        python = sandbox.verifier().python
        self._proc = subprocess.Popen([str(python), "-I", "-c", _SERVER, str(self._tmp)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        hello = json.loads(self._proc.stdout.readline() or b'{"ready": false, "threads": "none"}')
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"the fork server cannot fork safely ({hello.get('threads')} threads after import)")
        # A forked child skips the interpreter start and the imports its server did once. The budgets count them
        # (the oracle's calibrated CPU is a cold child's), so each fork is charged the server's startup CPU: on
        # the grader's clock (its limit lowered, its usage raised) and on its own copy of the budget
        # (CHARGED_ENV, read by grader/probes/common.py). A mutant then faces the budget a real grading sets.
        self.startup_cpu_s = float(hello.get("startup_cpu_s", 0.0))
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, dict] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                slot = self._waiting.get(msg["id"])
            if slot is not None:
                slot.update(msg)
                slot["event"].set() if "status" in msg else slot["started"].set()
        with self._lock:  # the server is gone: nothing more will come
            for slot in self._waiting.values():
                slot.setdefault("status", -9)
                slot["started"].set()
                slot["event"].set()

    def run(self, *, path: list[str], cwd: str, env: dict[str, str], entry: str, inputs: str, outputs: str,
            stdout: str, stderr: str, limits) -> tuple[int | None, object]:
        """Run one child kept to `limits` (grader/isolation/clock.py) on the grader's clock; -> (its exit code, negative for
        a signal, or None where it was killed at a limit; its clock.Usage)."""
        with self._lock:
            self._next += 1
            rid = self._next
            slot = self._waiting[rid] = {"event": threading.Event(), "started": threading.Event()}
            env = {**env, CHARGED_ENV: repr(self.startup_cpu_s)}
            req = {"id": rid, "path": path, "cwd": cwd, "env": env, "entry": entry, "inputs": inputs,
                   "outputs": outputs, "stdout": stdout, "stderr": stderr}
            self._proc.stdin.write(json.dumps(req).encode() + b"\n")
            self._proc.stdin.flush()
        try:
            slot["started"].wait()
            if "pid" not in slot:  # the server died before it forked
                return slot.get("status", -9), clock.Usage(0.0, 0.0, None, "procfs")
            charged = replace(limits, cpu_s=limits.cpu_s - self.startup_cpu_s)
            usage = clock.watch_pid(slot["pid"], charged, slot["event"])
            usage = replace(usage, cpu_s=usage.cpu_s + self.startup_cpu_s)
            if usage.exceeded:
                try:
                    os.killpg(slot["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                slot["event"].wait()
                return None, usage
            return slot["status"], usage
        finally:
            with self._lock:
                self._waiting.pop(rid, None)

    def close(self) -> None:
        try:
            if self._proc.stdin:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            self._proc.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
