"""The sandboxed child's driver: read the inputs-only file, run each check's probe, write outputs.

Every L0-L4 probe runs under a wall-clock limit of its own (SIGALRM in the main thread), so a
Python-level hang costs that check only and the rest of the group still runs; a hang inside C
code never returns to the interpreter, and the group's process timeout (grader/app.py) kills it.
L5/L6 checks share their level's budget in CPU seconds of this process (time.process_time, SIGPROF),
the clock the grader keeps the whole process tree to from outside (grader/isolation/clock.py): stopping
here at the budget is what lets an honest child keep the checks it finished in time. These limits
are the child's own, so a candidate can stop them; the verdict is the grader's clock, never these.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
import traceback

import jax
import numpy as np

from catalog.h5schema import read_arrays
from grader.isolation import _guard
from grader.isolation.exchange import write_outputs

SPENT_S = 0.05  # CPU-s: a timed level's budget with less than this left is spent
DEFAULT_CHECK_TIMEOUT_S = 120.0  # L0-L4, when meta has no "check_timeout_s"; L5/L6 get the time budget
_REPEAT_S = 1.0  # the alarm re-fires until the probe lets go (a probe may swallow one exception)


def n(x):
    return np.asarray(jax.device_get(x))


class CheckTimeout(BaseException):
    """Raised by the alarm inside a probe past its limit; a BaseException, so `except Exception` in
    candidate code does not swallow it."""


class _Alarm:
    """One limit at a time: wall-clock on SIGALRM, or this process's CPU time on SIGPROF; a no-op where
    signals are unavailable."""

    def __init__(self):
        self.usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.armed = False
        self.fired = False
        self.limit = math.inf
        self.cpu = False

    def _on_alarm(self, signum, frame):
        if self.armed:  # a late alarm after disarm() is ignored
            self.fired = True
            raise CheckTimeout(f"past {self.limit:.1f} s")

    def arm(self, limit: float, cpu: bool = False) -> None:
        self.fired, self.limit, self.cpu = False, limit, cpu
        if self.usable and math.isfinite(limit) and limit > 0:
            sig, timer = (signal.SIGPROF, signal.ITIMER_PROF) if cpu else (signal.SIGALRM, signal.ITIMER_REAL)
            signal.signal(sig, self._on_alarm)  # again each time: a probe may have replaced it
            self.armed = True
            signal.setitimer(timer, limit, _REPEAT_S)

    def disarm(self) -> None:
        self.armed = False  # first: an alarm landing from here on is ignored
        if self.usable:
            signal.setitimer(signal.ITIMER_PROF if self.cpu else signal.ITIMER_REAL, 0)

    def run(self, limit, fn, *args, cpu: bool = False):
        """fn(*args) under `limit` seconds (of CPU with `cpu`): (value, error reason or None)."""
        unit = "CPU-s" if cpu else "s"
        try:
            try:
                self.arm(limit, cpu)
                value = fn(*args)
            finally:
                self.disarm()
        except CheckTimeout:
            self.disarm()  # the alarm may have landed inside the finally above, before the disarm
            return None, f"timeout: past the {limit:.1f} {unit} limit"
        except Exception as e:
            traceback.print_exc()
            if self.fired:  # candidate code caught the alarm and raised something else
                return None, f"timeout: past the {limit:.1f} {unit} limit"
            return None, _reason(e)
        if self.fired:  # it caught the alarm and returned anyway
            return None, f"timeout: past the {limit:.1f} {unit} limit"
        return value, None


def _reason(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    if _guard.IMPORT_MARK in text:
        return f"torch import: {text}"[:500]
    if _guard.REFERENCES_MARK in text:
        return f"reads references/: {text}"[:500]
    if _guard.NETWORK_MARK in text:
        return f"network access: {text}"[:500]
    return f"crash: {text}"[:500]


def check_limit(meta: dict, level: str) -> float:
    """The wall-clock limit of one L0-L4 check: meta["check_timeout_s"] (default 120 s). L5/L6 checks share
    their level's CPU budget meta["time_budget_s"] instead (run_probes)."""
    if level in ("L5", "L6"):
        return float(meta.get("time_budget_s", math.inf))
    return float(meta.get("check_timeout_s", DEFAULT_CHECK_TIMEOUT_S))


