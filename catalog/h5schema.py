"""The HDF5 reference schema: the contract between recorder/ (writer) and grader/ (reader).

references/<task>.h5
  attrs: schema_version, task, created, device, dtype, seed, torch_version, package_versions (json),
         source_sha256 (json {path: sha}), checkpoint_sha256, config_sha256, wall_clock_s
  /<level>/<check>/inputs/<name>    datasets the candidate receives (levels L0-L6; L0 = spec)
  /<level>/<check>/outputs/<name>   datasets the candidate must reproduce
  group attrs: aspect, measure (+ optional noise: run-to-run spread of the score)
  /L6/band                          [lo, hi] of the held-out metric over seed-varied reference runs

Only h5py and numpy here: the grader reads references torch-free.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

SCHEMA_VERSION = 1
LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5", "L6")
ASPECTS = ("spec", "numeric", "behavioral")
MEASURES = ("pass", "tensor", "scalar", "distributional", "banded", "agreement")
ROOT_ATTRS = ("schema_version", "task", "created", "device", "dtype", "seed", "torch_version",
              "package_versions", "source_sha256", "checkpoint_sha256", "config_sha256", "wall_clock_s")


class ReferenceError(RuntimeError):
    """A reference file that is missing, corrupt, truncated, stale or off-schema."""


@dataclass
class CheckRecord:
    level: str
    name: str
    aspect: str
    measure: str
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)  # extra, e.g. {"time_budget_s": 60.0}

    @property
    def key(self) -> str:
        return f"{self.level}/{self.name}"


@dataclass
class Reference:
    attrs: dict
    checks: dict[str, CheckRecord]  # "L3/logits_0" -> record
    band: np.ndarray | None

    def level(self, level: str) -> list[CheckRecord]:
        return [c for c in self.checks.values() if c.level == level]


def _attr(v):
    """HDF5 attributes: containers as JSON, str subclasses (torch.__version__) as plain str."""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True)
    return str(v) if isinstance(v, str) else v


COMPRESS_BYTES = 1 << 16  # arrays this large are stored gzip'd with byte shuffling (lossless; h5py reads them as is)


def _put(group: h5py.Group, name: str, value, stored: dict | None = None) -> None:
    """One array under `group`. `stored` (a reference's writer): an array already written in this file, same dtype,
    shape and bytes, is hard-linked instead of stored twice (a vision-language batch's pixels reach several
    checks); a large numeric one is compressed."""
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # references are fp32 by contract
    if arr.dtype.kind in "US":
        group.create_dataset(name, data=arr.astype(h5py.string_dtype()))
        return
    if stored is None or arr.nbytes < COMPRESS_BYTES:
        group.create_dataset(name, data=arr)
        return
    key = (arr.dtype.str, arr.shape, hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest())
    if key in stored:
        group[name] = group.file[stored[key]]  # a hard link: one object, read the same through every name
        return
    stored[key] = group.create_dataset(name, data=arr, compression="gzip", compression_opts=4, shuffle=True).name


def link_names(group: h5py.Group, prefix: str = "") -> list[str]:
    """Every path below `group` by link: an array stored once and linked from several checks is listed at each
    (h5py's visit lists an object once)."""
    out = []
    for name, obj in group.items():
        out.append(prefix + name)
        if isinstance(obj, h5py.Group):
            out += link_names(obj, f"{prefix}{name}/")
    return out


def write_reference(path: str | Path, attrs: dict, checks: list[CheckRecord],
                    band: tuple[float, float] | None = None) -> None:
    """Write atomically: a crash mid-write never leaves a half file under the real name."""
    path = Path(path)
    missing = [k for k in ROOT_ATTRS if k not in attrs]
    if missing:
        raise ReferenceError(f"reference attrs missing {missing}")
    tmp = path.with_suffix(".h5.tmp")
    stored: dict = {}
    with h5py.File(tmp, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = _attr(v)
        for c in checks:
            _validate_check(c)
            g = f.create_group(c.key)
            g.attrs["aspect"], g.attrs["measure"] = c.aspect, c.measure
            for k, v in c.attrs.items():
                g.attrs[k] = _attr(v)
            for sub, data in (("inputs", c.inputs), ("outputs", c.outputs)):
                sg = g.create_group(sub)
                for name, value in data.items():
                    _put(sg, name, value, stored)
        if band is not None:
            f.create_dataset("L6/band", data=np.asarray(band, np.float32))
    tmp.replace(path)


def _validate_check(c: CheckRecord) -> None:
    if c.level not in LEVELS:
        raise ReferenceError(f"{c.key}: unknown level")
    if c.aspect not in ASPECTS:
        raise ReferenceError(f"{c.key}: unknown aspect {c.aspect!r}")
    if c.measure not in MEASURES:
        raise ReferenceError(f"{c.key}: unknown measure {c.measure!r}")
    if not c.outputs:
        raise ReferenceError(f"{c.key}: a check needs at least one output")


def _decode(v):
    if isinstance(v, bytes):
        v = v.decode()
    if isinstance(v, str) and v[:1] in "{[":
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    if isinstance(v, np.generic):
        return v.item()
    return v


def _read_group(g: h5py.Group) -> dict[str, np.ndarray]:
    out = {}
    for name, ds in g.items():
        arr = ds[()]
        if ds.dtype.kind == "O":
            arr = np.asarray(ds.asstr()[()])
        out[name] = np.asarray(arr)
    return out


def read_reference(path: str | Path) -> Reference:
    """Read and validate a reference; any defect is a ReferenceError naming the file and the cause."""
    path = Path(path)
    if not path.is_file():
        raise ReferenceError(f"{path}: no such reference (record it with `make record TASK=...`)")
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _decode(v) for k, v in f.attrs.items()}
            missing = [k for k in ROOT_ATTRS if k not in attrs]
            if missing:
                raise ReferenceError(f"{path}: root attributes missing {missing}")
            if attrs["schema_version"] != SCHEMA_VERSION:
                raise ReferenceError(f"{path}: schema_version {attrs['schema_version']} != {SCHEMA_VERSION}"
                                     " (re-record it)")
            checks: dict[str, CheckRecord] = {}
            for level in f:
                if level not in LEVELS:
                    raise ReferenceError(f"{path}: unexpected top-level group {level!r}")
                for name, g in f[level].items():
                    if not isinstance(g, h5py.Group):
                        continue  # /L6/band
                    if "outputs" not in g or "inputs" not in g:
                        raise ReferenceError(f"{path}: {level}/{name} lacks inputs/ or outputs/")
                    extra = {k: _decode(v) for k, v in g.attrs.items() if k not in ("aspect", "measure")}
                    c = CheckRecord(level, name, _decode(g.attrs.get("aspect")), _decode(g.attrs.get("measure")),
                                    _read_group(g["inputs"]), _read_group(g["outputs"]), extra)
                    _validate_check(c)
                    checks[c.key] = c
            band = np.asarray(f["L6/band"][()]) if "L6/band" in f else None
    except ReferenceError:
        raise
    except (OSError, KeyError, ValueError) as e:  # h5py raises OSError on truncated/corrupt files
        raise ReferenceError(f"{path}: corrupt or truncated HDF5 ({e})") from e
    if not checks:
        raise ReferenceError(f"{path}: holds no checks")
    return Reference(attrs, checks, band)


def write_arrays(path: str | Path, groups: dict[str, dict[str, np.ndarray]], attrs: dict | None = None) -> None:
    """Flat exchange file for the sandbox: groups of named arrays (check key -> arrays)."""
    with h5py.File(path, "w") as f:
        for k, v in (attrs or {}).items():
            f.attrs[k] = _attr(v)
        for key, arrays in groups.items():
            g = f.require_group(key)
            for name, value in arrays.items():
                _put(g, name, value)


def read_arrays(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    with h5py.File(path, "r") as f:
        attrs = {k: _decode(v) for k, v in f.attrs.items()}
        groups: dict[str, dict[str, np.ndarray]] = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Group) and any(isinstance(v, h5py.Dataset) for v in obj.values()):
                groups[name] = _read_group(obj)
        f.visititems(visit)
        # groups holding no datasets (a check with no inputs) still count
        for lvl in f:
            if isinstance(f[lvl], h5py.Group):
                for n, g in f[lvl].items():
                    if isinstance(g, h5py.Group):
                        groups.setdefault(f"{lvl}/{n}", {})
    return groups, attrs
