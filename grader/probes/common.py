"""The sandboxed child's driver: read the inputs-only file, run each check's probe, write outputs."""
from __future__ import annotations

import time
import traceback

import jax
import numpy as np

from grader.h5schema import read_arrays, write_arrays


def n(x):
    return np.asarray(jax.device_get(x))


def run_probes(inputs_path, outputs_path, make_ctx, probes):
    """A probe that raises fails its own check (with the reason), never the run. L5/L6 probes past the
    time budget fail as 'timeout': too slow counts as wrong."""
    groups, attrs = read_arrays(inputs_path)
    meta = attrs["meta"]
    ctx = make_ctx(meta)
    budget = float(meta.get("time_budget_s", float("inf")))
    outputs, errors, seconds = {}, {}, {}
    for key in meta["checks"]:
        level, name = key.split("/", 1)
        started = time.perf_counter()
        try:
            outputs[key] = probes[name](ctx, groups.get(key, {}))
        except Exception as e:
            errors[key] = f"crash: {type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        seconds[key] = time.perf_counter() - started
        if level in ("L5", "L6") and seconds[key] > budget and key not in errors:
            errors[key] = f"timeout: {seconds[key]:.1f} s > budget {budget:.1f} s"
    write_arrays(outputs_path, outputs, attrs={"errors": errors, "seconds": seconds})