def run_probes(inputs_path, outputs_path, make_ctx, probes, cpu_origin: float = 0.0):
    """A probe that raises or hangs fails its own check (with the reason), never the run. L5/L6 checks share
    one budget, meta["time_budget_s"] CPU seconds of this process from its start (interpreter, imports and
    setup included, as the grader's clock counts them): each runs under what is left of it, and a check that
    ends past it fails as 'timeout' (too slow counts as wrong), as does every check after it. A context that
    cannot be made (the candidate's module does not import) fails every check with that reason. `cpu_origin`:
    where this process's CPU clock counts from (0: its start; a test driving this in its own process passes
    time.process_time())."""
    groups, attrs = read_arrays(inputs_path)
    meta = attrs["meta"]
    probes = probes(meta) if callable(probes) else probes  # a method's table is found from its config
    # asset paths are relative to the inputs directory: the sandbox mounts it where the grader cannot know
    base = os.path.dirname(os.path.abspath(inputs_path))
    meta["assets"] = {k: os.path.join(base, v) for k, v in (meta.get("assets") or {}).items()}
    budget = float(meta.get("time_budget_s", float("inf")))
    alarm = _Alarm()
    keys = list(meta["checks"])
    cov = _start_coverage() if meta.get("coverage") else None
    compile_clock = _CompileClock() if meta.get("measure_compile") else None
    started = time.perf_counter()
    timed = lambda key: key.split("/", 1)[0] in ("L5", "L6")  # noqa: E731
    # a fork of the sweep's fork server is charged the imports its server did for it (grader/isolation/forkserver.py)
    cpu_origin -= float(os.environ.get("T2J_CHARGED_CPU_S") or 0.0)
    left = lambda: budget - (time.process_time() - cpu_origin)  # noqa: E731  CPU of this process since it started
    any_timed = any(timed(k) for k in keys)
    setup_limit = (left() if any_timed else min(check_limit(meta, k.split("/", 1)[0]) for k in keys)) if keys \
        else math.inf
    ctx, setup_error = alarm.run(setup_limit, make_ctx, meta, cpu=any_timed)
    if setup_error is not None:
        seconds = time.perf_counter() - started
        write_outputs(outputs_path, {}, {k: f"setup: {setup_error}"[:500] for k in keys}, {k: seconds for k in keys},
                      coverage=_stop_coverage(cov), compile_seconds=_compile_seconds(compile_clock, keys))
        return
    outputs, errors, seconds = {}, {}, {}
    for key in keys:
        level, name = key.split("/", 1)
        started = time.perf_counter()
        if compile_clock is not None:
            compile_clock.key = key
        # A sliver left is spent: SIGPROF and process_time count the same CPU at different grains, so after a
        # check killed at the budget the clock may read a few ms under it.
        if timed(key) and left() <= SPENT_S:
            value, error = None, f"timeout: the {level} budget of {budget:.1f} CPU-s was spent before this check"
        elif name not in probes:
            value, error = None, f"crash: the grader has no probe for {name!r}"
        else:
            value, error = alarm.run(left() if timed(key) else check_limit(meta, level), probes[name], ctx,
                                     groups.get(key, {}), cpu=timed(key))
        if error is None:
            outputs[key] = value
        else:
            errors[key] = error
        seconds[key] = time.perf_counter() - started
        if timed(key) and left() < 0 and key not in errors:
            errors[key] = f"timeout: {level} took {budget - left():.1f} CPU-s > budget {budget:.1f} CPU-s"
            outputs.pop(key, None)
    write_outputs(outputs_path, outputs, errors, seconds, coverage=_stop_coverage(cov),
                  compile_seconds=_compile_seconds(compile_clock, keys))


class _CompileClock:
    """Seconds JAX spends tracing, lowering and compiling, per check (jax.monitoring's compile events).
    Read by the calibration only (grader/timing/budget.py), on the repo's own oracle: never a candidate's word."""
    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.key, self.seconds = "setup", {}
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **_):
        if event in self.EVENTS:
            self.seconds[self.key] = self.seconds.get(self.key, 0.0) + float(duration)


def _compile_seconds(clock, keys) -> dict | None:
    if clock is None:
        return None
    out = {k: clock.seconds.get(k, 0.0) for k in keys}
    if keys:  # setup's compilations (loading, converting) count for the first check
        out[keys[0]] += clock.seconds.get("setup", 0.0)
    return out


CANDIDATE_PACKAGES = ("jax_oracles", "serving_engine", "conversion")


def _start_coverage():
    """Branch coverage of the candidate's packages while the probes run (grader.coverage reads it)."""
    import coverage
    cov = coverage.Coverage(branch=True, data_file=None, config_file=False, source_pkgs=list(CANDIDATE_PACKAGES))
    cov.set_option("run:disable_warnings", ["module-not-imported", "no-data-collected"])
    cov.start()
    return cov


def _stop_coverage(cov) -> dict | None:
    """{path relative to the candidate root: {"lines": [...], "arcs": [[a, b], ...]}}, or None."""
    if cov is None:
        return None
    cov.stop()
    data, out = cov.get_data(), {}
    for path in data.measured_files():
        parts = path.replace(os.sep, "/").split("/")
        roots = [i for i, p in enumerate(parts) if p in CANDIDATE_PACKAGES]
        if not roots:
            continue
        rel = "/".join(parts[roots[0]:])
        out[rel] = {"lines": sorted(data.lines(path) or []), "arcs": sorted([a, b] for a, b in data.arcs(path) or [])}
    return out
