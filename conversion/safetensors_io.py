"""Read an HF checkpoint directory into numpy (no torch): config.json + single or sharded safetensors.

Mirror of torch_sources/models/loading.py. Each tensor is a copy-on-write memory map of its byte range:
nothing is read until a consumer touches it (the conversion upcasts one tensor at a time), and the pages
it reads are the file's, which the kernel can drop. Every failure raises `CheckpointError` whose message
names the offending path.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "load_config", "read_header", "tensor_index", "load_state_dict"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names (little-endian on disk) -> numpy (bf16 and fp8 from ml_dtypes, as safetensors.numpy)
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
          "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


class CheckpointError(OSError):
    """A checkpoint directory that cannot be read (missing, incomplete or corrupt)."""


def _checkpoint_dir(path) -> Path:
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {d}")
    return d


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path.name} in checkpoint directory {path.parent}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid json: {e}") from None


def load_config(path) -> dict:
    """config.json of an HF checkpoint directory, as a dict."""
    return _read_json(_checkpoint_dir(path) / "config.json")


def read_header(path) -> dict[str, dict]:
    """{name: {"dtype", "shape", "data_offsets": [begin, end] in bytes from the file's start}} of one
    safetensors file, checked against the file's size; reads the header only."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out = {}
        for name, e in header.items():
            begin, end = (8 + n + int(x) for x in e["data_offsets"])
            want = math.prod(e["shape"]) * DTYPES[e["dtype"]].itemsize
            if end - begin != want or end > size:
                raise ValueError(f"{name}: bytes [{begin}, {end}) of {size} for {want} bytes of {e['dtype']}{e['shape']}")
            out[name] = {"dtype": e["dtype"], "shape": list(e["shape"]), "data_offsets": [begin, end]}
    except (OSError, struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e!r}") from None
    return out


def tensor_index(path) -> dict[str, tuple[Path, dict]]:
    """{HF name: (safetensors file, its header entry)} of every tensor of the checkpoint, from the headers
    (and the shard index) alone: no tensor is read."""
    d = _checkpoint_dir(path)
    if (d / SINGLE_FILE).is_file():
        return {name: (d / SINGLE_FILE, e) for name, e in read_header(d / SINGLE_FILE).items()}
    if not (d / INDEX_FILE).is_file():
        raise CheckpointError(f"no weights in {d}: expected {SINGLE_FILE} or {INDEX_FILE}")
    return _sharded_index(d)


def _sharded_index(d: Path) -> dict[str, tuple[Path, dict]]:
    """tensor_index of a release directory: the shard index's weight_map, each shard's header."""
    weight_map = _read_json(d / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{d / INDEX_FILE} has no weight_map")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise CheckpointError(f"{d / INDEX_FILE} names shard(s) missing from {d}: {missing}")
    index = {}
    for shard in shards:
        header = read_header(d / shard)
        wanted = sorted(name for name, s in weight_map.items() if s == shard)
        if set(wanted) - header.keys():
            raise CheckpointError(f"{d / shard} lacks tensors its index assigns to it: "
                                  f"{sorted(set(wanted) - header.keys())}")
        index.update({name: (d / shard, header[name]) for name in wanted})
    return index


def _mapped(file: Path, e: dict) -> np.ndarray:
    dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
    if end == begin or not shape:  # mmap refuses empty ranges; a scalar is a few bytes anyway
        return np.fromfile(file, dtype=dtype, count=math.prod(shape), offset=begin).reshape(shape)
    return np.memmap(file, dtype=dtype, mode="c", offset=begin, shape=shape)  # "c": writes stay private


def load_state_dict(path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint, keyed by their HF names, in their stored dtype (lazily mapped)."""
    return {name: _mapped(file, e) for name, (file, e) in tensor_index(path).items()}
