"""Read an HF checkpoint directory (config.json + model.safetensors or a sharded index) into torch.

The layout is exactly what `save_pretrained` writes, so a real release's directory loads too.
Tensors are read one at a time from the safetensors headers' byte ranges (no mmap held open), so
loading a model costs its fp32 parameters plus one stored tensor, whatever the checkpoint's size.
Every failure raises `CheckpointError` whose message names the offending path.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["CheckpointError", "load_config", "read_header", "tensor_index", "load_file", "iter_tensors",
           "load_state_dict", "load_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names (little-endian on disk) -> torch
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


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


def load_file(path, names=None) -> dict[str, torch.Tensor]:
    """The named tensors (default: all) of one safetensors file, in their stored dtype, each read from its
    byte range into its own buffer."""
    path = Path(path)
    header = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name in sorted(header) if names is None else names:
            e = header[name]
            begin, end = e["data_offsets"]
            dtype = DTYPES[e["dtype"]]
            if end == begin:
                out[name] = torch.empty(e["shape"], dtype=dtype)
                continue
            buf = bytearray(end - begin)
            f.seek(begin)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): "
                                      f"short read of {name}")
            out[name] = torch.frombuffer(buf, dtype=dtype).reshape(e["shape"])
    return out


def iter_tensors(path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in its stored dtype) of every tensor of the checkpoint, one read at a time."""
    for name, (file, _) in tensor_index(path).items():
        yield name, load_file(file, [name])[name]


def load_state_dict(path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, keyed by their HF names, in their stored dtype."""
    return dict(iter_tensors(path))


def load_pretrained(build, config, path) -> torch.nn.Module:
    """`build(config)` on the meta device, every parameter assigned from the checkpoint (fp32), eval mode.
    Tensors stream in one at a time and are upcast as they arrive, so the peak is the fp32 parameters plus
    one stored tensor. A tied release may store no head, or the shared copy."""
    with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
        model = build(config)
    state = {name: tensor.to(torch.float32) for name, tensor in iter_tensors(path)}
    head = getattr(model, "lm_head", None)
    tied = head is not None and config.tie_word_embeddings
    embed_name = next(n for n, _ in model.named_parameters() if n.endswith("word_embeddings.weight")
                      or n.endswith("embed_tokens.weight"))
    if tied:
        state.setdefault("lm_head.weight", state[embed_name])
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.get_parameter(embed_name)
    return model.eval()
