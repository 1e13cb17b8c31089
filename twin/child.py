"""The sealed child's driver (the twin's twin of grader/probes/common.py, written for it): read the inputs file,
build the candidate-side context, run each property's probe, write the one outputs file.

Runs torch-free inside the grader's sandbox (twin/seal.py stages this package, the candidate-side probes and the
grader's exchange beside the guard). A probe that raises, or runs past its limit, fails its own property with the
reason; a context that cannot be made fails every property with it.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import time
import traceback

import jax
import numpy as np

from grader.isolation.exchange import write_outputs

__all__ = ["META", "main", "read_inputs", "write_inputs"]

META = "__meta__"  # the inputs file's one non-array entry: the JSON meta (task, assets, properties, limit)


class PropertyTimeout(BaseException):
    """Past a property's wall-clock limit (a BaseException: candidate code's `except Exception` keeps it)."""


def write_inputs(path, meta: dict, inputs: dict[str, dict[str, np.ndarray]]) -> None:
    """Trusted side: one .npz of "<key>/<name>" arrays plus the meta as a JSON string (no pickle either way)."""
    arrays = {f"{key}/{name}": np.asarray(v) for key, group in inputs.items() for name, v in group.items()}
    np.savez(path, **arrays, **{META: np.array(json.dumps(meta))})


def read_inputs(path) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z[META]))
        groups: dict[str, dict[str, np.ndarray]] = {}
        for name in z.files:
            if name != META:
                key, _, leaf = name.rpartition("/")
                groups.setdefault(key, {})[leaf] = z[name]
    return meta, groups


def _on_alarm(signum, frame):
    raise PropertyTimeout()


def _run(fn, limit_s: float, *args):
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        return fn(*args), None
    except PropertyTimeout:
        return None, f"timeout: past {limit_s:.0f} s"
    except Exception as e:  # the candidate's failure, reported with its exception
        traceback.print_exc()
        return None, f"{type(e).__name__}: {e}"[:1500]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(inputs_path, outputs_path):
    jax.config.update("jax_default_matmul_precision", "highest")
    meta, groups = read_inputs(inputs_path)
    base = os.path.dirname(os.path.abspath(inputs_path))  # assets sit beside the inputs, wherever it is mounted
    meta["assets"] = {k: os.path.join(base, v) for k, v in meta["assets"].items()}
    side = importlib.import_module(f"twin.candidate_side.{meta['task_class']}")
    keys, limit = meta["properties"], float(meta.get("property_timeout_s", 300.0))
    started = time.perf_counter()
    ctx, setup_error = _run(side.make_ctx, limit, meta)
    outputs, errors, seconds = {}, {}, {}
    for key in keys:
        t0 = time.perf_counter()
        name = key.split("/", 1)[1]
        if setup_error is not None:
            errors[key] = f"setup: {setup_error}"
        elif name not in side.PROBES:
            errors[key] = f"the twin has no candidate-side probe {name!r}"
        else:
            value, error = _run(side.PROBES[name], limit, ctx, groups.get(key, {}))
            if error is None:
                outputs[key] = {k: np.asarray(jax.device_get(v)) for k, v in value.items()}
            else:
                errors[key] = error
        seconds[key] = time.perf_counter() - (started if setup_error is not None else t0)
    write_outputs(outputs_path, outputs, errors, seconds)
