"""How fast this machine runs what a graded child runs: the speed probe that scales every L5/L6 budget.

The budgets (grader/timing/budget.py) are calibrated in CPU seconds on one machine. On another CPU the same
child takes other CPU seconds, so at grade time the grader runs a fixed probe, in the verifier
interpreter a child runs in, on the clock it keeps the child to (grader/isolation/clock.py): start the interpreter
and import jax, trace and compile a small transformer-shaped function at two shapes (XLA's compiler is
where a jitted port spends most of its L5 time), run it, and spin a pure-Python loop (dispatch-bound code).
speed = probe CPU seconds here / probe CPU seconds on the calibration machine (grader/timing/budgets.yaml); every
budget is multiplied by it. CPU seconds, not wall: another process's CPU is not counted and a child
waiting for a core accrues none; what contention still adds to a child's own CPU (shared caches, a host's
SMT siblings: up to ~1.7x measured beside two hogs) the probe, run under the same load, mostly sees too,
and the 2x headroom takes the rest.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import threading
import time

from grader.isolation import clock, gate, sandbox

__all__ = ["PROBE", "SpeedError", "probe_cpu_seconds", "machine_speed"]

PROBE = r"""
import jax, jax.numpy as jnp, numpy as np
def block(x, w):
    for i in range(w.shape[0]):
        h = x @ w[i]
        a = jax.nn.softmax(h @ h.T / 8.0, axis=-1) @ h
        x = x + jnp.tanh(a) * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6)
    return x
rng = np.random.default_rng(0)
for n, d in ((16, 32), (32, 64)):
    w = jnp.asarray(rng.standard_normal((4, d, d), dtype=np.float32) / d)
    x = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))
    f = jax.jit(block)
    for _ in range(30):
        x = f(x, w)
    x.block_until_ready()
total = 0
for i in range(600_000):
    total += i % 7
print(float(x.sum()), total)
"""

_RUNS = 2
_TTL_S = 600.0  # a probe figure is reused this long within one grading process (the sweep grades hundreds)
_BOUNDS = (0.1, 10.0)  # a machine further off than this from the calibration one is not graded on
_cache: dict[str, tuple[float, list[float]]] = {}
_lock = threading.Lock()


class SpeedError(RuntimeError):
    pass


def probe_cpu_seconds(runs: int = _RUNS) -> list[float]:
    """The probe's CPU seconds (whole process tree, grader's clock), once per run, each in a fresh
    verifier interpreter."""
    python = str(sandbox.verifier().python)
    env = gate._clean_env({"JAX_PLATFORMS": "cpu"})
    out = []
    with tempfile.TemporaryDirectory(prefix="t2j-speed-") as tmp:
        for _ in range(runs):
            with open(os.path.join(tmp, "log"), "wb") as log:
                code, usage = clock.run_tree([python, "-I", "-c", PROBE], cwd=tmp, env=env, stdout=log, stderr=log,
                                             limits=clock.Limits(cpu_s=300.0, wall_s=600.0))
            if code != 0:
                with open(os.path.join(tmp, "log"), "rb") as log:
                    raise SpeedError(f"the speed probe failed (exit {code}): {log.read()[-2000:].decode(errors='replace')}")
            out.append(round(usage.cpu_s, 3))
    return out


def measured(runs: int = _RUNS, fresh: bool = False) -> list[float]:
    """This machine's probe figures, reused for _TTL_S within the process unless `fresh`."""
    with _lock:
        hit = _cache.get("here")
        if hit and not fresh and time.monotonic() - hit[0] < _TTL_S:
            return hit[1]
        figures = probe_cpu_seconds(runs)
        _cache["here"] = (time.monotonic(), figures)
        return figures


def machine_speed(reference_cpu_s: float | None, runs: int = _RUNS) -> tuple[float, dict]:
    """-> (speed, how it was derived): the least probe CPU seconds here over the calibration machine's.
    With no calibration figure the speed is 1.0, said so."""
    if reference_cpu_s is None or not math.isfinite(reference_cpu_s) or reference_cpu_s <= 0:
        return 1.0, {"speed": 1.0, "probe_cpu_s": None, "probe_reference_cpu_s": None,
                     "note": "no calibration probe figure: budgets unscaled"}
    figures = measured(runs)
    here = min(figures)  # noise only ever adds CPU: the quickest run is the machine
    speed = here / reference_cpu_s
    if not _BOUNDS[0] <= speed <= _BOUNDS[1]:
        raise SpeedError(f"this machine runs the speed probe in {here:.2f} CPU-s against {reference_cpu_s:.2f} on "
                         f"the calibration machine ({speed:.2f}x): too far off to scale budgets; recalibrate here "
                         f"(make calibrate)")
    return speed, {"speed": round(speed, 4), "probe_cpu_s": figures, "probe_reference_cpu_s": reference_cpu_s,
                   "meter": clock.meter_kind()}
