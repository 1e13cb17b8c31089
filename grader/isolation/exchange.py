"""What a sandboxed child hands back: one zip of .npy arrays and a JSON of errors and timings.

The child writes it (write_outputs, inside the sandbox); the grader reads it (read_outputs) as
untrusted data. HDF5 is no longer used in this direction: an HDF5 file can hold external links,
virtual datasets and external raw storage, each of which makes the reader open another file (a
reference, say), and libhdf5 is a large C parser. Here the grader opens exactly one path, refuses
to follow a link there or to block on a FIFO, bounds every size before allocating, parses .npy
headers itself (no pickle, no object or structured dtypes) and accepts only the check keys it
asked for. Anything else raises UntrustedOutput, which scores the child's checks 0 with the reason.

Standard library and numpy only: the sandboxed child imports this module from its grader copy.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import zipfile
import zlib

import numpy as np

__all__ = ["MAX_BYTES", "UntrustedOutput", "read_compile_seconds", "read_coverage", "read_outputs",
           "write_outputs"]

MAX_BYTES = 1 << 30       # the whole file, and all arrays together, uncompressed
MAX_MEMBERS = 100_000
MAX_META_BYTES = 16 << 20
MAX_REASON_CHARS = 2000
META = "meta.json"
COVERAGE = "coverage.json"  # only when the grader asked for it: executed lines and arcs per candidate file
COMPILE = "compile.json"  # only when the calibration asked for it: JAX compile seconds per check
MAX_COVERAGE_BYTES = 64 << 20
_SOURCE = re.compile(r"(jax_oracles|serving_engine|conversion)(/[A-Za-z0-9_]{1,100}){1,6}\.py")
_KEY = re.compile(r"L[0-6]/[A-Za-z0-9_.-]{1,200}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_KINDS = frozenset("biufcUS")


class UntrustedOutput(ValueError):
    """The child's output file is not what a well-behaved child writes."""


def write_outputs(path, groups: dict[str, dict[str, np.ndarray]], errors: dict[str, str],
                  seconds: dict[str, float], coverage: dict | None = None,
                  compile_seconds: dict[str, float] | None = None) -> None:
    """Child side: groups (check key -> {name: array}), per-check error reasons and seconds; coverage
    ({relative source path: {"lines": [...], "arcs": [[a, b], ...]}}) and compile seconds per check when the
    grader asked for them."""
    tmp = f"{path}.partial"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for key, arrays in groups.items():
            for name, value in arrays.items():
                arr = np.asarray(value)
                if arr.dtype == np.float64:
                    arr = arr.astype(np.float32)  # fp32 by contract, as the references
                elif arr.dtype.kind == "O":  # strings read from an HDF5 input
                    arr = arr.astype(str)
                buf = io.BytesIO()
                np.lib.format.write_array(buf, arr, allow_pickle=False)
                z.writestr(f"{key}/{name}.npy", buf.getvalue())
        z.writestr(META, json.dumps({"checks": sorted(groups), "errors": errors,
                                     "seconds": {k: float(v) for k, v in seconds.items()}}))
        if coverage is not None:
            z.writestr(COVERAGE, json.dumps(coverage))
        if compile_seconds is not None:
            z.writestr(COMPILE, json.dumps({k: float(v) for k, v in compile_seconds.items()}))
    os.replace(tmp, path)


def _read_file(path) -> bytes:
    try:  # O_NOFOLLOW: a symlink the child planted (to a reference, say) is refused, never followed
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UntrustedOutput(f"cannot open the output file as a plain file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedOutput("the output is not a regular file")
        if st.st_size > MAX_BYTES:
            raise UntrustedOutput(f"the output file is {st.st_size} bytes, over the {MAX_BYTES} limit")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise UntrustedOutput("the output file grew past the size limit while being read")
    return data


def _array(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    with z.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"npy version {version}")
        except ValueError as e:
            raise UntrustedOutput(f"{info.filename}: not a plain .npy array ({e})") from None
        if dtype.kind not in _KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise UntrustedOutput(f"{info.filename}: dtype {dtype} is not a plain numeric or string dtype")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise UntrustedOutput(f"{info.filename}: bad shape {shape}")
        count = math.prod(shape)
        header = f.tell()
        if count * dtype.itemsize != info.file_size - header:  # checked before any allocation
            raise UntrustedOutput(f"{info.filename}: header says {count} x {dtype} but the data is "
                                  f"{info.file_size - header} bytes")
        data = f.read(info.file_size - header)
    order = "F" if fortran and len(shape) > 1 else "C"
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape, order=order).copy()


def _meta(raw: bytes, expected: frozenset[str]) -> tuple[list, dict, dict]:
    def no_constants(name):  # NaN/Infinity in a timing
        raise ValueError(f"{name} is not allowed")
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UntrustedOutput(f"{META} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(meta, dict) or set(meta) != {"checks", "errors", "seconds"}:
        raise UntrustedOutput(f"{META} does not hold exactly checks, errors, seconds")
    checks, errors, seconds = meta["checks"], meta["errors"], meta["seconds"]
    if not (isinstance(checks, list) and isinstance(errors, dict) and isinstance(seconds, dict)):
        raise UntrustedOutput(f"{META}: checks must be a list, errors and seconds objects")
    for what, keys in (("checks", checks), ("errors", list(errors)), ("seconds", list(seconds))):
        bad = [k for k in keys if not isinstance(k, str) or k not in expected]
        if bad:
            raise UntrustedOutput(f"{META}: {what} names checks that were not asked for: {str(bad[:5])[:300]}")
    if not all(isinstance(v, str) for v in errors.values()):
        raise UntrustedOutput(f"{META}: an error reason is not a string")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in seconds.values()):
        raise UntrustedOutput(f"{META}: a timing is not a finite, non-negative number")
    return checks, {k: v[:MAX_REASON_CHARS] for k, v in errors.items()}, {k: float(v) for k, v in seconds.items()}


