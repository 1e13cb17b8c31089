"""Read an HF checkpoint directory (config.json + model.safetensors or a sharded index) into torch.

The layout is exactly what `save_pretrained` writes, so a real release's directory loads too.
Every failure raises `CheckpointError` whose message names the offending path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

__all__ = ["CheckpointError", "load_config", "load_state_dict", "load_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def _load_sharded(d: Path) -> dict[str, torch.Tensor]:
    weight_map = _read_json(d / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{d / INDEX_FILE} has no weight_map")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise CheckpointError(f"{d / INDEX_FILE} names shard(s) missing from {d}: {missing}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = _load_file(d / shard)
        wanted = {name for name, s in weight_map.items() if s == shard}
        if wanted - part.keys():
            raise CheckpointError(f"{d / shard} lacks tensors its index assigns to it: {sorted(wanted - part.keys())}")
        tensors.update({name: part[name] for name in wanted})
    return tensors


def load_state_dict(path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, keyed by their HF names, in their stored dtype."""
    d = _checkpoint_dir(path)
    if (d / SINGLE_FILE).is_file():
        return _load_file(d / SINGLE_FILE)
    if (d / INDEX_FILE).is_file():
        return _load_sharded(d)
    raise CheckpointError(f"no weights in {d}: expected {SINGLE_FILE} or {INDEX_FILE}")


def load_pretrained(build, config, path) -> torch.nn.Module:
    """`build(config)` on the meta device, every parameter assigned from the checkpoint (fp32), eval mode.
    A tied release may store no head, or the shared copy."""
    state = {k: v.to(torch.float32) for k, v in load_state_dict(path).items()}
    with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
        model = build(config)
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