def read_outputs(path, expected_keys) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str], dict[str, float]]:
    """Grader side: (groups, errors, seconds) from the child's file, or UntrustedOutput saying why."""
    expected = frozenset(expected_keys)
    data = _read_file(path)
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        infos = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as e:
        raise UntrustedOutput(f"the output is not a readable zip ({e})") from None
    if len(infos) > MAX_MEMBERS:
        raise UntrustedOutput(f"the output holds {len(infos)} members, over the {MAX_MEMBERS} limit")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise UntrustedOutput("the output holds the same member twice")
    if sum(i.file_size for i in infos) > MAX_BYTES:
        raise UntrustedOutput(f"the output unpacks to over {MAX_BYTES} bytes")
    if META not in names:
        raise UntrustedOutput(f"the output lacks {META}")
    groups: dict[str, dict[str, np.ndarray]] = {}
    meta = None
    try:
        for info in infos:
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
                raise UntrustedOutput(f"{info.filename}: unsupported compression or encryption")
            if info.filename == META:
                if info.file_size > MAX_META_BYTES:
                    raise UntrustedOutput(f"{META} is over {MAX_META_BYTES} bytes")
                meta = z.read(info)
                continue
            if info.filename in (COVERAGE, COMPILE):  # read on their own by read_coverage, read_compile_seconds
                continue
            key, _, leaf = info.filename.rpartition("/")
            name = leaf[:-4] if leaf.endswith(".npy") else ""
            if not _KEY.fullmatch(key) or not _NAME.fullmatch(name):
                raise UntrustedOutput(f"unexpected member {info.filename[:200]!r}")
            if key not in expected:
                raise UntrustedOutput(f"outputs for a check that was not asked for: {key[:200]!r}")
            groups.setdefault(key, {})[name] = _array(z, info)
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as e:
        raise UntrustedOutput(f"the output zip is corrupt ({e})") from None
    checks, errors, seconds = _meta(meta, expected)
    for key in checks:  # a check with no arrays (an empty output group) still counts as produced
        groups.setdefault(key, {})
    if set(groups) != set(checks):
        raise UntrustedOutput(f"{META} lists other checks than the arrays hold")
    return groups, errors, seconds


def _json_member(path, name: str, limit: int):
    """The parsed JSON of one optional member of the child's zip (None when absent), as untrusted data."""
    data = _read_file(path)
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        info = next((i for i in z.infolist() if i.filename == name), None)
        if info is None:
            return None
        if info.file_size > limit:
            raise UntrustedOutput(f"{name} is over {limit} bytes")
        return json.loads(z.read(info).decode("utf-8"), parse_constant=lambda c: float("nan"))
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise UntrustedOutput(f"{name} is unreadable ({e})") from None


def read_compile_seconds(path, expected_keys) -> dict[str, float]:
    """Grader side: the child's compile seconds per check ({} when it wrote none), validated."""
    raw = _json_member(path, COMPILE, MAX_META_BYTES)
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not set(raw) <= set(expected_keys) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in raw.values()):
        raise UntrustedOutput(f"{COMPILE}: expected finite, non-negative seconds per requested check")
    return {k: float(v) for k, v in raw.items()}


def read_coverage(path) -> dict[str, dict[str, list]]:
    """Grader side: the child's coverage member ({} when it wrote none), validated as untrusted data:
    paths of candidate sources only, lines as ints, arcs as int pairs."""
    raw = _json_member(path, COVERAGE, MAX_COVERAGE_BYTES)
    if raw is None:
        return {}

    def ints(xs, arity):
        ok = isinstance(xs, list) and all(
            (isinstance(x, int) and not isinstance(x, bool)) if arity == 1 else
            (isinstance(x, list) and len(x) == 2 and all(isinstance(y, int) and not isinstance(y, bool) for y in x))
            for x in xs)
        if not ok:
            raise UntrustedOutput(f"{COVERAGE}: malformed line or arc list")
        return xs

    if not isinstance(raw, dict):
        raise UntrustedOutput(f"{COVERAGE} is not an object")
    out = {}
    for rel, entry in raw.items():
        if not isinstance(rel, str) or not _SOURCE.fullmatch(rel) or ".." in rel:
            raise UntrustedOutput(f"{COVERAGE}: unexpected source path {str(rel)[:200]!r}")
        if not isinstance(entry, dict) or set(entry) != {"lines", "arcs"}:
            raise UntrustedOutput(f"{COVERAGE}: {rel}: expected lines and arcs")
        out[rel] = {"lines": ints(entry["lines"], 1), "arcs": ints(entry["arcs"], 2)}
    return out
